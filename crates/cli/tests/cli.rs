//! The `burn-deepspeed` binary: exit codes and output of `config check`, `schedule`,
//! `estimate-memory`, `launch` and `report`.

use std::process::Command;

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_burn-deepspeed"))
        .args(args)
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write config");
    path.display().to_string()
}

#[test]
fn config_check_prints_the_resolved_config_or_the_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ok = write(&dir, "ok.json", r#"{"train_batch_size": 32}"#);
    let (code, stdout, _) = cli(&["config", "check", &ok, "--world", "4"]);
    assert_eq!(code, 0);
    let resolved: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(resolved["train_micro_batch_size_per_gpu"], 8);
    assert_eq!(
        resolved["zero_optimization"]["reduce_bucket_size"],
        500_000_000u64
    );
    assert_eq!(resolved["optimizer"]["type"], "AdamW");

    let typo = write(
        &dir,
        "typo.json",
        r#"{"train_batch_size": 8, "gradient_clippin": 1}"#,
    );
    let (code, _, stderr) = cli(&["config", "check", &typo]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("did you mean `gradient_clipping`"),
        "{stderr}"
    );

    let batch = write(
        &dir,
        "batch.json",
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}"#,
    );
    let (code, _, stderr) = cli(&["config", "check", &batch, "--world", "2"]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("(10)") && stderr.contains("(4)") && stderr.contains("(2)"),
        "{stderr}"
    );
}

#[test]
fn config_check_runs_the_refusals_of_the_entry_point() {
    let dir = tempfile::tempdir().expect("temp dir");
    // ZeRO-2 with a pipeline: the pipeline engine refuses it; offload to host memory runs in
    // the engine and the Learner strategy, not in the pipeline engine.
    let zero2 = write(
        &dir,
        "zero2.json",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}}"#,
    );
    let offload = write(
        &dir,
        "offload.json",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2,
            "offload_optimizer": {"device": "cpu"}}}"#,
    );
    for (file, entry, refused) in [
        (&zero2, "engine", None),
        (&zero2, "pipeline", Some("zero_optimization.stage")),
        (&zero2, "learner", None),
        (&offload, "engine", None),
        (&offload, "learner", None),
        (&offload, "pipeline", Some("offload_optimizer")),
    ] {
        let (code, _, stderr) = cli(&["config", "check", file, "--entry", entry]);
        match refused {
            None => assert_eq!(code, 0, "{entry}: {stderr}"),
            Some(key) => {
                assert_eq!(code, 1, "{entry}");
                assert!(stderr.contains(key), "{entry}: {stderr}");
            }
        }
    }
    // Burn's checkpointer in the Learner strategy: every stage passes, fp16 is refused by name
    // (Burn's checkpoint has no place for its loss scale).
    let zero3 = write(
        &dir,
        "zero3.json",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3}}"#,
    );
    let fp16 = write(
        &dir,
        "fp16.json",
        r#"{"train_batch_size": 8, "fp16": {"enabled": true}}"#,
    );
    for (file, refused) in [(&zero2, false), (&zero3, false), (&fp16, true)] {
        let args = [
            "config",
            "check",
            file,
            "--entry",
            "learner",
            "--checkpointer",
        ];
        let (code, _, stderr) = cli(&args);
        assert_eq!(code, i32::from(refused), "{file}: {stderr}");
        if refused {
            assert!(stderr.contains("fp16.enabled"), "{stderr}");
        }
    }
}

#[test]
fn schedule_json_has_one_list_per_stage_and_step() {
    let (code, stdout, _) = cli(&[
        "schedule",
        "--stages",
        "4",
        "--micro-batches",
        "8",
        "--json",
    ]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON");
    assert_eq!(v["stages"], 4);
    assert_eq!(v["micro_batches"], 8);
    let schedule = v["schedule"].as_array().expect("array");
    assert_eq!(schedule.len(), 4);
    assert!(
        schedule
            .iter()
            .all(|s| s.as_array().map(Vec::len) == Some(22))
    );
    assert_eq!(
        v["schedule"][0][0][0],
        serde_json::json!(["LoadMicroBatch", 0])
    );
    assert_eq!(
        v["schedule"][3][21][0],
        serde_json::json!(["ReduceTiedGrads", null])
    );
}

#[test]
fn estimate_memory_prints_the_zero_formulas() {
    // The ZeRO paper's example: Ψ = 7.5B, N = 64, mixed precision: 120 / 31.4 / 16.6 / 1.9 GB.
    let (code, stdout, _) = cli(&[
        "estimate-memory",
        "--params",
        "7.5e9",
        "--world",
        "64",
        "--precision",
        "mixed",
        "--json",
    ]);
    assert_eq!(code, 0);
    let totals: Vec<f64> = stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("one JSON object per line");
            v["total"].as_f64().expect("total") / 1e9
        })
        .collect();
    assert_eq!(totals.len(), 4);
    for (got, want) in totals.iter().zip([120.0, 31.40625, 16.640625, 1.875]) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    let (code, stdout, _) = cli(&[
        "estimate-memory",
        "--params",
        "1e6",
        "--world",
        "4",
        "--stage",
        "2",
    ]);
    assert_eq!(code, 0);
    assert!(stdout.contains("    2 |"), "{stdout}");
    let (code, _, stderr) = cli(&["estimate-memory", "--params", "1e6", "--stage", "5"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("--stage 0-3"), "{stderr}");
    // A count whose bytes overflow 64 bits is refused (it panicked, or wrapped in release).
    for (flag, params) in [("--params", "1e19"), ("--largest-layer", "1e9")] {
        let mut args = vec!["estimate-memory", "--params", params, "--offload"];
        if flag != "--params" {
            args.extend([flag, "1e19"]);
        }
        let (code, _, stderr) = cli(&args);
        assert_eq!(code, 1, "{flag}");
        assert!(stderr.contains(flag) && stderr.contains("1e15"), "{stderr}");
    }
}

#[test]
fn launch_sets_the_ranks_or_drives_mpirun() {
    let (code, stdout, stderr) = cli(&[
        "launch",
        "--dry-run",
        "--ranks",
        "2",
        "--",
        "train",
        "--steps",
        "4",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.trim(), "BURN_DEEPSPEED_RANKS=2 train --steps 4");

    let dir = tempfile::tempdir().expect("temp dir");
    let hosts = write(&dir, "hosts", "node-a slots=2\nnode-b slots=2\n");
    let (code, stdout, stderr) = cli(&[
        "launch",
        "--dry-run",
        "--mpi",
        "4",
        "--hostfile",
        &hosts,
        "--mpirun-arg=--bind-to",
        "--mpirun-arg=none",
        "--",
        "train",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let line = stdout.trim();
    // The job's ranks keep their flight-recorder rings in a folder of the launcher's.
    let line = line
        .strip_prefix("BURN_DEEPSPEED_FLIGHT_DIR=")
        .and_then(|l| l.split_once(' '))
        .map_or(line, |(_, rest)| rest);
    assert!(
        line.starts_with(&format!("mpirun -n 4 --hostfile {hosts} ")),
        "{line}"
    );
    assert!(line.contains(" -x BURN_DEEPSPEED_FLIGHT_DIR "), "{line}");
    assert!(line.ends_with("--bind-to none train --json"), "{line}");

    for (args, says) in [
        (
            vec!["launch", "--", "train"],
            "--ranks N, --mpi N or --gpus",
        ),
        (
            vec!["launch", "--ranks", "0", "--", "train"],
            "at least one rank",
        ),
        (
            vec![
                "launch",
                "--ranks",
                "2",
                "--hostfile",
                &hosts,
                "--",
                "train",
            ],
            "give --mpi N",
        ),
        (
            vec![
                "launch",
                "--mpi",
                "2",
                "--hostfile",
                "/no/such/hosts",
                "--",
                "train",
            ],
            "no such file",
        ),
    ] {
        let (code, _, stderr) = cli(&args);
        assert_eq!(code, 1, "{args:?}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let (code, _, stderr) = cli(&["launch", "--ranks", "1", "--", "/no/such/program"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("cannot run `/no/such/program`"), "{stderr}");
}

#[test]
fn report_lists_the_build_and_the_machine() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = cli(&["report", "--nvme-path", &path]);
    assert_eq!(code, 0, "{stderr}");
    for what in [
        "features of this build",
        "MPI (feature mpi)",
        "NCCL (feature cuda)",
        "Vulkan (feature wgpu)",
        "io_uring for swap files",
        "CPU cores",
        "memory",
    ] {
        assert!(stdout.contains(what), "{what} missing from:\n{stdout}");
    }
    assert!(
        stdout.contains(&format!("{path}: ")) && stdout.contains(" free of "),
        "{stdout}"
    );
}
