//! The 1-bit optimizers in the engine, checkpoints, and progressive layer dropping, on a small
//! GPT.

use std::time::Duration;

use crate::common;

use crate::common::{assert_learns, max_abs_diff, max_rel_diff, train};
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed::pld::ProgressiveLayerDrop;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunSpec, run_rank};

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
    moe: None,
};

fn config(optimizer: &str, params: &str, extra: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 8, "gradient_clipping": 1.0,
            "optimizer": {{"type": "{optimizer}", "params": {{"lr": 3e-3, "weight_decay": 0.01 {params}}}}}
            {extra}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn spec(config: DeepSpeedConfig, steps: u64) -> RunSpec {
    common::spec(config, SHAPE, steps, 11, 3)
}

#[test]
fn warm_up_reproduces_one_rank_at_two_and_four_ranks() {
    // Before freeze_step the 1-bit optimizers all-reduce gradients: data parallelism must not
    // change the trajectory.
    for optimizer in ["OneBitAdam", "OneBitLamb"] {
        let cfg = config(optimizer, r#", "freeze_step": 100"#, "");
        let one = train(1, &spec(cfg.clone(), 6));
        for ranks in [2, 4] {
            let many = train(ranks, &spec(cfg.clone(), 6));
            let diff = max_rel_diff(&one.losses, &many.losses);
            assert!(diff <= 1e-4, "{optimizer} world {ranks}: {diff}");
            assert_eq!(many.compressed_steps, 0);
            assert_learns(&many.losses, optimizer);
        }
    }
}

#[test]
fn compression_sends_at_least_16x_less_per_step_and_still_learns() {
    for optimizer in ["OneBitAdam", "OneBitLamb"] {
        let cfg = config(optimizer, r#", "freeze_step": 4"#, "");
        let run = train(2, &spec(cfg, 12));
        assert_eq!(run.compressed_steps, 8, "{optimizer}");
        let warm = run.comm_bytes_per_step[1] as f64;
        for (step, &bytes) in run.comm_bytes_per_step.iter().enumerate().skip(4) {
            let ratio = warm / bytes as f64;
            assert!(ratio >= 16.0, "{optimizer} step {step}: {ratio:.1}x");
        }
        let (first, last) = (run.losses[0], *run.losses.last().expect("steps"));
        assert!(
            last.is_finite() && last < first,
            "{optimizer}: {first} -> {last}"
        );
    }
}

/// 0/1 Adam over 400 steps: the loss ends within 5% of Adam's, its schedule leaves most
/// frozen steps without communication, and the whole run sends less than 1-bit Adam's.
#[test]
fn zero_one_adam_learns_like_adam_and_sends_less_than_one_bit_adam() {
    let steps = 400;
    let mean_tail = |l: &[f64]| l[l.len() - 20..].iter().sum::<f64>() / 20.0;
    // β2 0.95, as the 1-bit benchmark uses: the variance these optimizers freeze is not
    // bias-corrected (as in DeepSpeed), and with β2 0.999 it is far from settled at step 80.
    let betas = r#", "betas": [0.9, 0.95]"#;
    let adam = train(2, &spec(config("Adam", betas, ""), steps));
    let params = format!(r#"{betas}, "freeze_step": 80"#);
    let one_bit = train(2, &spec(config("OneBitAdam", &params, ""), steps));
    // DeepSpeed's schedule defaults are sized for runs of 10^5 steps; these scale them to 400:
    // v is frozen at 20% of the run, its interval doubles after 40 updates, and the local
    // steps' interval after 80 frozen steps (1, 2, 4 then 8 steps between syncs).
    let schedule = r#""var_freeze_step": 80, "var_update_scaler": 40, "local_step_scaler": 80"#;
    let params = format!("{betas}, {schedule}");
    let zero_one = train(2, &spec(config("ZeroOneAdam", &params, ""), steps));
    let (base, ours) = (mean_tail(&adam.losses), mean_tail(&zero_one.losses));
    let total = |r: &burn_deepspeed_example_gpt::run::RunReport| -> u64 {
        r.comm_bytes_per_step.iter().sum()
    };
    let silent = zero_one.comm_bytes_per_step[80..]
        .iter()
        .filter(|&&b| b < 64)
        .count();
    println!(
        "0/1 Adam: loss {ours:.4} vs Adam {base:.4} ({:+.2}%) and 1-bit Adam {:.4}; bytes {} \
         vs 1-bit Adam {} and Adam {}; {silent} of {} frozen steps without an exchange",
        100.0 * (ours / base - 1.0),
        mean_tail(&one_bit.losses),
        total(&zero_one),
        total(&one_bit),
        total(&adam),
        steps - 80
    );
    assert!((ours / base - 1.0).abs() <= 0.05, "{ours} vs {base}");
    assert!(total(&zero_one) < total(&one_bit));
    assert!(silent >= 100, "{silent} local steps");
}

#[test]
fn one_bit_optimizers_with_zero_are_refused() {
    let cfg = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}}}"#;
    let (mut cfg, _) = DeepSpeedConfig::from_json_str(cfg).expect("parses");
    let err = cfg.resolve(2).expect_err("refused").to_string();
    assert!(
        err.contains("zero_optimization.stage") && err.contains("stage 0"),
        "{err}"
    );
}

#[test]
fn a_resumed_run_continues_the_trajectory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config("AdamW", "", "");
    let whole = train(2, &spec(cfg.clone(), 6));

    let mut first = spec(cfg.clone(), 3);
    first.save_dir = Some(dir.path().to_path_buf());
    train(2, &first);
    assert!(dir.path().join("global_step3/meta.json").exists());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("latest")).expect("latest"),
        "global_step3"
    );

    // Same world size: the resumed steps are the uninterrupted ones, bit for bit.
    let mut rest = spec(cfg.clone(), 6);
    rest.resume_from = Some(dir.path().to_path_buf());
    let resumed = train(2, &rest);
    assert_eq!(resumed.first_step, 3);
    assert_eq!(resumed.losses, whole.losses[3..]);
    assert_eq!(resumed.final_params, whole.final_params);

    // Another world size (stage 0 state is replicated): the same global batches.
    let other = train(1, &rest);
    let diff = max_rel_diff(&other.losses, &whole.losses[3..]);
    let pdiff = max_abs_diff(&other.final_params, &whole.final_params);
    println!("resumed at world 1: {diff:.2e} loss, {pdiff:.2e} params");
    assert!(diff <= 1e-4, "resumed at world 1: {diff}");
    assert!(pdiff <= 1e-5, "resumed at world 1: parameters {pdiff}");

    // A checkpoint of another optimizer is refused with the reason.
    let mut wrong = spec(config("OneBitAdam", r#", "freeze_step": 2"#, ""), 6);
    wrong.resume_from = Some(dir.path().to_path_buf());
    let err = launch(1, Duration::from_secs(60), |c| run_rank(&wrong, c))
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("written by optimizer AdamW; the config names OneBitAdam"),
        "{err}"
    );
}

#[test]
fn a_one_bit_checkpoint_keeps_the_freeze_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config("OneBitAdam", r#", "freeze_step": 2"#, "");
    let whole = train(2, &spec(cfg.clone(), 8));
    let mut first = spec(cfg.clone(), 4);
    first.save_dir = Some(dir.path().to_path_buf());
    train(2, &first);
    let meta = std::fs::read_to_string(dir.path().join("global_step4/meta.json")).expect("meta");
    assert!(meta.contains(r#""compressing": true"#), "{meta}");

    let mut rest = spec(cfg, 8);
    rest.resume_from = Some(dir.path().to_path_buf());
    let resumed = train(2, &rest);
    // Every resumed step compresses. The parameters are restored exactly, so the first
    // resumed step's loss is the uninterrupted one; the error buffers restart from zero (as in
    // DeepSpeed), so later steps depart from it.
    assert_eq!(resumed.compressed_steps, 4);
    assert_eq!(resumed.losses[0], whole.losses[4]);
    assert!(resumed.losses.iter().all(|l| l.is_finite()));
}

#[test]
fn a_zero_one_checkpoint_resumes_its_schedule() {
    // v frozen after 2 steps; syncs at steps 2, 3, 4, 6, 10, local steps between.
    let params = r#", "var_freeze_step": 2, "local_step_scaler": 2, "local_step_clipper": 4"#;
    let cfg = config("ZeroOneAdam", params, "");
    let steps = 12;
    let whole = train(2, &spec(cfg.clone(), steps));
    let silent = |bytes: &[u64]| -> Vec<bool> { bytes.iter().map(|&b| b < 64).collect() };
    let quiet = silent(&whole.comm_bytes_per_step);
    let expected: Vec<bool> = (0..steps).map(|t| [5, 7, 8, 9, 11].contains(&t)).collect();
    assert_eq!(quiet, expected, "{:?}", whole.comm_bytes_per_step);

    // Saved after a sync, where the ranks' parameters agree up to the rounding of the
    // roll-back (the checkpoint holds rank 0's).
    let dir = tempfile::tempdir().expect("tempdir");
    let mut first = spec(cfg.clone(), 4);
    first.save_dir = Some(dir.path().to_path_buf());
    train(2, &first);
    let mut rest = spec(cfg, steps);
    rest.resume_from = Some(dir.path().to_path_buf());
    let resumed = train(2, &rest);
    // The schedule, u and the summed learning rates come back: the same steps are silent,
    // and the first resumed step is the uninterrupted one up to that rounding (the error
    // buffers restart from zero, so later losses may depart from it).
    assert_eq!(silent(&resumed.comm_bytes_per_step), quiet[4..]);
    let first = (resumed.losses[0] - whole.losses[4]).abs() / whole.losses[4];
    assert!(first <= 1e-5, "first resumed step: {first:.2e}");
    assert!(resumed.losses.iter().all(|l| l.is_finite()));
}

#[test]
fn layer_drop_follows_theta_and_is_neutral_at_theta_one() {
    let base = config("AdamW", "", "");
    let plain = train(2, &spec(base, 5));
    // θ̄ = 1 keeps every block with probability 1 and scale 1: the plain trajectory.
    let keep_all = config(
        "AdamW",
        "",
        r#", "progressive_layer_drop": {"enabled": true, "theta": 1.0, "gamma": 0.5}"#,
    );
    let run = train(2, &spec(keep_all, 5));
    assert_eq!(run.losses, plain.losses);
    assert_eq!(run.pld_theta, Some(1.0));

    // A fast schedule: θ at the last step (t = 4) is the formula's, and blocks are dropped.
    let dropping = config(
        "AdamW",
        "",
        r#", "progressive_layer_drop": {"enabled": true, "theta": 0.2, "gamma": 0.5}"#,
    );
    let run = train(2, &spec(dropping, 5));
    let want = ProgressiveLayerDrop {
        theta: 0.2,
        gamma: 0.5,
    }
    .theta_at(4);
    let theta = run.pld_theta.expect("θ reported");
    assert!((theta - want).abs() <= 1e-12, "{theta} vs {want}");
    assert!((want - (0.8 * (-2.0f64).exp() + 0.2)).abs() <= 1e-12);
    assert_eq!(run.losses[0], plain.losses[0], "θ(0) = 1 drops nothing");
    assert_ne!(
        run.losses[1..],
        plain.losses[1..],
        "later steps drop blocks"
    );
    assert!(run.losses.iter().all(|l| l.is_finite()));
}
