//! ZeRO-Infinity's parameter offload on the GPT example at ZeRO stage 3: with each rank's
//! parameter pieces in host memory (`cpu`) or in a swap file read ahead of the gathers
//! (`nvme`), with the optimizer in memory or on disk too, training follows the in-memory run
//! bit for bit at 1, 2 and 3 ranks, in fp32 and with 16-bit working copies; the read-ahead
//! serves the gathers; the pieces on disk are measured; checkpoints resume exactly; a bad
//! `nvme_path` is refused by name.

use crate::common;

use std::time::Duration;

use burn::tensor::Device;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::RunReport;
use burn_deepspeed_tests::offload::{offload_config, same_run, train_steps, with_params_offloaded};

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

fn run(ranks: usize, config: DeepSpeedConfig, shape: GptShape, steps: u64) -> RunReport {
    common::train(ranks, &common::spec(config, shape, steps, 5, 9))
}

/// 20 steps at stage 3 (a GPT of d 32 and 2 layers on 1, 2 and 4 ranks): pieces in host
/// memory, or on disk (read ahead 2 or 4 pieces at a time) with the optimizer in memory or on
/// disk too, give the in-memory run's losses, parameters and moments bit for bit.
#[test]
fn offloaded_parameters_train_bit_identically_at_stage_3() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path();
    for (ranks, shape) in [(2, SHAPE), (1, SHAPE), (4, SHAPE)] {
        let base = run(ranks, offload_config(3, "fp32", None), shape, 20);
        assert_eq!(base.offload_param, "none");
        let cpu = with_params_offloaded(offload_config(3, "fp32", None), "cpu", path, 4, 1 << 20);
        let cpu = run(ranks, cpu, shape, 20);
        same_run(&base, &cpu, &format!("{ranks} ranks, params on cpu"));
        assert_eq!(cpu.offload_param, "cpu");
        let store = cpu.param_store.as_ref().expect("a store is reported");
        assert!(store.swap.is_none() && store.host_bytes > 0);
        let cases = [
            (None, 4, 1 << 20),
            (Some(("nvme", path, 12_345, true)), 2, 70_000),
        ];
        for (optimizer, count, size) in cases {
            let config = with_params_offloaded(
                offload_config(3, "fp32", optimizer),
                "nvme",
                path,
                count,
                size,
            );
            let nvme = run(ranks, config, shape, 20);
            let what = format!(
                "{ranks} ranks, params on nvme, optimizer {}",
                nvme.offload_optimizer
            );
            same_run(&base, &nvme, &what);
            let store = nvme.param_store.as_ref().expect("a store is reported");
            let swap = store.swap.as_ref().expect("a swap file");
            println!("{what}: {store:?}");
            assert_eq!(store.host_bytes, 0, "max_in_cpu 0 keeps nothing in memory");
            // Every step writes every piece once, and reads it for the forward and again for
            // a backward that reads the weight: not the embeddings' nor the layer norms'
            // biases', each a whole disk block at 4 ranks (35.8 reads per disk byte there).
            assert!(swap.bytes_written >= 20 * swap.disk_bytes, "{what}");
            assert!(swap.bytes_read >= 32 * swap.disk_bytes, "{what}");
            // After the first step traced the order, the gathers find their pieces read
            // ahead.
            assert!(
                store.read_ahead_hits > store.reads_on_demand,
                "{what}: {} hits, {} on demand",
                store.read_ahead_hits,
                store.reads_on_demand
            );
        }
    }
    assert!(
        std::fs::read_dir(path.join("zero_stage_3/params"))
            .expect("the swap folder")
            .next()
            .is_none(),
        "the swap files are removed when the engine is dropped"
    );
}

/// With a 16-bit working copy the gathers round the stored f32 pieces to the model's dtype,
/// as they round its own chunks: bf16 and fp16 (with loss scaling) follow their in-memory
/// runs exactly, with the optimizer on disk as well.
#[test]
fn offloaded_parameters_follow_the_in_memory_mixed_precision_runs() {
    let dir = tempfile::tempdir().expect("temp dir");
    for precision in ["bf16", "fp16"] {
        let base = run(2, offload_config(3, precision, None), SHAPE, 12);
        let optimizer = Some(("nvme", dir.path(), 777, true));
        let config = with_params_offloaded(
            offload_config(3, precision, optimizer),
            "nvme",
            dir.path(),
            3,
            5_000,
        );
        let nvme = run(2, config, SHAPE, 12);
        same_run(
            &base,
            &nvme,
            &format!("{precision}, params and optimizer on nvme"),
        );
        assert_eq!(nvme.dtype, precision);
    }
}

/// What a rank holds in memory with its parameters on disk: the module's persistent tensors
/// and placeholders, not the pieces, whose bytes are reported on disk.
#[test]
fn offloaded_parameters_are_measured_on_disk_not_in_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let held = |config: DeepSpeedConfig| {
        let (_, states) = launch(2, Duration::from_secs(120), |comm| {
            let device = Device::flex().autodiff();
            let engine = DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm)?;
            Ok((engine.model_state_bytes(), engine.param_store()))
        })
        .expect("engines build");
        states.into_iter().next().expect("rank 0")
    };
    let (ram, none) = held(offload_config(3, "fp32", None));
    let config =
        with_params_offloaded(offload_config(3, "fp32", None), "nvme", dir.path(), 2, 1000);
    let (disk, store) = held(config);
    assert!(none.is_none());
    let store = store.expect("offloaded");
    let swap = store.swap.expect("a swap file");
    println!("in memory {ram:?}; offloaded {disk:?}; {swap:?}");
    // `stage3_param_persistence_threshold` 0: every tensor is partitioned, so the module
    // holds nothing but placeholders.
    assert_eq!(disk.params, 0);
    assert!(ram.params > 0);
    assert_eq!(disk.offloaded, swap.disk_bytes);
    // Each piece is padded to 4 KiB on disk.
    assert!(
        swap.disk_bytes >= ram.params / 2,
        "{} vs {}",
        swap.disk_bytes,
        ram.params
    );
}

/// A checkpoint of a run with its parameters on disk holds the pieces read back from the
/// store: resumed offloaded, or in memory, the run continues with the uninterrupted run's
/// losses; and a run in memory resumes offloaded.
#[test]
fn checkpoints_of_parameter_offloaded_runs_resume_exactly() {
    let swap = tempfile::tempdir().expect("temp dir");
    let ckpt = tempfile::tempdir().expect("temp dir");
    let optimizer = Some(("nvme", swap.path(), 333, true));
    let nvme = with_params_offloaded(
        offload_config(3, "fp32", optimizer),
        "nvme",
        swap.path(),
        2,
        10_000,
    );
    let memory = offload_config(3, "fp32", None);
    let whole = train_steps(&nvme, SHAPE, 2, 0..8, ckpt.path(), Some(3), false);
    let resumed = train_steps(&nvme, SHAPE, 2, 4..8, ckpt.path(), None, true);
    let in_memory = train_steps(&memory, SHAPE, 2, 4..8, ckpt.path(), None, true);
    println!("offloaded {whole:?}; resumed {resumed:?}; in memory {in_memory:?}");
    assert_eq!(&whole[4..], &resumed[..]);
    assert_eq!(&whole[4..], &in_memory[..]);
    let ckpt2 = tempfile::tempdir().expect("temp dir");
    let plain = train_steps(&memory, SHAPE, 2, 0..8, ckpt2.path(), Some(3), false);
    let onto_disk = train_steps(&nvme, SHAPE, 2, 4..8, ckpt2.path(), None, true);
    assert_eq!(&plain[4..], &onto_disk[..]);
    assert_eq!(
        plain, whole,
        "offloaded and in-memory runs agree from the start"
    );
}

/// `offload_param.nvme_path` must name a writable folder; parameter offload below stage 3
/// is refused by key.
#[test]
fn bad_parameter_offload_configs_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("not-a-folder");
    std::fs::write(&file, b"x").expect("write");
    let build = |config: DeepSpeedConfig| {
        launch(1, Duration::from_secs(60), |comm| {
            let device = Device::flex().autodiff();
            DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm).map(|_| ())
        })
        .expect_err("refused")
        .to_string()
    };
    let e = build(with_params_offloaded(
        offload_config(3, "fp32", None),
        "nvme",
        &file,
        2,
        100,
    ));
    assert!(
        e.contains("zero_optimization.offload_param.nvme_path") && e.contains("not a folder"),
        "{e}"
    );
    let e = build(with_params_offloaded(
        offload_config(2, "fp32", None),
        "cpu",
        dir.path(),
        2,
        100,
    ));
    assert!(
        e.contains("zero_optimization.offload_param.device") && e.contains("stage 3"),
        "{e}"
    );
}
