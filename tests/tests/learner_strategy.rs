//! `DeepSpeedStrategy` inside Burn's `SupervisedTraining`: two data-parallel ranks train the
//! GPT example through the Learner API, at ZeRO stages 0 to 3.

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
    train_with(
        &format!(r#"{{"stage": {stage}, "reduce_bucket_size": 2000}}"#),
        epochs,
    )
}

/// The Learner's AdamW on 2 ranks for `epochs` with `zero` as `zero_optimization`.
fn train_with(zero: &str, epochs: usize) -> Gpt {
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
        r#"{{"gradient_clipping": 1.0, "train_batch_size": 8, "zero_optimization": {zero}}}"#
    ))
    .expect("valid config");
    let strategy = DeepSpeedStrategy::new(config, 2);
    // Stage 3 shards the model before the Learner holds it (a no-op at stages 0-2).
    let model = strategy.prepare_model(model);
    let dir = tempfile::tempdir().expect("temp dir");
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .num_epochs(epochs)
        .launch(Learner::new(model, AdamWConfig::new().init(), 3e-3));
    assert!(result.error.is_none(), "{:?}", result.error);
    result.model
}

/// ZeRO stages 1 to 3 in the strategy: at stages 1-2 each rank steps its own whole tensors
/// with the Learner's optimizer, at stage 3 its chunks (with every tensor partitioned, and
/// with small tensors kept whole and a prefetch bucket); the model equals stage 0's.
#[test]
fn zero_stages_in_the_strategy_match_stage_0() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let base = flat(&train_at_stage(0, 1));
    let runs = [
        ("stage 1", r#"{"stage": 1, "reduce_bucket_size": 2000}"#),
        ("stage 2", r#"{"stage": 2, "reduce_bucket_size": 2000}"#),
        (
            "stage 3",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 0}"#,
        ),
        (
            "stage 3, persistent below 100, prefetch 5000",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 100,
                "stage3_prefetch_bucket_size": 5000}"#,
        ),
    ];
    for (name, zero) in runs {
        let z = flat(&train_with(zero, 1));
        assert_eq!(z.len(), base.len(), "{name}: the model comes back whole");
        let diff = base
            .iter()
            .zip(&z)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("{name}: max parameter difference to stage 0 {diff:e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
    }
}

/// Launches a short training of an unprepared model on 2 ranks with `config` (panics where
/// the strategy refuses it).
fn launch_unprepared(config: &str, checkpointers: bool) {
    let device = Device::flex().autodiff();
    let data = windows(&EMBEDDED_CORPUS[..33 * 16], SHAPE.seq_len);
    let loader = || {
        DataLoaderBuilder::new(WindowBatcher)
            .batch_size(4)
            .set_device(Device::flex())
            .build(InMemDataset::new(data.clone()))
    };
    let (config, _) = DeepSpeedConfig::from_json_str(config).expect("valid config");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut training = SupervisedTraining::new(dir.path(), loader(), loader())
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(DeepSpeedStrategy::new(
            config, 2,
        ))))
        .num_epochs(1);
    if checkpointers {
        training = training.with_default_checkpointers();
    }
    let _ = training.launch(Learner::new(
        Gpt::new(SHAPE, 5, &device),
        AdamWConfig::new().init(),
        3e-3,
    ));
}

/// Stage 3 needs the model prepared before the Learner is built.
#[test]
#[should_panic(expected = "DeepSpeedStrategy::prepare_model")]
fn stage_3_without_prepare_model_is_refused() {
    launch_unprepared(r#"{"zero_optimization": {"stage": 3}}"#, false);
}

#[test]
fn supervised_training_with_two_ranks_learns() {
    let before = eval_loss(&Gpt::new(SHAPE, 5, &Device::flex().autodiff()));
    let after = eval_loss(&train_at_stage(0, 3));
    println!("held-out loss {before:.4} -> {after:.4}");
    assert!(after < before - 0.3, "loss {before} -> {after}");
}

/// At stages 1-3 the Learner's checkpointer would save rank 0's optimizer partition as if it
/// were the whole state: refused, with the engine's checkpoints named instead.
#[test]
#[should_panic(expected = "DeepSpeedEngine::save_checkpoint")]
fn learner_checkpoints_at_stage_2_are_refused() {
    launch_unprepared(r#"{"zero_optimization": {"stage": 2}}"#, true);
}
