//! What the offload tests share: a GPT config with an optional `offload_optimizer` section,
//! and a bit-for-bit comparison of two runs.

use std::path::Path;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_example_gpt::run::RunReport;

/// AdamW with clipping at ZeRO `stage` in `precision` (`fp32`, `bf16` or `fp16`); `offload`
/// is `(device, nvme_path, sub_group_size, pipelined)` (a zero tile keeps the default).
pub fn offload_config(
    stage: u8,
    precision: &str,
    offload: Option<(&str, &Path, usize, bool)>,
) -> DeepSpeedConfig {
    let (fp16, bf16) = (precision == "fp16", precision == "bf16");
    let offload = match offload {
        None => String::new(),
        Some((device, path, tile, pipelined)) => {
            let tile = match tile {
                0 => String::new(),
                t => format!(r#", "sub_group_size": {t}"#),
            };
            format!(
                r#", "offload_optimizer": {{"device": "{device}", "nvme_path": {path:?},
                     "pipeline_read": {pipelined}, "pipeline_write": {pipelined}}}{tile}"#,
                path = path.to_string_lossy()
            )
        }
    };
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_clipping": 1.0,
            "fp16": {{"enabled": {fp16}}}, "bf16": {{"enabled": {bf16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}},
            "aio": {{"block_size": 65536, "queue_depth": 4}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 30000,
                                   "allgather_bucket_size": 50000,
                                   "stage3_param_persistence_threshold": 0{offload}}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

/// Asserts that `b` trained exactly as `a`: the same losses, parameters and moments, bit for
/// bit.
pub fn same_run(a: &RunReport, b: &RunReport, what: &str) {
    assert_eq!(a.losses, b.losses, "{what}: losses");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&a.final_params) == bits(&b.final_params),
        "{what}: parameters differ"
    );
    let (am, bm) = (
        a.final_moments.as_ref().expect("moments"),
        b.final_moments.as_ref().expect("moments"),
    );
    assert!(bits(&am.0) == bits(&bm.0), "{what}: first moments differ");
    assert!(bits(&am.1) == bits(&bm.1), "{what}: second moments differ");
}
