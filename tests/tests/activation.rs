//! Activation checkpointing on the GPT example: with the config's `activation_checkpointing`
//! section each block is a checkpoint, and training follows the run without it exactly at
//! ZeRO stages 0-3 (stage 3 gathers the chunks again in the recompute), in fp32 and bf16;
//! the heap one micro-batch's forward and backward hold, measured by the counting allocator,
//! falls to well under half.
//!
//! The heap counters are the process's, and a second test running beside this one would count
//! into them: it holds `process.rs`'s lock.

use crate::common;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::RANK_THREADS_VAR;
use burn_deepspeed_example_gpt::model::GptShape;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 4,
    heads: 2,
    seq_len: 64,
    moe: None,
};

fn config(stage: u8, bf16: bool, checkpointing: bool) -> DeepSpeedConfig {
    let section = if checkpointing {
        r#", "activation_checkpointing": {"profile": true}"#
    } else {
        ""
    };
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_clipping": 1.0, "bf16": {{"enabled": {bf16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000,
                                   "allgather_bucket_size": 5000,
                                   "stage3_param_persistence_threshold": 0}}{section}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

#[test]
fn checkpointed_blocks_train_identically_on_less_memory() {
    let _alone = crate::alone();
    // One compute thread per rank, so that the heap's peak is the same in every run: with a
    // pool of two, the kernels' scratch buffers overlap as the threads happen to run, and the
    // ratio below moved between 0.41 and 0.58 from run to run (0.46 with one thread, every
    // time). At 2 ranks on 2 cores it is also the default.
    // SAFETY: `alone` keeps every other test of this binary, and so any other reader of the
    // environment, from running meanwhile.
    unsafe { std::env::set_var(RANK_THREADS_VAR, "1") };
    // The memory: one rank, so that the process's heap is the rank's.
    let plain = common::train(1, &common::spec(config(0, false, false), SHAPE, 3, 5, 9));
    let ckpt = common::train(1, &common::spec(config(0, false, true), SHAPE, 3, 5, 9));
    assert_eq!(ckpt.losses, plain.losses);
    assert!(ckpt.activation_checkpointing && !plain.activation_checkpointing);
    let (with, without) = (
        ckpt.peak_activation_bytes.expect("measured"),
        plain.peak_activation_bytes.expect("measured"),
    );
    println!(
        "peak activation heap: {with} B with checkpoints, {without} B without ({:.2})",
        with as f64 / without as f64
    );
    assert!(with * 2 < without, "{with} vs {without}");

    // The trajectory: every stage and both dtypes, on 2 ranks.
    for bf16 in [false, true] {
        for stage in [0, 1, 2, 3] {
            let spec = |c| common::spec(config(stage, bf16, c), SHAPE, 4, 5, 9);
            let plain = common::train(2, &spec(false));
            let ckpt = common::train(2, &spec(true));
            assert_eq!(
                ckpt.losses, plain.losses,
                "stage {stage}, bf16 {bf16}: checkpointed losses"
            );
            assert_eq!(
                ckpt.final_params, plain.final_params,
                "stage {stage}, bf16 {bf16}: parameters after training"
            );
        }
    }
}
