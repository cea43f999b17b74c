//! The GPT example on a wgpu device (Mesa's lavapipe in CI) against the same runs on Flex:
//! GPT `tiny`, 2 ranks, 20 steps, ZeRO stages 0-3, losses within 1e-3 relative, and the
//! host/device bytes each step copies, measured where the copies happen (zero on Flex).
#![cfg(feature = "wgpu")]

use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{ModelDevice, RunReport, RunSpec, run_rank};

fn run(stage: u8, device: ModelDevice) -> RunReport {
    let text = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let (config, _) = DeepSpeedConfig::from_json_str(&text).expect("a valid config");
    let mut spec = RunSpec::on_embedded_corpus(config, GptShape::TINY, 20, 3, 5);
    spec.keep_final_state = false;
    spec.device = device;
    let (_, reports) = launch(2, Duration::from_secs(600), |comm| run_rank(&spec, comm))
        .unwrap_or_else(|e| panic!("stage {stage} on {device:?}: {e}"));
    reports.into_iter().next().expect("rank 0")
}

#[test]
fn gpt_on_wgpu_matches_flex_at_every_stage() {
    for stage in 0..=3u8 {
        let flex = run(stage, ModelDevice::Flex);
        let wgpu = run(stage, ModelDevice::Wgpu);
        assert_eq!(wgpu.device, "wgpu");
        let worst = flex
            .losses
            .iter()
            .zip(&wgpu.losses)
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0.0, f64::max);
        let copied = wgpu.host_device_bytes_per_step.iter().max().copied();
        println!(
            "stage {stage}: flex {:.4} -> {:.4}, wgpu {:.4} -> {:.4}, max rel diff {worst:.2e}; \
             host/device bytes per step on wgpu: {copied:?} (flex: {:?})",
            flex.losses[0],
            flex.losses[19],
            wgpu.losses[0],
            wgpu.losses[19],
            flex.host_device_bytes_per_step.iter().max()
        );
        assert_eq!(wgpu.losses.len(), 20);
        assert!(worst <= 1e-3, "stage {stage}: wgpu vs flex {worst:e}");
        assert!(flex.losses[19] < flex.losses[0], "stage {stage} trains");
        assert!(
            flex.host_device_bytes_per_step.iter().all(|&b| b == 0),
            "Flex's tensors are host memory"
        );
        // Today's engine reads every gradient to the host and rebuilds every parameter from
        // it: at least the fp32 gradients and parameters of the model cross each step.
        let params = wgpu.params as u64;
        assert!(
            wgpu.host_device_bytes_per_step
                .iter()
                .all(|&b| b >= 4 * params),
            "stage {stage}: {:?} bytes per step for {params} parameters",
            wgpu.host_device_bytes_per_step
        );
    }
}
