//! ZeRO-Infinity under a memory cap: GPT `small` at ZeRO stage 3 with its parameters and
//! optimizer state on disk trains inside a memory cgroup capped below the model-state bytes
//! that the same run holds in RAM without offload, with the in-RAM run's losses exactly.
//!
//! The cgroup is made by this test (it needs root and a writable cgroup filesystem, v1 or
//! v2). Where it cannot be made the test says so on a line starting `offload cgroup:
//! SKIPPED`, which `.ci/run` repeats in its summary, and checks the offloaded run uncapped.

use std::fs;
use std::path::Path;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_tests::cgroup::{Cgroup, command_in, gpt_report, say};
use burn_deepspeed_tests::offload::{offload_config, with_params_offloaded};

const STEPS: &str = "2";

/// GPT `small` at stage 3 on one rank: 4 sequences per step, one per micro-batch, blocks
/// checkpointed (so that activations stay small beside the model state), optimizer and
/// parameters on disk when `swap` is given.
fn config(swap: Option<&Path>) -> DeepSpeedConfig {
    let mut c = match swap {
        None => offload_config(3, "fp32", None),
        Some(dir) => with_params_offloaded(
            offload_config(3, "fp32", Some(("nvme", dir, 100_000, true))),
            "nvme",
            dir,
            2,
            1 << 20,
        ),
    };
    c.train_batch_size = Some(4);
    c.train_micro_batch_size_per_gpu = Some(1);
    c.gradient_accumulation_steps = None;
    c.activation_checkpointing = Some(Default::default());
    c
}

/// Runs `gpt-run` on `config` (written to `dir`), inside the cgroup whose `cgroup.procs` is
/// `procs` when given; returns its report.
fn run(config: &DeepSpeedConfig, dir: &Path, procs: Option<&Path>) -> serde_json::Value {
    let file = dir.join("ds_config.json");
    fs::write(
        &file,
        serde_json::to_string(config).expect("config serializes"),
    )
    .expect("write");
    let exe = env!("CARGO_BIN_EXE_gpt-run");
    let mut cmd = command_in(exe, procs);
    // glibc's allocator raises its mmap threshold as large buffers are freed, and then keeps
    // freed gathered weights and gradients in its heap; a fixed threshold hands them back,
    // as a memory-capped job would set it.
    cmd.env("MALLOC_MMAP_THRESHOLD_", "65536");
    cmd.arg(&file).arg("small").arg(STEPS);
    gpt_report(&mut cmd, "offload")
}

fn losses(report: &serde_json::Value) -> Vec<f64> {
    report["losses"]
        .as_array()
        .expect("losses")
        .iter()
        .map(|l| l.as_f64().expect("a loss"))
        .collect()
}

#[test]
fn gpt_small_trains_offloaded_in_a_cgroup_capped_below_its_in_ram_model_state() {
    let dir = tempfile::tempdir().expect("temp dir");
    let in_ram = run(&config(None), dir.path(), None);
    let state = in_ram["model_state_bytes_per_rank"]
        .as_u64()
        .expect("model-state bytes");
    let params = in_ram["params"].as_u64().expect("params");
    // 16 bytes per parameter at fp32 (parameters, gradients, Adam's m and v).
    assert!(state >= 16 * params, "{state} for {params} parameters");
    let cap = state * 9 / 10;
    let offloaded = config(Some(dir.path()));
    let (report, capped) = match Cgroup::create("offload", cap) {
        Ok(group) => {
            let report = run(&offloaded, dir.path(), Some(&group.procs()));
            let peak = group.peak();
            say(format!(
                "offload cgroup: capped at {cap} bytes (in-RAM model state {state}); the \
                 offloaded run's group peaked at {peak:?} bytes, its process at {} bytes",
                report["peak_rss_bytes"]
            ));
            if let Some(peak) = peak {
                assert!(peak <= cap, "{peak} above the cap {cap}");
            }
            (report, true)
        }
        Err(why) => {
            say(format!(
                "offload cgroup: SKIPPED the memory cap ({why}); ran uncapped"
            ));
            (run(&offloaded, dir.path(), None), false)
        }
    };
    assert_eq!(losses(&in_ram), losses(&report), "capped: {capped}");
    assert_eq!(report["offload_param"], "nvme");
    assert_eq!(report["offload_optimizer"], "nvme");
    let rss = report["peak_rss_bytes"].as_u64().expect("peak RSS");
    println!(
        "in RAM: model state {state} bytes, peak RSS {}; offloaded: peak RSS {rss}, model state \
         in RAM {}",
        in_ram["peak_rss_bytes"], report["model_state_bytes_per_rank"]
    );
}
