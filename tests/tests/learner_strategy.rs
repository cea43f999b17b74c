//! `DeepSpeedStrategy` inside Burn's `SupervisedTraining`: two data-parallel ranks train the
//! GPT example through the Learner API, at ZeRO stage 0, 1 and 2.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn::train::{InferenceStep, Learner, SupervisedTraining, TrainingStrategy};
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::engine::flat::{ParamLayout, params_to_flat};
use burn_deepspeed::strategy::DeepSpeedStrategy;
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS, WindowBatcher, windows};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
};

fn eval_loss(model: &Gpt) -> f64 {
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 99);
    let batch = corpus.batch(0, 0, 16, SHAPE.seq_len, &Device::flex());
    let out = InferenceStep::step(model, batch);
    out.loss.into_scalar::<f32>() as f64
}

/// The Learner's AdamW on 2 ranks for `epochs`, at ZeRO `stage`.
fn train_at_stage(stage: u8, epochs: usize) -> Gpt {
    let device = Device::flex().autodiff();
    let data = windows(&EMBEDDED_CORPUS[..33 * 96], SHAPE.seq_len);
    let train = DataLoaderBuilder::new(WindowBatcher)
        .batch_size(4)
        .set_device(Device::flex())
        .build(InMemDataset::new(data[..80].to_vec()));
    let valid = DataLoaderBuilder::new(WindowBatcher)
        .batch_size(4)
        .set_device(Device::flex())
        .build(InMemDataset::new(data[80..].to_vec()));
    let model = Gpt::new(SHAPE, 5, &device);
    let (config, _) = DeepSpeedConfig::from_json_str(&format!(
        r#"{{"gradient_clipping": 1.0, "train_batch_size": 8,
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 2000}}}}"#
    ))
    .expect("valid config");
    let dir = tempfile::tempdir().expect("temp dir");
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(DeepSpeedStrategy::new(
            config, 2,
        ))))
        .num_epochs(epochs)
        .launch(Learner::new(model, AdamWConfig::new().init(), 3e-3));
    assert!(result.error.is_none(), "{:?}", result.error);
    result.model
}

/// ZeRO stages 1 and 2 in the strategy: each rank steps its own whole tensors with the
/// Learner's optimizer; the model equals stage 0's.
#[test]
fn zero_stages_in_the_strategy_match_stage_0() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let base = flat(&train_at_stage(0, 1));
    for stage in [1, 2] {
        let z = flat(&train_at_stage(stage, 1));
        let diff = base
            .iter()
            .zip(&z)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("stage {stage}: max parameter difference to stage 0 {diff:e}");
        assert!(diff <= 1e-5, "stage {stage}: {diff}");
    }
}

#[test]
fn supervised_training_with_two_ranks_learns() {
    let before = eval_loss(&Gpt::new(SHAPE, 5, &Device::flex().autodiff()));
    let after = eval_loss(&train_at_stage(0, 3));
    println!("held-out loss {before:.4} -> {after:.4}");
    assert!(after < before - 0.3, "loss {before} -> {after}");
}
