//! Observability on the GPT example: the communication logger's totals against the
//! communicators' own counters, the monitor's TensorBoard and CSV files read back, and the
//! wall-clock breakdown's phases against the step time.

use crate::common;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::monitor::{MonitorRecord, read_scalars, tensorboard_tag};
use burn_deepspeed_example_gpt::model::GptShape;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

fn config(extra: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 8, "gradient_accumulation_steps": 2,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}{extra}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

/// The logger sees every collective of the run, on the world and on its groups: its byte
/// totals are the transports' counters, kind by kind, and its table lists every kind used.
#[test]
fn comms_logger_totals_equal_the_measured_counters() {
    let cases = [
        ("stage 2, dp 2", 2, r#", "zero_optimization": {"stage": 2}"#),
        ("stage 3, dp 2", 2, r#", "zero_optimization": {"stage": 3}"#),
        (
            "pipeline 2 x dp 2",
            4,
            r#", "pipeline": {"stages": 2}, "train_micro_batch_size_per_gpu": 1"#,
        ),
    ];
    for (name, ranks, section) in cases {
        let extra = format!(r#"{section}, "comms_logger": {{"enabled": true}}"#);
        let mut c = config(&extra);
        if ranks == 4 {
            c.gradient_accumulation_steps = Some(4);
        }
        let report = common::train(ranks, &common::spec(c, SHAPE, 3, 1, 2));
        let comms = report.comms.expect("the logger is on");
        println!("{name}:\n{}", comms.summary);
        assert!(!comms.measured.is_empty(), "{name}: no traffic measured");
        assert_eq!(
            comms.logged, comms.measured,
            "{name}: [calls, sent, received] by kind"
        );
        for op in comms.measured.keys() {
            assert!(
                comms.summary.lines().any(|l| l == op),
                "{name}: `{op}` missing from the table"
            );
        }
        let expected: &[&str] = match name {
            "stage 2, dp 2" => &["all_reduce", "reduce_scatter", "all_gather"],
            // This small model's parameters stay whole (under the persistence threshold):
            // stage 3 gathers the rest and all-reduces their gradients.
            "stage 3, dp 2" => &["all_reduce", "all_gather"],
            _ => &["all_reduce", "send", "recv"],
        };
        for op in expected {
            assert!(comms.measured.contains_key(*op), "{name}: no {op}");
        }
    }
    // Off by default: no log, no report.
    let report = common::train(2, &common::spec(config(""), SHAPE, 1, 1, 2));
    assert!(report.comms.is_none());
}

/// TensorBoard event files and the CSV written by a run, read back: every scalar once per
/// step, at the samples seen, and one CSV row per step.
#[test]
fn monitor_files_hold_every_step() {
    const STEPS: u64 = 4;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display();
    let c = config(&format!(
        r#", "tensorboard": {{"enabled": true, "output_path": "{out}", "job_name": "tb"}},
            "csv_monitor": {{"enabled": true, "output_path": "{out}", "job_name": "csv"}},
            "wall_clock_breakdown": true, "steps_per_print": 2"#
    ));
    let report = common::train(2, &common::spec(c, SHAPE, STEPS, 1, 2));

    let events: Vec<_> = std::fs::read_dir(dir.path().join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1, "one event file (rank 0's): {events:?}");
    let scalars = read_scalars(&events[0]).unwrap();
    // Every scalar but fp16's loss scale, each step.
    for name in MonitorRecord::NAMES {
        let tag = tensorboard_tag(name);
        let steps: Vec<i64> = scalars
            .iter()
            .filter(|e| e.tag == tag)
            .map(|e| e.step)
            .collect();
        match name {
            "loss_scale" => assert!(steps.is_empty(), "{tag}"),
            _ => assert_eq!(steps, vec![8, 16, 24, 32], "{tag}: x is the samples seen"),
        }
    }
    let losses: Vec<f64> = scalars
        .iter()
        .filter(|e| e.tag == "Train/Samples/train_loss")
        .map(|e| e.value as f64)
        .collect();
    for (logged, reported) in losses.iter().zip(&report.losses) {
        assert!(
            (logged - reported).abs() <= 1e-6 * reported.abs(),
            "{logged} vs {reported}"
        );
    }
    let tokens_per_s = scalars
        .iter()
        .find(|e| e.tag == "Train/Samples/tokens_per_s")
        .unwrap()
        .value;
    assert!(tokens_per_s > 0.0);

    let csv = std::fs::read_to_string(dir.path().join("csv/metrics.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 1 + STEPS as usize, "{csv}");
    assert_eq!(rows[0][..3], ["step", "samples", "train_loss"]);
    for (i, row) in rows[1..].iter().enumerate() {
        assert_eq!(row.len(), rows[0].len());
        assert_eq!(row[0], (i + 1).to_string());
        let loss: f64 = row[2].parse().unwrap();
        assert!((loss - report.losses[i]).abs() <= 1e-12 * loss.abs());
        // The breakdown's phases are within the step: their sum is at most the step's
        // wall time (train_batch_size / samples_per_s).
        let col = |name: &str| -> f64 {
            let at = rows[0].iter().position(|c| *c == name).unwrap();
            row[at].parse().unwrap()
        };
        let phases = [
            "forward_ms",
            "backward_ms",
            "accumulate_ms",
            "reduce_ms",
            "optimizer_ms",
        ]
        .map(col)
        .iter()
        .sum::<f64>();
        let step_ms = 8.0 / col("samples_per_s") * 1e3;
        assert!(
            phases > 0.0 && phases <= step_ms * 1.001,
            "{phases} ms of {step_ms} ms"
        );
        assert!(col("model_state_bytes") > 0.0 && col("peak_rss_bytes") > 0.0);
    }
    // Each rank's mean phases over the steps after the first: they and `other` make up the
    // step, and under the breakdown the wait for the other rank is measured apart.
    assert_eq!(report.breakdown_per_rank.len(), 2);
    for b in &report.breakdown_per_rank {
        let parts = [
            b.forward,
            b.backward,
            b.accumulate,
            b.reduce_wait,
            b.reduce,
            b.optimizer,
            b.other,
        ];
        assert!(parts.iter().all(|p| *p >= 0.0) && b.forward > 0.0 && b.backward > 0.0);
        let sum: f64 = parts.iter().sum();
        assert!((sum - b.step).abs() <= 1e-9 * b.step, "{b:?}");
    }
}

/// The pipeline engine writes the same files: one row per step from global rank 0, with its
/// forward, backward, reduce and optimizer phases.
#[test]
fn the_pipeline_engine_monitors_too() {
    const STEPS: u64 = 3;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display();
    let mut c = config(&format!(
        r#", "pipeline": {{"stages": 2}}, "train_micro_batch_size_per_gpu": 1,
            "csv_monitor": {{"enabled": true, "output_path": "{out}", "job_name": "pipe"}}"#
    ));
    c.gradient_accumulation_steps = Some(4);
    let report = common::train(4, &common::spec(c, SHAPE, STEPS, 1, 2));
    let csv = std::fs::read_to_string(dir.path().join("pipe/metrics.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 1 + STEPS as usize, "{csv}");
    for (i, row) in rows[1..].iter().enumerate() {
        let cell = |name: &str| row[rows[0].iter().position(|c| *c == name).unwrap()];
        let loss: f64 = cell("train_loss").parse().unwrap();
        assert!((loss - report.losses[i]).abs() <= 1e-12 * loss.abs());
        for name in [
            "forward_ms",
            "backward_ms",
            "reduce_ms",
            "optimizer_ms",
            "tokens_per_s",
        ] {
            assert!(
                cell(name).parse::<f64>().unwrap() > 0.0,
                "{name} in row {i}"
            );
        }
    }
}

/// `flops_profiler` in the config: global rank 0 profiles the model at `profile_step` and
/// writes the report, with the step's measured times, to `output_file`.
#[test]
fn the_engine_profiles_at_the_profile_step() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("profile.txt");
    let c = config(&format!(
        r#", "flops_profiler": {{"enabled": true, "profile_step": 2, "module_depth": 2,
                                 "output_file": "{}"}}"#,
        file.display()
    ));
    common::train(2, &common::spec(c, SHAPE, 3, 1, 2));
    let text = std::fs::read_to_string(&file).expect("the profile was written");
    // One micro-batch: 8 samples / (2 ranks x 2 micro-batches) = 2 sequences of 16.
    let (b, t, d, l, v) = (2u64, 16u64, 32u64, 2u64, 256u64);
    let macs = l * (12 * b * t * d * d + 2 * b * t * t * d) + b * t * d * v;
    let line = text.lines().find(|l| l.starts_with("fwd MACs:")).unwrap();
    let expected = burn_deepspeed::profiler::si(macs as f64, "MACs");
    assert!(line.contains(&expected), "{line} vs {macs}\n{text}");
    for needed in [
        "iter latency",
        "samples/second",
        "bwd latency in training",
        "depth 2:",
    ] {
        assert!(text.contains(needed), "`{needed}` missing:\n{text}");
    }
    assert!(!text.contains("depth 3:"), "module_depth 2:\n{text}");
}
