//! Helpers shared by the GPT integration tests.

use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_rank};

/// A run of `steps` on the embedded corpus (windows from `data_seed`, init from `seed`).
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
pub fn train(ranks: usize, spec: &RunSpec) -> RunReport {
    let (_, reports) = launch(ranks, Duration::from_secs(120), |comm| run_rank(spec, comm))
        .expect("training runs");
    let first = reports[0].clone();
    for r in &reports {
        assert_eq!(r.losses, first.losses, "every rank reports the same losses");
    }
    first
}

/// Largest relative difference between two loss curves of the same length.
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs())
        .fold(0.0, f64::max)
}
