//! Helpers shared by the GPT integration tests.

use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_rank};

/// A run of `steps` on the embedded corpus (windows from `data_seed`, init from `seed`).
#[allow(dead_code)]
pub fn spec(
    config: DeepSpeedConfig,
    shape: GptShape,
    steps: u64,
    data_seed: u64,
    seed: u64,
) -> RunSpec {
    RunSpec::on_embedded_corpus(config, shape, steps, data_seed, seed)
}

/// Trains `spec` on `ranks` thread ranks; checks that every rank reports the same losses and
/// returns rank 0's report.
#[allow(dead_code)]
pub fn train(ranks: usize, spec: &RunSpec) -> RunReport {
    let (_, reports) = launch(ranks, Duration::from_secs(120), |comm| run_rank(spec, comm))
        .expect("training runs");
    let first = reports[0].clone();
    for r in &reports {
        assert_eq!(r.losses, first.losses, "every rank reports the same losses");
    }
    first
}

/// Largest relative difference between two loss curves of the same length; a NaN anywhere
/// counts as an infinite difference (so a diverged run never passes a parity check).
#[allow(dead_code)]
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| nan_is_infinite((x - y).abs() / x.abs()))
        .fold(0.0, f64::max)
}

/// Largest absolute difference between two parameter (or moment) vectors of the same length;
/// a NaN anywhere counts as an infinite difference.
#[allow(dead_code)]
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| nan_is_infinite((*x as f64 - *y as f64).abs()))
        .fold(0.0, f64::max)
}

/// ‖a − b‖ / ‖b‖ over two vectors of the same length; NaN counts as infinite.
#[allow(dead_code)]
pub fn rel_norm_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sq = |it: &mut dyn Iterator<Item = f64>| it.map(|v| v * v).sum::<f64>().sqrt();
    let diff = sq(&mut a.iter().zip(b).map(|(x, y)| *x as f64 - *y as f64));
    let norm = sq(&mut b.iter().map(|y| *y as f64));
    nan_is_infinite(diff / norm.max(f64::MIN_POSITIVE))
}

fn nan_is_infinite(d: f64) -> f64 {
    if d.is_nan() { f64::INFINITY } else { d }
}

/// Asserts that a run learns: every loss is finite and the mean of the last third is below
/// the first loss.
#[allow(dead_code)]
pub fn assert_learns(losses: &[f64], what: &str) {
    assert!(
        losses.iter().all(|l| l.is_finite()),
        "{what}: a loss is not finite: {losses:?}"
    );
    let tail = &losses[losses.len() - losses.len().div_ceil(3)..];
    let mean = tail.iter().sum::<f64>() / tail.len() as f64;
    assert!(
        mean < losses[0],
        "{what}: the loss does not fall ({} -> mean {mean} over the last {}): {losses:?}",
        losses[0],
        tail.len()
    );
}
