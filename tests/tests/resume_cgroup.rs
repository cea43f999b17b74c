//! A ZeRO-3 resume in no more memory than training: GPT `medium` on 4 thread ranks at stage 3
//! trains 2 steps and saves; the resume (load, then one more step) runs inside a memory
//! cgroup capped at 1.3 times the training run's peak RSS and must succeed. A load that read
//! every rank's files whole (every rank holding the whole model and every rank's moments)
//! needed several times training's memory.
//!
//! The cgroup is made by this test (see `burn_deepspeed_tests::cgroup`). Where it cannot be
//! made the test says so on a line starting `resume cgroup: SKIPPED`, which `.ci/run` repeats
//! in its summary, and compares the resume's peak RSS with the cap instead.

use std::fs;
use std::path::Path;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_tests::cgroup::{Cgroup, command_in, gpt_report, say};

const MODEL: &str = "medium";
const RANKS: &str = "4";

/// The GPT example's stage-3 config, 2 sequences per rank per step.
fn config() -> DeepSpeedConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gpt/configs/zero3.json");
    let (mut c, _) = DeepSpeedConfig::from_file(&path).expect("the example's config");
    c.train_batch_size = Some(8);
    c
}

/// Runs `gpt-run` for `steps` steps with `checkpoint` (`save` or `resume`, and a directory),
/// inside the cgroup whose `cgroup.procs` is `procs` when given; returns its report.
fn run(dir: &Path, steps: u64, checkpoint: [&str; 2], procs: Option<&Path>) -> serde_json::Value {
    let file = dir.join("ds_config.json");
    let json = serde_json::to_string(&config()).expect("config serializes");
    fs::write(&file, json).expect("write");
    let mut cmd = command_in(env!("CARGO_BIN_EXE_gpt-run"), procs);
    cmd.arg(&file)
        .args([MODEL, &steps.to_string(), RANKS])
        .args(checkpoint);
    gpt_report(&mut cmd, checkpoint[0])
}

#[test]
fn a_stage_3_resume_fits_in_1_3_times_the_training_peak() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().expect("a UTF-8 path");
    let trained = run(dir.path(), 2, ["save", ckpt], None);
    let peak = trained["peak_rss_bytes"].as_u64().expect("peak RSS");
    assert!(peak > 0, "no peak RSS on this system");
    let cap = peak * 13 / 10;
    let (resumed, capped) = match Cgroup::create("resume", cap) {
        Ok(group) => {
            let report = run(dir.path(), 3, ["resume", ckpt], Some(&group.procs()));
            say(format!(
                "resume cgroup: capped at {cap} bytes (training peak RSS {peak}); the resume's \
                 group peaked at {:?} bytes, its process at {} bytes",
                group.peak(),
                report["peak_rss_bytes"]
            ));
            (report, true)
        }
        Err(why) => {
            say(format!(
                "resume cgroup: SKIPPED the memory cap ({why}); ran uncapped"
            ));
            (run(dir.path(), 3, ["resume", ckpt], None), false)
        }
    };
    assert_eq!(resumed["first_step"], 2, "resumed at the saved step");
    assert_eq!(resumed["steps"], 3);
    let rss = resumed["peak_rss_bytes"].as_u64().expect("peak RSS");
    assert!(
        rss <= cap,
        "the resume peaked at {rss} bytes, above 1.3 x the training peak {peak} (capped: \
         {capped})"
    );
}
