//! Trains the two-moons classifier with Burn's `SupervisedTraining` and burn-deepspeed's
//! `DeepSpeedStrategy`: ZeRO stage 2 on 2 ranks (threads of this process, or processes under
//! `mpirun -n 2` with `--features mpi`). The config is `ds_config.json` beside this crate.
//!
//! `cargo run -p burn-deepspeed-example-classifier`

use std::process::ExitCode;
use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::tensor::Device;
use burn::train::{SupervisedTraining, TrainingStrategy};
use burn_deepspeed::prelude::*;
use burn_deepspeed_example_classifier::{Classifier, PointBatcher, evaluate, two_moons};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let device = Device::flex();
    // The same initial model on every run.
    device.seed(7);
    let points = two_moons(1200, 0.15, 1);
    let (train, valid) = points.split_at(1000);
    let model = Classifier::new(64, &device.clone().autodiff());
    let (loss, accuracy) = evaluate(&model.valid(), valid, &device);
    println!(
        "before training: held-out loss {loss:.4}, accuracy {:.1}%",
        100.0 * accuracy
    );

    let config_path = concat!(env!("CARGO_MANIFEST_DIR"), "/ds_config.json");
    let (config, _warnings) = DeepSpeedConfig::from_file(config_path)?;
    // ZeRO stage 2 over 2 ranks: each rank keeps half of the gradients and of AdamW's state.
    let strategy = DeepSpeedStrategy::new(config, 2);
    let model = strategy.prepare_model(model);
    let learner = strategy.learner(model)?;
    // Each rank reads its own part of the training set, 8 points per micro-batch (the
    // config's 16 over 2 ranks).
    let loader = |points: &[_], seed| {
        DataLoaderBuilder::new(PointBatcher)
            .batch_size(8)
            .shuffle(seed)
            .set_device(device.clone())
            .build(InMemDataset::new(points.to_vec()))
    };
    let artifacts = std::env::temp_dir().join("burn-deepspeed-classifier");
    let result = SupervisedTraining::new(&artifacts, loader(train, 2), loader(valid, 3))
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .num_epochs(4)
        .launch(learner);
    if let Some(error) = result.error {
        return Err(DeepSpeedError::LearnerStrategy(error.to_string()));
    }
    let (loss, accuracy) = evaluate(&result.model.valid(), valid, &device);
    println!(
        "after 4 epochs:  held-out loss {loss:.4}, accuracy {:.1}%",
        100.0 * accuracy
    );
    Ok(())
}
