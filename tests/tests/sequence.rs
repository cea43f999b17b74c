//! DeepSpeed-Ulysses sequence parallelism (arXiv 2309.14509) in the engine: the GPT with each
//! sequence cut over 2 and 4 ranks follows the run that holds whole sequences (losses,
//! gradient norms and final parameters), alone and beside data parallelism at ZeRO stages
//! 0-3; what it does not run beside is refused by key.
//!
//! The gradient convention, pinned here: each rank's loss is the mean over its own block of
//! positions, and the engine averages gradients over every rank of the data group (the
//! replicas and the blocks of a sequence together). With equal blocks that average is the
//! gradient of the mean over whole sequences, so the run equals the unsplit one; DeepSpeed
//! sums over the sequence ranks instead and scales the loss to match.

use crate::common;

use std::time::Duration;

use crate::common::{assert_learns, max_abs_diff, max_rel_diff};
use burn::tensor::Device;
use burn_deepspeed::grid::Grid;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape, LongContext};
use burn_deepspeed_example_gpt::run::RunReport;

/// 4 sequences per step in micro-batches of 2 at ZeRO `stage`, sequences cut over `sp`, the
/// layers sliced over `tp`. At a learning rate of 1e-3 the 20 steps learn without a spike; at
/// 2e-3 the loss jumps at step 5 and the runs' f32 rounding differences (3e-7 at the first
/// steps) grow to 3e-4 by step 18, which measures the trajectory's sensitivity, not the
/// exchanges.
fn config(sp: usize, stage: u8) -> DeepSpeedConfig {
    sliced_config(sp, 1, stage)
}

fn sliced_config(sp: usize, tp: usize, stage: u8) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.5,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "sequence_parallel_size": {sp}, "tensor_parallel": {{"tp_size": {tp}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 20000,
              "stage3_param_persistence_threshold": 0}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn train(ranks: usize, config: DeepSpeedConfig, steps: u64) -> RunReport {
    train_keeping(ranks, config, steps, LongContext::default())
}

fn train_keeping(
    ranks: usize,
    config: DeepSpeedConfig,
    steps: u64,
    long_context: LongContext,
) -> RunReport {
    let mut spec = common::spec(config, GptShape::TINY, steps, 3, 11);
    spec.long_context = long_context;
    common::train(ranks, &spec)
}

/// The run with cut sequences against the one with whole sequences: losses within 1e-5 and
/// gradient norms within 1e-4 relative at every step, the final parameters within 1e-4.
fn assert_follows(base: &RunReport, cut: &RunReport, what: &str) {
    let loss = max_rel_diff(&base.losses, &cut.losses);
    let norm = max_rel_diff(&base.grad_norms, &cut.grad_norms);
    let params = max_abs_diff(&base.final_params, &cut.final_params);
    println!("{what}: max rel loss diff {loss:.2e}, grad norm {norm:.2e}, param {params:.2e}");
    assert!(loss <= 1e-5, "{what}: losses differ by {loss}");
    assert!(norm <= 1e-4, "{what}: gradient norms differ by {norm}");
    assert!(params <= 1e-4, "{what}: parameters differ by {params}");
    assert_learns(&cut.losses, what);
}

/// Ulysses' volume of one step of GPT `tiny` (4 layers, d 128, context 128) at `sp` with one
/// replica, as the sequence group's communicator counts it: per micro-batch and layer, q, k,
/// v and the attention's output exchanged once in the forward and once in the backward, each
/// a rank's `micro · (seq / sp) · d` f32 values; one replica takes 2 micro-batches of 2 per
/// step.
fn ulysses_bytes(sp: usize) -> u64 {
    let (layers, micro, seq, d) = (4, 2, 128, 128);
    let per_layer = 2 * 4 * micro * (seq / sp) * d * 4;
    (per_layer * layers * (4 / micro)) as u64
}

/// GPT `tiny` (4 heads, context 128) over 20 steps: sequences cut over 2 and 4 ranks, and
/// cut over 2 ranks beside 2 replicas, follow one rank with whole sequences; cut over 2 ranks
/// beside a tensor slicing of 2 follow the sliced model with whole sequences; each at ZeRO
/// stages 0-3 (ZeRO partitions over every rank of the data group, the sequence ranks
/// included). The references run once, at stage 0: the stages' own parity with it is the
/// `zero` suite's.
#[test]
fn cut_sequences_follow_whole_ones() {
    const STEPS: u64 = 20;
    let whole = train(1, config(1, 0), STEPS);
    let sliced = train(2, sliced_config(1, 2, 0), STEPS);
    for stage in 0..=3 {
        for sp in [2, 4] {
            let cut = train(sp, config(sp, stage), STEPS);
            assert_follows(
                &whole,
                &cut,
                &format!("sp {sp}, one replica, stage {stage}"),
            );
            assert_eq!(
                cut.comm_bytes_per_axis[0].sequence,
                ulysses_bytes(sp) * STEPS,
                "sp {sp}: the sequence group's bytes are Ulysses' volume"
            );
        }
        let cut = train(4, config(2, stage), STEPS);
        assert_follows(&whole, &cut, &format!("sp 2 x dp 2, stage {stage}"));
        let cut = train(4, sliced_config(2, 2, stage), STEPS);
        assert_follows(&sliced, &cut, &format!("sp 2 x tp 2, stage {stage}"));
    }
}

/// In bf16 the exchanges move the working copy's 16-bit activations: half of Ulysses' fp32
/// volume. The cut run follows the whole one in bf16 too, within bf16's rounding.
#[test]
fn half_precision_exchanges_move_two_bytes_a_value() {
    const STEPS: u64 = 4;
    let bf16 = |sp: usize| {
        let mut c = config(sp, 0);
        c.bf16.enabled = true;
        c
    };
    let whole = train(1, bf16(1), STEPS);
    let cut = train(2, bf16(2), STEPS);
    assert_eq!(
        cut.comm_bytes_per_axis[0].sequence,
        ulysses_bytes(2) * STEPS / 2,
        "bf16 exchanges move 2 bytes a value"
    );
    let loss = max_rel_diff(&whole.losses, &cut.losses);
    println!("bf16 sp 2: max rel loss diff {loss:.2e}");
    assert!(loss <= 1e-2, "bf16 sp 2: losses differ by {loss}");
}

/// ALST's memory side keeps the trajectory: blockwise attention with the MLP and the loss in
/// tiles of 48 positions (which do not divide the 128-position context, nor its halves),
/// alone, under block checkpoints held in host memory (`cpu_checkpointing`), and with the
/// sequences cut over 2 ranks, follows the GPT that keeps every activation.
#[test]
fn long_context_memory_keeps_the_trajectory() {
    const STEPS: u64 = 4;
    let long = LongContext {
        blockwise_attention: true,
        tile: Some(48),
    };
    let whole = train(1, config(1, 0), STEPS);
    let tiled = train_keeping(1, config(1, 0), STEPS, long);
    assert_follows(&whole, &tiled, "blockwise attention, tiles of 48");
    let mut checkpointed = config(1, 0);
    checkpointed.activation_checkpointing =
        Some(serde_json::from_str(r#"{"cpu_checkpointing": true}"#).expect("a valid section"));
    let run = train_keeping(1, checkpointed, STEPS, long);
    assert_follows(&whole, &run, "tiles under block checkpoints in host memory");
    let host = run
        .checkpoint_host_bytes
        .expect("the bytes kept in host memory");
    // Each step's 2 micro-batches keep each of the 4 blocks' input, [2, 128, 128] f32.
    assert_eq!(
        host,
        2 * 4 * 2 * 128 * 128 * 4,
        "bytes of checkpoints in host memory"
    );
    let cut = train_keeping(2, config(2, 0), STEPS, long);
    assert_follows(&whole, &cut, "sp 2, blockwise attention, tiles of 48");
}

/// What sequence parallelism does not run beside is refused by key: without a grid, with heads
/// (a tensor-parallel rank's, when sliced) or a world it does not divide; and in the Learner
/// strategy and the pipeline engine (`config::support`).
#[test]
fn what_it_does_not_run_beside_is_refused_by_key() {
    let refused = |ranks: usize, sp: usize, extra: &str, tiny_heads: usize| {
        let text = format!(r#"{{"train_batch_size": 8, "sequence_parallel_size": {sp} {extra}}}"#);
        let (config, _) = DeepSpeedConfig::from_json_str(&text).expect("valid config");
        let result = launch(ranks, Duration::from_secs(60), |comm| {
            let device = Device::flex().autodiff();
            let shape = GptShape {
                heads: tiny_heads,
                ..GptShape::TINY
            };
            let grid = Grid::from_config(&config, comm.clone(), &device)?;
            let model = Gpt::new(shape, 1, &device)
                .sliced(grid.tensor_parallel())?
                .with_sequence_parallel(grid.sequence_parallel())?;
            DeepSpeedEngine::with_grid(model, config.clone(), &grid).map(|_| ())
        });
        result.expect_err("refused").to_string()
    };
    let e = refused(4, 3, "", 4);
    assert!(e.contains("sequence_parallel_size"), "{e}");
    let e = refused(2, 2, "", 3);
    assert!(e.contains("3 attention heads"), "{e}");
    // Sliced over 2, a rank holds 2 of 4 heads, which do not split over 4 sequence ranks.
    let e = refused(8, 4, r#", "tensor_parallel": {"tp_size": 2}"#, 4);
    assert!(e.contains("2 attention heads"), "{e}");
    // Without a grid, the engine names the way.
    let (config, _) =
        DeepSpeedConfig::from_json_str(r#"{"train_batch_size": 8, "sequence_parallel_size": 2}"#)
            .expect("valid config");
    let result = launch(2, Duration::from_secs(60), |comm| {
        let model = Gpt::new(GptShape::TINY, 1, &Device::flex().autodiff());
        DeepSpeedEngine::new(model, config.clone(), comm).map(|_| ())
    });
    let e = result.expect_err("refused").to_string();
    assert!(e.contains("with_grid"), "{e}");
    use burn_deepspeed::config::{EntryPoint, check_supported};
    for entry in [
        EntryPoint::Pipeline,
        EntryPoint::Strategy {
            checkpointer: false,
        },
    ] {
        let e = check_supported(&config, entry).expect_err("refused");
        assert!(
            e.to_string().contains("sequence_parallel_size"),
            "{entry:?}: {e}"
        );
    }
}
