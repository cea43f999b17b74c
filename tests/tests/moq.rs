//! MoQ through the engine (issue 21): the bits of each step follow DeepSpeed's schedule from
//! the step after the offset, the weights the model computes with lie on the grid of those
//! bits, data parallelism reproduces the single rank's trajectory with MoQ on, and what MoQ
//! cannot run with is refused by key.

use crate::common;

use std::collections::HashSet;

use burn::tensor::Device;
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::flat::ParamLayout;
use burn_deepspeed::moq::MoqSchedule;
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
    moe: None,
};
const STEPS: u64 = 12;
const OFFSET: u64 = 3;

fn config(stage: u8) -> DeepSpeedConfig {
    DeepSpeedConfig::from_json_str(&format!(
        r#"{{"train_batch_size": 8, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3}}}},
            "zero_optimization": {{"stage": {stage}}},
            "quantize_training": {{"enabled": true, "quantize_groups": 2,
                "quantize_bits": {{"start_bits": 10, "target_bits": 6}},
                "quantize_schedule": {{"quantize_period": 2, "schedule_offset": {OFFSET}}}}}}}"#
    ))
    .expect("valid")
    .0
}

/// The bits DeepSpeed's schedule gives each optimizer step (1-based).
fn schedule() -> Vec<u32> {
    let s = MoqSchedule {
        start_bits: 10,
        target_bits: 6,
        period: 2,
    };
    (1..=STEPS)
        .map(|step| match step.checked_sub(OFFSET) {
            Some(q) if q > 0 => s.bits_at(q),
            _ => 10,
        })
        .collect()
}

#[test]
fn the_bits_follow_the_schedule_and_the_weights_lie_on_its_grid() {
    let want = schedule();
    assert_eq!(want, [10, 10, 10, 10, 9, 9, 8, 8, 8, 8, 7, 7]);
    let mut spec = common::spec(config(0), SHAPE, STEPS, 5, 3);
    spec.keep_final_state = true;
    let one = common::train(1, &spec);
    assert_eq!(one.moq_bits, want);
    common::assert_learns(&one.losses, "MoQ at stage 0");
    // At stage 0 the optimizer steps the parameters themselves, which MoQ replaced: after the
    // last step each half of every weight matrix holds at most 2^7 distinct values.
    let layout = ParamLayout::of(&Gpt::new(SHAPE, 3, &Device::flex()));
    let params = &one.final_params.0;
    let mut matrices = 0;
    for slot in layout.slots.iter().filter(|s| s.shape.len() == 2) {
        let values = &params[slot.offset..slot.offset + slot.numel];
        for half in values.chunks(slot.numel / 2) {
            let distinct: HashSet<u32> = half.iter().map(|v| v.to_bits()).collect();
            assert!(distinct.len() <= 128, "{} values", distinct.len());
        }
        matrices += 1;
    }
    // Per block qkv, attention out, MLP in and out; the two tables and the head.
    assert_eq!(matrices, 4 * SHAPE.layers + 3);
    // Two data-parallel ranks: the same trajectory.
    let two = common::train(2, &common::spec(config(0), SHAPE, STEPS, 5, 3));
    assert_eq!(two.moq_bits, want);
    let diff = common::max_rel_diff(&one.losses, &two.losses);
    assert!(diff < 1e-4, "stage 0 at 2 ranks: {diff:e}");
}

/// At stages 1 and 2 MoQ quantizes the working copy written from the fp32 partitions: the
/// same bits, and the two stages the same trajectory.
#[test]
fn partitioned_stages_quantize_the_working_copy() {
    let stage1 = common::train(2, &common::spec(config(1), SHAPE, STEPS, 5, 3));
    let stage2 = common::train(2, &common::spec(config(2), SHAPE, STEPS, 5, 3));
    assert_eq!(stage1.moq_bits, schedule());
    assert_eq!(stage2.moq_bits, schedule());
    common::assert_learns(&stage1.losses, "MoQ at stage 1");
    let diff = common::max_rel_diff(&stage1.losses, &stage2.losses);
    assert!(diff < 1e-4, "stage 1 against stage 2: {diff:e}");
}

#[test]
fn stage_three_and_the_pipeline_are_refused_by_key() {
    let refused = |config: DeepSpeedConfig, world: usize| {
        let spec = common::spec(config, SHAPE, 1, 5, 3);
        let (_, ranks) =
            burn_deepspeed::launch::launch(world, std::time::Duration::from_secs(60), |comm| {
                match burn_deepspeed_example_gpt::run::run_rank(&spec, comm) {
                    Ok(_) => Ok(String::new()),
                    Err(e) => Ok(e.to_string()),
                }
            })
            .expect("the rank returns");
        ranks[0].clone()
    };
    let e = refused(config(3), 1);
    assert!(
        e.contains("quantize_training.enabled") && e.contains("stage 3"),
        "{e}"
    );
    let mut piped = config(0);
    piped.pipeline = Some(serde_json::from_str(r#"{"stages": 2}"#).expect("a pipeline section"));
    let e = refused(piped, 2);
    assert!(
        e.contains("quantize_training.enabled") && e.contains("pipeline"),
        "{e}"
    );
}
