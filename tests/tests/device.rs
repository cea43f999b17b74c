//! The GPT example on a wgpu device (Mesa's lavapipe in CI) against the same runs on Flex:
//! a 2-layer GPT (d 32), 2 ranks, 10 steps, ZeRO stages 0-3, losses within 1e-3 relative, and
//! the host/device bytes each step copies, measured where the copies happen (zero on Flex).
#![cfg(feature = "wgpu")]

use std::time::Duration;

use burn::tensor::Device;
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::flat::ParamLayout;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::{ModelDevice, RunReport, RunSpec, run_rank};
use burn_deepspeed_tests::{GPT_MINI, Toy};

use crate::common::max_rel_diff;

fn spec(stage: u8, device: ModelDevice, steps: u64, shape: GptShape) -> RunSpec {
    let text = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let (config, _) = DeepSpeedConfig::from_json_str(&text).expect("a valid config");
    let mut spec = RunSpec::on_embedded_corpus(config, shape, steps, 3, 5);
    spec.keep_final_state = false;
    spec.device = device;
    spec
}

fn run_spec(spec: &RunSpec) -> RunReport {
    let (_, reports) = launch(2, Duration::from_secs(600), |comm| run_rank(spec, comm))
        .unwrap_or_else(|e| {
            panic!(
                "{:?} on {:?}: {e}",
                spec.config.zero_optimization.stage, spec.device
            )
        });
    reports.into_iter().next().expect("rank 0")
}

/// Device-resident stage 0 on wgpu: each step copies the all-reduce staged through the host
/// (the fp32 gradient down and up, the only path between wgpu ranks) and the norm's one f32.
fn assert_only_the_staged_all_reduce(wgpu: &RunReport) {
    let params = wgpu.params as u64;
    assert!(
        wgpu.host_device_bytes_per_step
            .iter()
            .all(|&b| b == 8 * params + 4),
        "{:?} bytes per step for {params} parameters",
        wgpu.host_device_bytes_per_step
    );
}

const STEPS: usize = 10;

fn run(stage: u8, device: ModelDevice) -> RunReport {
    run_spec(&spec(stage, device, STEPS as u64, GPT_MINI))
}

#[test]
fn gpt_on_wgpu_matches_flex_at_every_stage() {
    for stage in 0..=3u8 {
        let flex = run(stage, ModelDevice::Flex);
        let wgpu = run(stage, ModelDevice::Wgpu);
        assert_eq!(wgpu.device, "wgpu");
        let worst = max_rel_diff(&flex.losses, &wgpu.losses);
        let copied = wgpu.host_device_bytes_per_step.iter().max().copied();
        println!(
            "stage {stage}: flex {:.4} -> {:.4}, wgpu {:.4} -> {:.4}, max rel diff {worst:.2e}; \
             host/device bytes per step on wgpu: {copied:?} (flex: {:?})",
            flex.losses[0],
            flex.losses[STEPS - 1],
            wgpu.losses[0],
            wgpu.losses[STEPS - 1],
            flex.host_device_bytes_per_step.iter().max()
        );
        assert_eq!(wgpu.losses.len(), STEPS);
        assert!(worst <= 1e-3, "stage {stage}: wgpu vs flex {worst:e}");
        assert!(
            flex.losses[STEPS - 1] < flex.losses[0],
            "stage {stage} trains"
        );
        assert!(
            flex.host_device_bytes_per_step.iter().all(|&b| b == 0),
            "Flex's tensors are host memory"
        );
        let params = wgpu.params as u64;
        if stage == 0 {
            assert_only_the_staged_all_reduce(&wgpu);
        } else if stage < 3 {
            // Device-resident stages 1-2, rank 0: the staged reduce-scatter (the whole fp32
            // gradient down, its slice up) and all-gather (its slice down, the whole
            // parameters up), and the norm's f32.
            let own = params.div_ceil(2);
            assert!(
                wgpu.host_device_bytes_per_step
                    .iter()
                    .all(|&b| b == 8 * params + 8 * own + 4),
                "stage {stage}: {:?} bytes per step for {params} parameters",
                wgpu.host_device_bytes_per_step
            );
        } else {
            // Device-resident stage 3: the group's gathers (forward and backward) and
            // reduce-scatters move every tensor through the device collectives each
            // micro-batch, staged through the host on wgpu, so a step copies several times
            // the fp32 model; none of it is state.
            let stats = wgpu.gather_stats.expect("stage 3 counts its gathers");
            assert!(
                stats.on_device > 0,
                "the gathers use the device collectives"
            );
            assert!(
                wgpu.host_device_bytes_per_step
                    .iter()
                    .all(|&b| b >= 4 * params),
                "stage {stage}: {:?} bytes per step for {params} parameters",
                wgpu.host_device_bytes_per_step
            );
        }
        // At every stage, each byte that crossed was a collective's staging: the parameters,
        // gradients and optimizer state stay on the device.
        assert_eq!(
            wgpu.host_device_bytes_per_step, wgpu.staged_collective_bytes_per_step,
            "stage {stage}: host/device bytes that staged no collective"
        );
    }
}

/// Device-resident stage 3 with `overlap_comm` (on by default at stage 3) on wgpu, whose
/// collectives stage through the host: the communication thread all-gathers the next bundle
/// while the layer computes, and the run's losses, bytes and gathers equal the run without it.
#[test]
fn device_resident_stage_3_gathers_ahead_on_wgpu() {
    let run = |overlap: bool| {
        let mut s = spec(3, ModelDevice::Wgpu, 4, GPT_MINI);
        // Bundles of a few tensors, so that there is a next one to gather ahead.
        s.config.zero_optimization.prefetch_bucket_size = 3000;
        s.config.zero_optimization.overlap_comm = Some(overlap);
        run_spec(&s)
    };
    let (off, on) = (run(false), run(true));
    let (a, b) = (
        off.gather_stats.expect("stats"),
        on.gather_stats.expect("stats"),
    );
    println!(
        "stage 3 on wgpu: {} all-gathers, {} of them ahead on the communication thread; \
         host/device bytes per step {:?} (without {:?})",
        b.all_gathers,
        b.gathered_ahead,
        on.host_device_bytes_per_step,
        off.host_device_bytes_per_step
    );
    assert_eq!(off.losses, on.losses);
    assert_eq!(a.gathered_ahead, 0);
    assert!(b.gathered_ahead > 0, "nothing went to the thread");
    assert_eq!(a.all_gathers, b.all_gathers, "the same bundles");
    assert_eq!(
        on.host_device_bytes_per_step, on.staged_collective_bytes_per_step,
        "every byte that crossed staged a collective"
    );
}

/// Device-resident stage 3 with persistent tensors (GPT_MINI's biases and norms stay whole and
/// their pieces are all-gathered after the step) beside cut ones: wgpu matches Flex,
/// a checkpoint it saves resumes on wgpu and on Flex (the host regime) with the uninterrupted
/// run's losses, and fp16 with fp32 masters matches Flex.
#[test]
fn device_resident_stage_3_keeps_persistent_tensors_resumes_and_runs_fp16() {
    let persistent = |device, steps| {
        let mut s = spec(3, device, steps, GPT_MINI);
        // GPT_MINI's biases and norms (at most 128 elements) stay whole; its weights (1,024
        // elements and up) are cut.
        s.config.zero_optimization.param_persistence_threshold = 1_000;
        s
    };
    let whole = run_spec(&persistent(ModelDevice::Wgpu, 8));
    let flex = run_spec(&persistent(ModelDevice::Flex, 8));
    let worst = max_rel_diff(&flex.losses, &whole.losses);
    println!(
        "stage 3, persistent tensors: wgpu vs flex {worst:.2e}, host/device bytes per step {:?}",
        whole.host_device_bytes_per_step
    );
    assert!(worst <= 1e-3, "stage 3 with persistent tensors: {worst:e}");
    // The gathers and reduce-scatters moved the device buffers through the regime's device
    // collectives (staged on wgpu); Flex's host regime gathers host values.
    let on_device = |r: &RunReport| {
        r.gather_stats
            .expect("stage 3 counts its gathers")
            .on_device
    };
    assert!(on_device(&whole) > 0, "wgpu gathers on the device");
    assert_eq!(on_device(&flex), 0, "Flex gathers on the host");
    assert_eq!(
        whole.host_device_bytes_per_step,
        whole.staged_collective_bytes_per_step
    );

    let dir = tempfile::tempdir().expect("a temp dir");
    let mut first = persistent(ModelDevice::Wgpu, 4);
    first.save_dir = Some(dir.path().to_path_buf());
    run_spec(&first);
    for device in [ModelDevice::Wgpu, ModelDevice::Flex] {
        let mut rest = persistent(device, 8);
        rest.resume_from = Some(dir.path().to_path_buf());
        let rest = run_spec(&rest);
        let worst = max_rel_diff(&whole.losses[4..], &rest.losses);
        println!("stage 3 resumed on {device:?}: {worst:.2e}");
        assert!(worst <= 1e-5, "resumed on {device:?}: {worst:e}");
    }

    let fp16 = |device| {
        let mut s = persistent(device, 12);
        s.config.fp16.enabled = true;
        s.config.fp16.initial_scale_power = 8;
        run_spec(&s)
    };
    let (flex, wgpu) = (fp16(ModelDevice::Flex), fp16(ModelDevice::Wgpu));
    let worst = max_rel_diff(&flex.losses, &wgpu.losses);
    println!(
        "fp16 stage 3: flex {:?}, wgpu {:?}, max rel diff {worst:.2e}",
        flex.losses, wgpu.losses
    );
    assert_eq!(wgpu.dtype, "fp16");
    assert_eq!(flex.skipped_steps, wgpu.skipped_steps, "the same overflows");
    assert!(worst <= 5e-3, "fp16 stage 3 on wgpu vs Flex: {worst:e}");
    assert_eq!(
        wgpu.host_device_bytes_per_step,
        wgpu.staged_collective_bytes_per_step
    );
}

/// LAMB on the device (moments, per-tensor norms summed over the ranks where tensors are cut,
/// and trust ratios, all on the device) against the host regimes at stages 1 and 3: only the
/// staged collectives cross.
#[test]
fn device_resident_lamb_matches_flex_at_stages_1_and_3() {
    for stage in [1u8, 3] {
        let lamb = |device| {
            let mut s = spec(stage, device, 10, GPT_MINI);
            let text = r#"{"type": "Lamb", "params": {"lr": 2e-3, "weight_decay": 0.01}}"#;
            let (config, _) = DeepSpeedConfig::from_json_str(&format!(
                r#"{{"train_batch_size": 8, "optimizer": {text}}}"#
            ))
            .expect("a valid config");
            s.config.optimizer = config.optimizer;
            run_spec(&s)
        };
        let (flex, wgpu) = (lamb(ModelDevice::Flex), lamb(ModelDevice::Wgpu));
        let worst = max_rel_diff(&flex.losses, &wgpu.losses);
        println!(
            "LAMB stage {stage}: wgpu vs flex {worst:.2e}, {:?}",
            wgpu.losses
        );
        assert!(worst <= 1e-3, "LAMB stage {stage}: {worst:e}");
        assert!(wgpu.losses[9] < wgpu.losses[0], "LAMB stage {stage} trains");
        assert_eq!(
            wgpu.host_device_bytes_per_step, wgpu.staged_collective_bytes_per_step,
            "LAMB stage {stage}"
        );
    }
}

/// Activation checkpointing on wgpu at stages 0 and 3: each block's recompute receives its
/// output's gradient and hands back the gradients of its input and parameters on the device,
/// so, as without it, only the staged collectives cross; the losses match Flex.
#[test]
fn activation_checkpoints_keep_their_gradients_on_the_device() {
    for stage in [0u8, 3] {
        let checkpointed = |device| {
            let mut s = spec(stage, device, 6, GPT_MINI);
            let (config, _) = DeepSpeedConfig::from_json_str(
                r#"{"train_batch_size": 8, "activation_checkpointing": {}}"#,
            )
            .expect("a valid config");
            s.config.activation_checkpointing = config.activation_checkpointing;
            run_spec(&s)
        };
        let (flex, wgpu) = (
            checkpointed(ModelDevice::Flex),
            checkpointed(ModelDevice::Wgpu),
        );
        assert!(wgpu.activation_checkpointing, "the blocks are checkpointed");
        let worst = max_rel_diff(&flex.losses, &wgpu.losses);
        println!(
            "activation checkpointing, stage {stage}: wgpu vs flex {worst:.2e}, bytes per step {:?}",
            wgpu.host_device_bytes_per_step
        );
        assert!(worst <= 1e-3, "stage {stage}: {worst:e}");
        assert_eq!(
            wgpu.host_device_bytes_per_step, wgpu.staged_collective_bytes_per_step,
            "stage {stage}: a checkpoint's gradients crossed to the host"
        );
    }
}

/// ZeRO-Offload on a wgpu device: with `offload_optimizer` (and at stage 3 `offload_param`) the
/// engine keeps the host regime, so each step moves the gradients to the host, steps the fp32
/// masters, m and v there with the CPU fused Adam (in host memory for `cpu`, tile by tile in
/// swap files for `nvme`) and writes the updated parameters back to the device. GPT_MINI,
/// 2 ranks, 12 steps: the losses follow the device-resident run within 1e-3, and the
/// offloaded run moves at least the gradients down and the parameters up every step, counted
/// where the copies happen, beside the device-resident run's staged collectives alone.
#[test]
fn optimizer_offload_on_wgpu_follows_the_device_resident_run() {
    let dir = tempfile::tempdir().expect("a temp dir");
    for (stage, device) in [(1u8, "cpu"), (2, "nvme"), (3, "cpu")] {
        let resident = run_spec(&spec(stage, ModelDevice::Wgpu, 12, GPT_MINI));
        let mut s = spec(stage, ModelDevice::Wgpu, 12, GPT_MINI);
        let zero = &mut s.config.zero_optimization;
        let path = dir.path().to_string_lossy();
        let (offload, _) = DeepSpeedConfig::from_json_str(&format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage},
                "offload_optimizer": {{"device": "{device}", "nvme_path": {path:?}}},
                "offload_param": {{"device": "cpu"}}}}}}"#
        ))
        .expect("a valid offload section");
        zero.offload_optimizer = offload.zero_optimization.offload_optimizer;
        if stage == 3 {
            zero.offload_param = offload.zero_optimization.offload_param;
        }
        let offloaded = run_spec(&s);
        let worst = max_rel_diff(&resident.losses, &offloaded.losses);
        println!(
            "stage {stage}, offload {device} on wgpu: losses {:.4} -> {:.4}, vs device-resident \
             {worst:.2e}; host/device bytes per step {:?} (resident {:?})",
            offloaded.losses[0],
            offloaded.losses[11],
            offloaded.host_device_bytes_per_step.iter().max(),
            resident.host_device_bytes_per_step.iter().max(),
        );
        assert_eq!(offloaded.device, "wgpu");
        assert_eq!(offloaded.offload_optimizer, device);
        assert!(worst <= 1e-3, "stage {stage} offload {device}: {worst:e}");
        assert!(
            offloaded.losses[11] < offloaded.losses[0],
            "stage {stage} trains"
        );
        // The whole fp32 gradient down and the whole updated parameters up, at the least.
        let params = offloaded.params as u64;
        assert!(
            offloaded
                .host_device_bytes_per_step
                .iter()
                .all(|&b| b >= 8 * params),
            "stage {stage}: {:?} bytes per step for {params} parameters",
            offloaded.host_device_bytes_per_step
        );
    }
}

/// A stage-2 checkpoint saved on wgpu (device-resident slices) resumes on Flex (the host
/// regime) and on wgpu, with the uninterrupted run's losses: the slices are the host format.
#[test]
fn device_resident_stage_2_checkpoints_resume_on_either_regime() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let whole = run_spec(&spec(2, ModelDevice::Wgpu, 8, GPT_MINI));
    let mut first = spec(2, ModelDevice::Wgpu, 4, GPT_MINI);
    first.save_dir = Some(dir.path().to_path_buf());
    run_spec(&first);
    for device in [ModelDevice::Wgpu, ModelDevice::Flex] {
        let mut rest = spec(2, device, 8, GPT_MINI);
        rest.resume_from = Some(dir.path().to_path_buf());
        let rest = run_spec(&rest);
        let worst = max_rel_diff(&whole.losses[4..], &rest.losses);
        assert!(worst <= 1e-5, "resumed on {device:?}: {worst:e}");
    }
}

/// A 1-bit Adam checkpoint saved on wgpu in the compression stage (the device optimizer's
/// state, in the host optimizer's format) resumes on wgpu and on Flex: both start from the
/// saved parameters (their first loss is the uninterrupted run's) and, with the error buffers
/// zeroed on load as in DeepSpeed, follow each other.
#[test]
fn device_one_bit_adam_checkpoints_resume_on_either_regime() {
    let one_bit = |device, steps| {
        let (config, _) = DeepSpeedConfig::from_json_str(
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 4}}}"#,
        )
        .expect("a valid config");
        let mut s = RunSpec::on_embedded_corpus(config, GPT_MINI, steps, 3, 5);
        s.keep_final_state = false;
        s.device = device;
        s
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let whole = run_spec(&one_bit(ModelDevice::Wgpu, 9));
    let mut first = one_bit(ModelDevice::Wgpu, 6);
    first.save_dir = Some(dir.path().to_path_buf());
    run_spec(&first);
    let resumed: Vec<RunReport> = [ModelDevice::Wgpu, ModelDevice::Flex]
        .into_iter()
        .map(|device| {
            let mut rest = one_bit(device, 9);
            rest.resume_from = Some(dir.path().to_path_buf());
            run_spec(&rest)
        })
        .collect();
    assert_eq!(resumed[0].first_step, 6);
    assert_eq!(
        resumed[0].losses[0], whole.losses[6],
        "the saved parameters, on wgpu"
    );
    let first_loss = max_rel_diff(&resumed[1].losses[..1], &whole.losses[6..7]);
    assert!(
        first_loss <= 1e-5,
        "the saved parameters, on Flex: {first_loss:e}"
    );
    let worst = max_rel_diff(&resumed[0].losses, &resumed[1].losses);
    assert!(worst <= 1e-2, "resumed on wgpu vs on Flex: {worst:e}");
}

#[test]
fn device_resident_stage_0_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let whole = run_spec(&spec(0, ModelDevice::Wgpu, 8, GPT_MINI));
    let mut first = spec(0, ModelDevice::Wgpu, 4, GPT_MINI);
    first.save_dir = Some(dir.path().to_path_buf());
    let first = run_spec(&first);
    let mut rest = spec(0, ModelDevice::Wgpu, 8, GPT_MINI);
    rest.resume_from = Some(dir.path().to_path_buf());
    let rest = run_spec(&rest);
    assert_eq!(first.losses, whole.losses[..4]);
    assert_eq!(rest.first_step, 4);
    // The parameters, moments and step counts come back exactly: the same losses.
    assert_eq!(rest.losses, whole.losses[4..], "resumed vs uninterrupted");

    // A host (Flex) stage-0 checkpoint holds Burn's optimizer record: refused with the reason.
    let host_dir = tempfile::tempdir().expect("a temp dir");
    let mut host = spec(0, ModelDevice::Flex, 4, GPT_MINI);
    host.save_dir = Some(host_dir.path().to_path_buf());
    run_spec(&host);
    let mut on_device = spec(0, ModelDevice::Wgpu, 8, GPT_MINI);
    on_device.resume_from = Some(host_dir.path().to_path_buf());
    let err = launch(2, Duration::from_secs(300), |comm| {
        run_rank(&on_device, comm)
    })
    .expect_err("refused")
    .to_string();
    assert!(err.contains("Burn's optimizer record"), "{err}");
}

/// Deterministic gradients for every parameter of `model` but, on odd steps, the output bias
/// (so that parameters step at different counts).
fn toy_grads(model: &Toy, step: u64, rank: usize) -> burn::optim::GradientsParams {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::{Tensor, TensorData};
    struct V {
        grads: burn::optim::GradientsParams,
        index: usize,
        step: u64,
        rank: usize,
        skip: Option<burn::module::ParamId>,
    }
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.index += 1;
            if Some(param.id) == self.skip {
                return;
            }
            let shape = param.val().shape();
            let n = shape.num_elements();
            let values: Vec<f32> = (0..n)
                .map(|j| {
                    let x = (j as u64 * 7
                        + self.step * 13
                        + self.rank as u64 * 5
                        + self.index as u64 * 3)
                        % 17;
                    (x as f32 - 8.0) / 4.0
                })
                .collect();
            let device = param.val().device().inner();
            let g = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
            self.grads.register::<D>(param.id, g);
        }
    }
    let mut v = V {
        grads: burn::optim::GradientsParams::new(),
        index: 0,
        step,
        rank,
        skip: (step % 2 == 1).then_some(model.out.bias.as_ref().expect("a bias").id),
    };
    model.visit(&mut v);
    v.grads
}

/// Six steps of the ZeRO `stage` regime the engine builds for `device` (the device-resident
/// one on wgpu, the host one on Flex) with clipping and a parameter missing every other step:
/// the final parameters, the norms and whether the regime stepped with Burn's optimizer.
fn toy_run(device: Device, stage: u8, optimizer: &str) -> (Vec<f32>, Vec<f64>, bool) {
    let (_, out) = launch(2, Duration::from_secs(300), |comm| {
        let (mut config, _) = DeepSpeedConfig::from_json_str(&format!(
            r#"{{"train_batch_size": 2, "gradient_clipping": 0.5,
                "zero_optimization": {{"stage": {stage}}},
                "optimizer": {{"type": "{optimizer}", "params": {{"lr": 1e-2, "weight_decay": 0.1}}}}}}"#
        ))?;
        config.resolve(comm.world_size())?;
        let rank = comm.rank();
        let model = Toy::new(3, &device.clone().autodiff());
        let (mut model, mut sync) = burn_deepspeed::sync::build(model, &config, comm)?;
        let mut norms = Vec::new();
        for step in 0..6 {
            sync.accumulate(&model, &toy_grads(&model, step, rank));
            norms.push(sync.reduce(1.0)?.norm);
            model = sync.step(model, 1e-2)?;
        }
        let params = sync.whole_params(&model, true)?.expect("wanted");
        Ok((params, norms, sync.burn_optimizer().is_some()))
    })
    .expect("the toy trains");
    out.into_iter().next().expect("rank 0")
}

#[test]
fn device_resident_stages_0_to_2_step_like_the_host_regimes() {
    for optimizer in ["AdamW", "Lamb"] {
        for stage in 0..=2 {
            toy_stage(stage, optimizer);
        }
    }
}

/// `optimizer` at ZeRO `stage` (stage 0 on the host: Burn's optimizer; stages 1-2: the
/// partitioned optimizer's CPU kernels) against the device regime on wgpu.
fn toy_stage(stage: u8, optimizer: &str) {
    let (host, host_norms, burn_optim) = toy_run(Device::flex(), stage, optimizer);
    assert_eq!(burn_optim, stage == 0, "Flex keeps the host regime");
    let (dev, dev_norms, burn_optim) = toy_run(
        Device::from(burn::backend::wgpu::WgpuDevice::default()),
        stage,
        optimizer,
    );
    assert!(!burn_optim, "wgpu takes the device-resident regime");
    let layout = burn_deepspeed::flat::ParamLayout::of(&Toy::new(3, &Device::flex()));
    let initial = burn_deepspeed::flat::params_to_flat(&Toy::new(3, &Device::flex()), &layout);
    assert_ne!(host, initial, "the parameters moved");
    for (a, b) in host_norms.iter().zip(&dev_norms) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{optimizer} stage {stage}: norms {host_norms:?} vs {dev_norms:?}"
        );
    }
    let worst = host
        .iter()
        .zip(&dev)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-4,
        "{optimizer} stage {stage}: parameters differ by {worst:e}"
    );
}

#[test]
fn device_resident_stage_0_in_fp16_matches_flex() {
    let fp16 = |device| {
        let mut s = spec(0, device, 20, GPT_MINI);
        s.config.fp16.enabled = true;
        // A scale that overflows neither run.
        s.config.fp16.initial_scale_power = 8;
        run_spec(&s)
    };
    let flex = fp16(ModelDevice::Flex);
    let wgpu = fp16(ModelDevice::Wgpu);
    let worst = max_rel_diff(&flex.losses, &wgpu.losses);
    println!(
        "fp16 stage 0: flex {:?}, wgpu {:?}, max rel diff {worst:.2e}, skipped {} / {}, \
         host/device bytes per step {:?}",
        flex.losses,
        wgpu.losses,
        flex.skipped_steps,
        wgpu.skipped_steps,
        wgpu.host_device_bytes_per_step.iter().max()
    );
    assert_eq!(wgpu.dtype, "fp16");
    assert_eq!(flex.skipped_steps, wgpu.skipped_steps, "the same overflows");
    assert!(worst <= 5e-3, "fp16 on wgpu vs Flex: {worst:e}");
    assert!(wgpu.losses[19] < wgpu.losses[0] - 0.5, "it trains");
    assert_only_the_staged_all_reduce(&wgpu);
}

/// fp16 gradient buffers on the device: at stages 2 and 3 under dynamic loss scaling from
/// DeepSpeed's default scale, the device regimes hold the accumulated gradient in fp16 as the
/// host regimes do (the paper's 2Ψ): they skip the steps Flex skips, the losses follow Flex,
/// and at stage 2 the peak model-state bytes equal the host regime's.
#[test]
fn device_resident_fp16_gradient_buffers_skip_the_steps_flex_skips() {
    for stage in [2u8, 3] {
        let fp16 = |device| {
            let mut s = spec(stage, device, 8, GPT_MINI);
            s.config.fp16.enabled = true;
            run_spec(&s)
        };
        let (flex, wgpu) = (fp16(ModelDevice::Flex), fp16(ModelDevice::Wgpu));
        let worst = max_rel_diff(&flex.losses, &wgpu.losses);
        println!(
            "fp16 stage {stage}: skipped {} on Flex, {} on wgpu; max rel diff {worst:.2e}; peak \
             model-state bytes {} on Flex, {} on wgpu",
            flex.skipped_steps,
            wgpu.skipped_steps,
            flex.peak_model_state_bytes_per_rank,
            wgpu.peak_model_state_bytes_per_rank
        );
        assert!(
            flex.skipped_steps > 0,
            "stage {stage}: the default scale overflows"
        );
        assert_eq!(flex.skipped_steps, wgpu.skipped_steps, "stage {stage}");
        assert!(
            worst <= 5e-3,
            "stage {stage}: fp16 on wgpu vs Flex {worst:e}"
        );
        if stage == 2 {
            // The fp16 slice of the gradient weighs what the host's does (an fp32 one would
            // add 2 bytes per element of the slice).
            assert_eq!(
                flex.peak_model_state_bytes_per_rank,
                wgpu.peak_model_state_bytes_per_rank
            );
        }
    }
}

/// Host/device bytes per step of a device-resident 1-bit run of `params` parameters on 2 wgpu
/// ranks compressing from `freeze`: the dense steps stage the fp32 all-reduce (down and up)
/// and read the norm; the compressed ones stage the packed signs only (the all-to-all's words
/// down and up, the all-gather's chunk down and the whole up: 1 bit each per padded element)
/// and read the norm and the two scales. 1-bit LAMB (`lamb`, without weight decay) also reads
/// one value per tensor of the GPT: during warm-up the norms of p and of the update (two),
/// once compressing the largest variance ratio (one), and at the first compressed step the
/// momentum scales (one more).
fn one_bit_bytes(params: u64, freeze: usize, steps: usize, lamb: bool) -> Vec<u64> {
    let padded = params.div_ceil(64) * 64;
    let tensors = match lamb {
        true => ParamLayout::of(&Gpt::new(GPT_MINI, 0, &Device::flex()))
            .slots
            .len() as u64,
        false => 0,
    };
    (0..steps)
        .map(|step| match step < freeze {
            true => 8 * params + 4 + 8 * tensors,
            false if step == freeze => 3 * padded / 8 + padded / 16 + 4 + 8 + 8 * tensors,
            false => 3 * padded / 8 + padded / 16 + 4 + 8 + 4 * tensors,
        })
        .collect()
}

/// 1-bit LAMB in fp16 (fp32 masters on the device, compressing from step 4) on wgpu against
/// Flex: the same overflows, the losses together, and only the staged collectives, the norm,
/// the scales and the per-tensor norms crossing.
#[test]
fn device_one_bit_lamb_in_fp16_matches_flex() {
    let run = |device| {
        let (mut config, _) = DeepSpeedConfig::from_json_str(
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                "fp16": {"enabled": true, "initial_scale_power": 8},
                "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": 4}}}"#,
        )
        .expect("a valid config");
        config.fp16.enabled = true;
        let mut s = RunSpec::on_embedded_corpus(config, GPT_MINI, 10, 3, 5);
        s.keep_final_state = false;
        s.device = device;
        run_spec(&s)
    };
    let (flex, wgpu) = (run(ModelDevice::Flex), run(ModelDevice::Wgpu));
    let worst = max_rel_diff(&flex.losses, &wgpu.losses);
    println!(
        "fp16 1-bit LAMB: flex {:?}, wgpu {:?}, max rel diff {worst:.2e}, bytes {:?}",
        flex.losses, wgpu.losses, wgpu.host_device_bytes_per_step
    );
    assert_eq!(wgpu.dtype, "fp16");
    assert_eq!(flex.skipped_steps, wgpu.skipped_steps, "the same overflows");
    assert!(worst <= 1e-2, "fp16 1-bit LAMB on wgpu vs Flex: {worst:e}");
    assert!(wgpu.losses[9] < wgpu.losses[0], "it trains");
    assert_eq!(
        wgpu.host_device_bytes_per_step,
        one_bit_bytes(wgpu.params as u64, 4, 10, true)
    );
}

/// The pipeline (2 stages, 2 ranks; a host regime, its copies counted) and 1-bit Adam and
/// 1-bit LAMB (compressing from step 4, device-resident) on wgpu against Flex.
#[test]
fn pipeline_and_one_bit_optimizers_on_wgpu_match_flex() {
    let cases = [
        (
            "pipeline",
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "pipeline": {"stages": 2, "partition": "parameters"}}"#,
        ),
        (
            "1-bit Adam",
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 4}}}"#,
        ),
        (
            "1-bit LAMB",
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 4}}}"#,
        ),
        (
            "0/1 Adam",
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3,
                    "var_freeze_step": 4, "local_step_scaler": 2, "local_step_clipper": 4}}}"#,
        ),
    ];
    for (what, text) in cases {
        let runs: Vec<RunReport> = [ModelDevice::Flex, ModelDevice::Wgpu]
            .into_iter()
            .map(|device| {
                let (config, _) = DeepSpeedConfig::from_json_str(text).expect("a valid config");
                let mut s = RunSpec::on_embedded_corpus(config, GPT_MINI, 10, 3, 5);
                s.keep_final_state = false;
                s.device = device;
                run_spec(&s)
            })
            .collect();
        let rel = |range: std::ops::Range<usize>| {
            max_rel_diff(&runs[0].losses[range.clone()], &runs[1].losses[range])
        };
        let worst = rel(0..10);
        let bytes = &runs[1].host_device_bytes_per_step;
        println!(
            "{what}: flex {:?}, wgpu {:?}, max rel diff {worst:.2e}, host/device bytes per step {bytes:?}",
            runs[0].losses, runs[1].losses
        );
        assert_eq!(runs[1].losses.len(), 10, "{what}");
        // Before the 1-bit optimizers compress (step 4) both runs are dense and agree closely;
        // after, a sign taken of an element near zero may differ between the two devices'
        // rounding and the error feedback carries it on, so the runs agree to 1e-2.
        let dense = rel(0..4);
        assert!(
            dense <= 1e-5,
            "{what}: wgpu vs flex over the dense steps {dense:e}"
        );
        let tolerance = if what == "pipeline" { 1e-5 } else { 1e-2 };
        assert!(worst <= tolerance, "{what}: wgpu vs flex {worst:e}");
        // LAMB's trust ratio keeps its steps small at this learning rate.
        let progress = if what == "1-bit LAMB" { 0.05 } else { 0.3 };
        assert!(
            runs[1].losses[9] < runs[1].losses[0] - progress,
            "{what} trains"
        );
        if what == "pipeline" {
            assert!(bytes.iter().all(|&b| b > 0), "{what}");
            continue;
        }
        if what == "0/1 Adam" {
            // Steps 0-3 all-reduce their gradients (host-staged on wgpu); the syncs of steps
            // 4-6 move 1-bit words; steps 7-9 are local: only the loss's 4 bytes cross.
            let staged = bytes[4..7].iter().all(|&b| b > 4 && b < bytes[0] / 10);
            let local = bytes[7..].iter().all(|&b| b == 4);
            assert!(
                staged && local,
                "{what}: host/device bytes per step {bytes:?}"
            );
            continue;
        }
        // Device-resident 1-bit: parameters, gradients and optimizer state never cross.
        let want = one_bit_bytes(runs[1].params as u64, 4, 10, what == "1-bit LAMB");
        assert_eq!(bytes, &want, "{what}: host/device bytes per step");
    }
}

/// Stages 1-2 on the device refuse a parameter no rank gave a gradient when
/// `ignore_unused_parameters` is false, naming the key, as the host regime does.
#[test]
fn device_resident_stage_1_refuses_unused_parameters_when_asked() {
    let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
    let results = launch(2, Duration::from_secs(120), |comm| {
        let (mut config, _) = DeepSpeedConfig::from_json_str(
            r#"{"train_batch_size": 2, "zero_optimization": {"stage": 1,
                "ignore_unused_parameters": false},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}"#,
        )?;
        config.resolve(comm.world_size())?;
        let rank = comm.rank();
        let model = Toy::new(3, &device.clone().autodiff());
        let (mut model, mut sync) = burn_deepspeed::sync::build(model, &config, comm)?;
        assert!(sync.burn_optimizer().is_none(), "the device regime");
        for step in 0..2 {
            sync.accumulate(&model, &toy_grads(&model, step, rank));
            sync.reduce(1.0)?;
            model = sync.step(model, 1e-2)?;
        }
        Ok(())
    });
    let err = results.expect_err("step 1 misses a gradient").to_string();
    assert!(
        err.contains("ignore_unused_parameters"),
        "the key is named: {err}"
    );
}

/// ZeRO++'s quantized weights quantize gathers of chunks held in host memory; with the model
/// on wgpu, stage 3 refuses the key by name rather than gathering unquantized.
#[test]
fn device_stage_3_refuses_quantized_weights_by_name() {
    let mut s = spec(3, ModelDevice::Wgpu, 1, GPT_MINI);
    s.config.zero_optimization.zero_quantized_weights = true;
    let err = launch(2, Duration::from_secs(60), |comm| run_rank(&s, comm))
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("zero_optimization.zero_quantized_weights"),
        "{err}"
    );
}
