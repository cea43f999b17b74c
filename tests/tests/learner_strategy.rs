//! `DeepSpeedStrategy` inside Burn's `SupervisedTraining`: two data-parallel ranks train the
//! GPT example through the Learner API.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn::train::{InferenceStep, Learner, SupervisedTraining, TrainingStrategy};
use burn_deepspeed::DeepSpeedConfig;
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

#[test]
fn supervised_training_with_two_ranks_learns() {
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
    let before = eval_loss(&model);
    let (config, _) =
        DeepSpeedConfig::from_json_str(r#"{"gradient_clipping": 1.0, "train_batch_size": 8}"#)
            .expect("valid config");
    let strategy = DeepSpeedStrategy::new(config, 2);
    let dir = tempfile::tempdir().expect("temp dir");
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .num_epochs(3)
        .launch(Learner::new(model, AdamWConfig::new().init(), 3e-3));
    assert!(result.error.is_none(), "{:?}", result.error);
    let after = eval_loss(&result.model);
    println!("held-out loss {before:.4} -> {after:.4}");
    assert!(after < before - 0.3, "loss {before} -> {after}");
}
