//! Checkpoints across the 3D grid (DeepSpeed's universal checkpoint idea, built in): a
//! checkpoint saved at (tp 2, pp 2, dp 2) holds whole tensors, and loads at (1, 1, 1),
//! (4, 1, 2) and (1, 2, 4), each continuing with the losses of the uninterrupted run.

use crate::common;

use std::path::Path;

use crate::common::max_rel_diff;
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::checkpoint::consolidate;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec};

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 4,
    seq_len: 16,
    moe: None,
};

/// The pipelined GPT at (tp, pp) with ZeRO stage 1, 8 sequences per step in micro-batches
/// of 2 (the replicas take the rest of the ranks).
fn config(tp: usize, pp: usize) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 2e-3, "weight_decay": 0.01}}}},
            "tensor_parallel": {{"tp_size": {tp}}}, "pipeline": {{"stages": {pp}}},
            "zero_optimization": {{"stage": 1}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn spec(tp: usize, pp: usize, steps: u64) -> RunSpec {
    common::spec(config(tp, pp), SHAPE, steps, 3, 11)
}

fn train(world: usize, spec: &RunSpec) -> RunReport {
    common::train(world, spec)
}

#[test]
fn a_checkpoint_saved_on_one_grid_continues_on_others() {
    const SAVED_AT: u64 = 3;
    const STEPS: u64 = 6;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let uninterrupted = train(8, &spec(2, 2, STEPS));
    let mut first = spec(2, 2, SAVED_AT);
    first.save_dir = Some(dir.path().to_path_buf());
    let saved = train(8, &first);
    assert_eq!(saved.losses, uninterrupted.losses[..SAVED_AT as usize]);
    // The files are one rank's whole model: the consolidation tool reads them.
    let out = dir.path().join("whole.safetensors");
    let whole = consolidate(dir.path(), None, &out).expect("consolidates");
    assert_eq!(whole.values, uninterrupted.params);
    for (tp, pp, world) in [(1, 1, 1), (4, 1, 8), (1, 2, 8)] {
        let mut resumed = spec(tp, pp, STEPS);
        resumed.resume_from = Some(dir.path().to_path_buf());
        let run = train(world, &resumed);
        assert_eq!(run.first_step, SAVED_AT);
        let want = &uninterrupted.losses[SAVED_AT as usize..];
        let diff = max_rel_diff(want, &run.losses);
        println!(
            "saved at (2, 2, 2), resumed at ({tp}, {pp}, {}): losses {:?} vs {want:?}, max \
             rel diff {diff:.2e}",
            run.data_parallel, run.losses
        );
        assert!(diff <= 1e-4, "({tp}, {pp}): {diff}");
    }
    assert_refused(dir.path());
}

/// A checkpoint of another model is refused with the reason, on every rank.
fn assert_refused(dir: &Path) {
    let mut other = spec(2, 1, 4);
    other.shape.d_model = 16;
    other.resume_from = Some(dir.to_path_buf());
    let (_, reports) = burn_deepspeed::launch::launch(2, std::time::Duration::from_secs(60), |c| {
        Ok(burn_deepspeed_example_gpt::run::run_rank(&other, c))
    })
    .expect("the ranks run");
    for r in reports {
        let e = r.expect_err("another model's checkpoint").to_string();
        assert!(e.contains("parameters"), "{e}");
    }
}
