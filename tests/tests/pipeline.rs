//! Pipeline parallelism on the GPT example: every (pp, dp) grid follows the single-rank
//! trajectory with the same global batch, the stages hold at most min(S − s, M) activations,
//! and a failing stage fails the others instead of hanging.

use std::time::Duration;

use crate::common;

use crate::common::max_rel_diff;
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, run_rank};

/// Four pipeline layers: the embeddings, two blocks, the head.
const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
    moe: None,
};
const MICRO_BATCHES: u64 = 8;

/// One micro-batch of one sample per replica, `MICRO_BATCHES` of them per step; with
/// `stages: None`, the plain data-parallel engine.
fn config(stages: Option<usize>, replicas: u64, extra: &str) -> DeepSpeedConfig {
    let pipeline = stages.map_or(String::new(), |s| {
        format!(r#", "pipeline": {{"stages": {s}, "partition": "parameters"}}"#)
    });
    let text = format!(
        r#"{{"train_batch_size": {}, "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}}
            {pipeline}{extra}}}"#,
        MICRO_BATCHES * replicas
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn train(ranks: usize, config: DeepSpeedConfig, steps: u64) -> RunReport {
    common::train(ranks, &common::spec(config, SHAPE, steps, 5, 9))
}

#[test]
fn every_grid_follows_the_single_rank_run() {
    const STEPS: u64 = 8;
    for (pp, dp) in [(1usize, 4u64), (2, 2), (4, 1)] {
        // The reference: one rank, the same global batch (8·dp samples) in 8·dp micro-batches.
        let mut reference = config(None, dp, "");
        reference.gradient_accumulation_steps = Some(MICRO_BATCHES * dp);
        let one = train(1, reference, STEPS);
        let grid = train(pp * dp as usize, config(Some(pp), dp, ""), STEPS);
        let diff = max_rel_diff(&one.losses, &grid.losses);
        println!("(pp {pp}, dp {dp}): max rel loss diff {diff:e} over {STEPS} steps");
        assert!(diff <= 1e-4, "(pp {pp}, dp {dp}): {diff}");
        assert!(grid.losses[STEPS as usize - 1] < grid.losses[0]);
        assert_eq!(
            (grid.pipeline_stages, grid.data_parallel),
            (pp, dp as usize)
        );
        assert_eq!(grid.params, one.params);
        let live = grid
            .peak_live_activations_per_stage
            .clone()
            .expect("pipelined");
        let m = MICRO_BATCHES as usize;
        let bound: Vec<usize> = (0..pp).map(|s| (pp - s).min(m)).collect();
        assert_eq!(live, bound, "(pp {pp}, dp {dp}) live activations");
        let bubble = grid.bubble_fraction.expect("pipelined");
        assert!((0.0..1.0).contains(&bubble), "bubble {bubble}");
        // Per-rank model state: each stage holds its share of the 16 bytes per parameter.
        assert!(grid.model_state_bytes_per_rank <= 16 * one.params as u64);
        if pp > 1 {
            assert!(grid.model_state_bytes_per_rank < 16 * one.params as u64);
        }
    }
}

#[test]
fn a_failing_stage_fails_the_pipeline_instead_of_hanging() {
    let spec = common::spec(config(Some(2), 1, ""), SHAPE, 3, 1, 1);
    let start = std::time::Instant::now();
    let result = launch(2, Duration::from_secs(60), |comm| {
        if comm.rank() == 1 {
            panic!("the last stage crashes");
        }
        run_rank(&spec, comm)
    });
    let err = result.expect_err("the run fails").to_string();
    assert!(err.contains("rank 1"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn zero_stage_2_with_a_pipeline_is_refused_with_the_reason() {
    let spec = common::spec(
        config(Some(2), 1, r#", "zero_optimization": {"stage": 2}"#),
        SHAPE,
        1,
        1,
        1,
    );
    let err = launch(2, Duration::from_secs(30), |comm| run_rank(&spec, comm))
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("zero_optimization.stage") && err.contains("pipeline"),
        "{err}"
    );
}
