//! What the offload tests share: a GPT config with an optional `offload_optimizer` section,
//! and a bit-for-bit comparison of two runs.

use std::path::Path;
use std::time::Duration;

use burn::tensor::Device;
use burn_deepspeed::config::{OffloadDevice, OffloadParamConfig};
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
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

/// `config` with its stage-3 parameter pieces in host memory (`cpu`) or in a swap file under
/// `path` (`nvme`, every piece on disk: `max_in_cpu` 0), read ahead `buffer_count` pieces of
/// up to `buffer_size` elements at a time.
pub fn with_params_offloaded(
    mut config: DeepSpeedConfig,
    device: &str,
    path: &Path,
    buffer_count: u64,
    buffer_size: u64,
) -> DeepSpeedConfig {
    config.zero_optimization.offload_param = Some(OffloadParamConfig {
        device: match device {
            "cpu" => OffloadDevice::Cpu,
            "nvme" => OffloadDevice::Nvme,
            other => panic!("no offload device {other}"),
        },
        nvme_path: Some(path.to_string_lossy().into_owned()),
        buffer_count,
        buffer_size,
        max_in_cpu: 0,
        ..OffloadParamConfig::default()
    });
    config
}

/// Trains steps `steps` of `shape` on `world` thread ranks (the same 16 sequences per step
/// whatever the world size), first loading the checkpoint in `ckpt` when `load`, and saving
/// one there after step `save_at`. Returns rank 0's losses.
pub fn train_steps(
    config: &DeepSpeedConfig,
    shape: GptShape,
    world: usize,
    steps: std::ops::Range<u64>,
    ckpt: &Path,
    save_at: Option<u64>,
    load: bool,
) -> Vec<f64> {
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7);
    let (_, losses) = launch(world, Duration::from_secs(120), |comm| {
        let (rank, per) = (comm.rank() as u64, 16 / comm.world_size() as u64);
        let device = Device::flex().autodiff();
        let mut engine = DeepSpeedEngine::new(Gpt::new(shape, 5, &device), config.clone(), comm)?;
        if load {
            engine.load_checkpoint(ckpt, None)?;
        }
        let mut losses = Vec::new();
        for step in steps.clone() {
            let flex = Device::flex();
            let batch = corpus.batch(step, rank * per, per as usize, shape.seq_len, &flex);
            losses.push(engine.train_batch(std::iter::once(batch))?.loss);
            if save_at == Some(step) {
                engine.save_checkpoint(ckpt, None)?;
            }
        }
        Ok(losses)
    })
    .expect("training runs");
    losses.into_iter().next().expect("rank 0")
}
