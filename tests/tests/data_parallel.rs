//! Data-parallel training of the GPT example: the trajectory does not depend on the number of
//! ranks, the bucket size or how the global batch is split into micro-batches.

use std::time::Duration;

use crate::common;

use crate::common::max_rel_diff;
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_rank};

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
    moe: None,
};

fn config(extra: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 8, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}}
            {extra}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn train(ranks: usize, config: DeepSpeedConfig, steps: u64) -> RunReport {
    common::train(ranks, &common::spec(config, SHAPE, steps, 11, 3))
}

#[test]
fn two_ranks_reproduce_one_rank_over_20_steps() {
    let one = train(1, config(""), 20);
    let two = train(2, config(""), 20);
    let diff = max_rel_diff(&one.losses, &two.losses);
    println!(
        "losses world 1: {:?}\nlosses world 2: {:?}\nmax rel diff {diff:e}",
        one.losses, two.losses
    );
    assert!(diff <= 1e-4, "max relative loss difference {diff}");
    // It learns.
    assert!(two.losses[19] < two.losses[0] * 0.8, "{:?}", two.losses);
    // Stage 0 per rank, measured: 4Ψ params + 4Ψ gradient buffer + 8Ψ AdamW state (Burn's
    // state tensors), as the formula says; the peak adds the gradients of backward.
    let psi = one.params as u64;
    assert_eq!(two.model_state_bytes_per_rank, 16 * psi);
    assert_eq!(two.model_state_bytes_formula, 16 * psi);
    assert!(two.peak_model_state_bytes_per_rank >= 20 * psi);
    // Each step the thread transport copies each rank's fp32 gradient once into the
    // all-reduce (4Ψ bytes) and a few scalars; at 2 ranks the ring model's 2 (N-1)/N · 4Ψ is
    // the same, and the initial broadcast of the parameters adds 4Ψ to rank 0.
    for (r, (&measured, &model)) in two
        .comm_bytes_per_rank
        .iter()
        .zip(&two.comm_bytes_model_per_rank)
        .enumerate()
    {
        let want = 20 * 4 * psi + if r == 0 { 4 * psi } else { 0 };
        for (what, got) in [("measured", measured), ("ring model", model)] {
            let ratio = got as f64 / want as f64;
            println!("rank {r} {what}: {got} bytes, formula {want} ({ratio:.5})");
            assert!(
                (ratio - 1.0).abs() < 0.01,
                "rank {r} {what}: {got} vs {want}"
            );
        }
    }
    assert_eq!(one.comm_bytes_per_rank, vec![0]);
}

#[test]
fn accumulation_and_buckets_do_not_change_the_trajectory() {
    let plain = train(1, config(""), 6);
    // Three ranks would not divide 8; two ranks x 2 micro-batches of 2, small buckets.
    let accumulated = train(
        2,
        config(
            r#", "train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {"reduce_bucket_size": 1000}"#,
        ),
        6,
    );
    assert_eq!(accumulated.gradient_accumulation_steps, 2);
    let diff = max_rel_diff(&plain.losses, &accumulated.losses);
    assert!(diff <= 1e-4, "max relative loss difference {diff}");
    let four = train(
        4,
        config(r#", "prescale_gradients": true, "gradient_predivide_factor": 2.0"#),
        6,
    );
    let diff = max_rel_diff(&plain.losses, &four.losses);
    assert!(
        diff <= 1e-4,
        "world 4 with prescaling: max relative loss difference {diff}"
    );
}

#[test]
fn unsupported_settings_are_refused_with_the_key() {
    let spec = RunSpec::on_embedded_corpus(
        config(r#", "zero_optimization": {"stage": 2, "mics_shard_size": 2}"#),
        SHAPE,
        1,
        1,
        1,
    );
    let err = launch(1, Duration::from_secs(30), |comm| run_rank(&spec, comm))
        .expect_err("MiCS is refused")
        .to_string();
    assert!(err.contains("zero_optimization.mics_shard_size"), "{err}");

    let mut spec = spec;
    spec.config = config("");
    spec.config.train_batch_size = Some(9);
    let err = launch(2, Duration::from_secs(30), |comm| run_rank(&spec, comm))
        .expect_err("9 samples do not split over 2 ranks")
        .to_string();
    assert!(err.contains("(9)") && err.contains("(2)"), "{err}");
}

#[test]
fn a_failing_rank_fails_the_run_instead_of_hanging() {
    let spec = RunSpec::on_embedded_corpus(config(""), SHAPE, 3, 1, 1);
    let start = std::time::Instant::now();
    let result = launch(2, Duration::from_secs(60), |comm| {
        if comm.rank() == 1 {
            panic!("rank 1 crashes before training");
        }
        run_rank(&spec, comm)
    });
    let err = result.expect_err("the run fails").to_string();
    assert!(err.contains("rank 1"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

/// The difference helpers the parity tests use cannot pass a NaN.
#[test]
fn a_nan_is_an_infinite_difference() {
    use crate::common::{max_abs_diff, rel_norm_diff};
    assert_eq!(max_rel_diff(&[1.0, 2.0], &[1.0, f64::NAN]), f64::INFINITY);
    assert_eq!(max_rel_diff(&[f64::NAN], &[1.0]), f64::INFINITY);
    assert_eq!(max_abs_diff(&[1.0], &[f32::NAN]), f64::INFINITY);
    assert_eq!(rel_norm_diff(&[f32::NAN], &[1.0]), f64::INFINITY);
    assert_eq!(max_rel_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
}
