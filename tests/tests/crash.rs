//! A process killed with SIGKILL while it saves checkpoints, at ZeRO stages 0-3: the
//! checkpoint `latest` names always loads (never a partial directory) and resumes
//! bit-identically with the run that was never interrupted.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use burn_deepspeed_tests::{crash_spec, splitmix};

use crate::common;

/// Kills per stage.
const KILLS: usize = 10;

/// Starts the saver for `target + 2` steps and kills it with SIGKILL during save `target`
/// (after a random part of the previous save's duration); returns the last step whose save
/// completed, and whether the signal landed before the saver finished.
fn kill_during_save(dir: &std::path::Path, stage: u8, target: u64, fraction: f64) -> (u64, bool) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fault-victim"))
        .arg("save")
        .arg(dir)
        .arg(stage.to_string())
        .arg((target + 2).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the saver");
    let stdout = child.stdout.take().expect("piped");
    let (mut completed, mut last_micros) = (0u64, 1000u64);
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("saver output");
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["saved", n, micros] => {
                completed = n.parse().expect("step");
                last_micros = micros.parse().expect("micros");
            }
            ["saving", n] if n.parse::<u64>().expect("step") == target => {
                let wait = (last_micros as f64 * fraction) as u64;
                std::thread::sleep(Duration::from_micros(wait));
                child.kill().expect("SIGKILL");
                break;
            }
            _ => {}
        }
    }
    let status = child.wait().expect("reaped");
    (completed, !status.success())
}

#[test]
fn a_save_killed_at_random_points_leaves_a_checkpoint_that_resumes_exactly() {
    let reference = common::train(2, &crash_spec(0, 14));
    // Reproducible kill points.
    let mut next = splitmix(0x5EED);
    for stage in 0..=3u8 {
        let reference = if stage == 0 {
            reference.clone()
        } else {
            common::train(2, &crash_spec(stage, 14))
        };
        let mut landed = 0;
        for kill in 0..KILLS {
            let dir = tempfile::tempdir().expect("tempdir");
            let target = 2 + next() % 8;
            let fraction = (next() % 1000) as f64 / 700.0;
            let (completed, killed) = kill_during_save(dir.path(), stage, target, fraction);
            landed += usize::from(killed);
            // The load takes `latest`; it holds the last completed save, or the one being
            // written when its commit finished before the kill.
            // (The saver may finish this save, or even the run, before the signal lands.)
            let mut resume = crash_spec(stage, target + 3);
            resume.resume_from = Some(dir.path().to_path_buf());
            let resumed = common::train(2, &resume);
            let what = format!("stage {stage} kill {kill} in save {target} ({fraction:.2})");
            assert!(
                (completed..=target + 2).contains(&resumed.first_step),
                "{what}: resumed at {} after save {completed} completed",
                resumed.first_step
            );
            let from = resumed.first_step as usize;
            assert_eq!(
                resumed.losses,
                reference.losses[from..(target + 3) as usize],
                "{what}: the resumed losses"
            );
        }
        assert!(
            landed >= KILLS / 2,
            "stage {stage}: only {landed} kills landed mid-run"
        );
    }
}
