//! README.md's two quick starts, copied out of the README verbatim by
//! `scripts/readme-quick-starts.sh` (in place of the two `QUICK START` lines), around the
//! classifier example's model and data: what a user's own crate would hold.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::tensor::Device;
use burn_deepspeed::DeepSpeedEngine;
use burn_deepspeed_example_classifier::{Classifier, PointBatch, PointBatcher, evaluate, two_moons};

/// The user's model.
fn your_model() -> Classifier {
    let device = Device::flex().autodiff();
    device.seed(11);
    Classifier::new(32, &device)
}

/// The user's data: this rank's micro-batches of step `step`, 8 points each.
fn your_micro_batches(
    step: usize,
    rank: usize,
    engine: &DeepSpeedEngine<Classifier>,
) -> Vec<PointBatch> {
    let device = engine.device().unwrap_or_else(|| Device::flex().autodiff());
    let points = two_moons(16_000, 0.15, 1);
    let micro = engine.batch().gradient_accumulation_steps as usize;
    (0..micro)
        .map(|m| {
            let at = ((step * micro + m) * 2 + rank) * 8 % (points.len() - 8);
            PointBatcher.batch(points[at..at + 8].to_vec(), &device)
        })
        .collect()
}

fn learner_quick_start(
    model: Classifier,
    train: Arc<dyn DataLoader<PointBatch>>,
    valid: Arc<dyn DataLoader<PointBatch>>,
) -> burn_deepspeed::Result<Classifier> {
    // QUICK START: learner
    match result.error {
        None => Ok(result.model),
        Some(e) => Err(burn_deepspeed::DeepSpeedError::LearnerStrategy(e.to_string())),
    }
}

fn engine_quick_start() -> burn_deepspeed::Result<Vec<f64>> {
    // QUICK START: engine
    Ok(last_losses)
}

fn main() -> burn_deepspeed::Result<()> {
    let device = Device::flex();
    let points = two_moons(1200, 0.15, 1);
    let (train, valid) = points.split_at(1000);
    let loader = |points: &[_]| {
        DataLoaderBuilder::new(PointBatcher)
            .batch_size(8)
            .set_device(device.clone())
            .build(InMemDataset::new(points.to_vec()))
    };
    let model = your_model();
    let (before, _) = evaluate(&model.valid(), valid, &device);
    let model = learner_quick_start(model, loader(train), loader(valid))?;
    let (after, _) = evaluate(&model.valid(), valid, &device);
    println!("learner quick start: held-out loss {before:.4} -> {after:.4}");

    let model = your_model();
    let (first, _) = evaluate(&model.valid(), valid, &device);
    let last = engine_quick_start()?;
    println!("engine quick start: loss {first:.4} (held out, untrained) -> {last:?} (last step)");
    Ok(())
}
