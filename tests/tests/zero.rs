//! ZeRO stages 1 and 2 (arXiv 1910.02054): every stage follows stage 0's trajectory at every
//! world size, with AdamW and LAMB, with and without gradient accumulation; each rank holds
//! the model state the ZeRO formulas predict; per-rank checkpoints resume exactly.

mod common;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::RunReport;
use common::max_rel_diff;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
};

fn config(stage: u8, optimizer: &str, gas: u64, extra: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_accumulation_steps": {gas},
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "{optimizer}", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000,
                                   "allgather_bucket_size": 5000 {extra}}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn train(ranks: usize, config: DeepSpeedConfig, steps: u64) -> RunReport {
    common::train(ranks, &common::spec(config, SHAPE, steps, 5, 9))
}

fn max_param_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Stages 1 and 2 at world 1, 2 and 4 reproduce stage 0 at the same world size within
/// 1e-4 relative at every step, for AdamW and LAMB, with gradient accumulation 1 and 4.
#[test]
fn stages_1_and_2_follow_stage_0() {
    const STEPS: u64 = 8;
    for optimizer in ["AdamW", "Lamb"] {
        for gas in [1, 4] {
            for world in [1, 2, 4] {
                if gas * world as u64 > 16 {
                    continue;
                }
                let base = train(world, config(0, optimizer, gas, ""), STEPS);
                for stage in [1, 2] {
                    let z = train(world, config(stage, optimizer, gas, ""), STEPS);
                    let diff = max_rel_diff(&base.losses, &z.losses);
                    let pdiff = max_param_diff(&base.final_params, &z.final_params);
                    println!(
                        "{optimizer} gas {gas} world {world} stage {stage}: max rel loss diff \
                         {diff:.2e}, max param diff {pdiff:.2e}"
                    );
                    assert!(
                        diff <= 1e-4,
                        "{optimizer} gas {gas} world {world} stage {stage}: {diff}"
                    );
                    assert!(
                        pdiff <= 1e-4,
                        "{optimizer} gas {gas} world {world} stage {stage}: {pdiff}"
                    );
                }
            }
        }
    }
}

/// The model state each rank holds after a step is the ZeRO paper's: stage 1 keeps 4Ψ
/// parameters + 4Ψ gradients + 8Ψ/N optimizer state; stage 2 4Ψ + 4Ψ/N + 8Ψ/N.
#[test]
fn each_rank_holds_the_partitioned_state() {
    let world = 4;
    let s1 = train(world, config(1, "AdamW", 1, ""), 2);
    let s2 = train(world, config(2, "AdamW", 1, ""), 2);
    let psi = s1.params as u64;
    let slice = psi.div_ceil(world as u64);
    assert!(s1.model_state_bytes_per_rank <= 8 * psi + 8 * slice);
    assert!(s1.model_state_bytes_per_rank >= 8 * psi + 8 * (psi / world as u64));
    assert!(s2.model_state_bytes_per_rank <= 4 * psi + 12 * slice);
    assert!(s2.model_state_bytes_per_rank >= 4 * psi + 12 * (psi / world as u64));
    // Reduce-scatter + all-gather move as much as stage 0's all-reduce: 2 (N-1)/N Ψ elements
    // per rank per step, plus a few scalars.
    let base = train(world, config(0, "AdamW", 1, ""), 2);
    for z in [&s1, &s2] {
        let (zb, bb) = (
            z.comm_bytes_per_step[1] as f64,
            base.comm_bytes_per_step[1] as f64,
        );
        assert!(
            (zb / bb - 1.0).abs() < 0.05,
            "stage {}: {zb} vs {bb} bytes",
            z.zero_stage
        );
    }
}

/// `reduce_scatter: false` (all-reduce each bucket, keep the own part) changes nothing but the
/// traffic.
#[test]
fn all_reduce_path_matches_reduce_scatter() {
    for stage in [1, 2] {
        let rs = train(2, config(stage, "AdamW", 2, ""), 4);
        let ar = train(
            2,
            config(stage, "AdamW", 2, r#", "reduce_scatter": false"#),
            4,
        );
        assert!(max_rel_diff(&rs.losses, &ar.losses) <= 1e-6);
    }
}

/// Stage 3 and ZeRO++ settings are refused with the key and the reason.
#[test]
fn unsupported_zero_settings_are_refused() {
    for (extra, key) in [
        ("", "zero_optimization.stage"),
        (
            r#", "zero_quantized_weights": true"#,
            "zero_optimization.zero_quantized_weights",
        ),
        (
            r#", "offload_optimizer": {"device": "cpu"}"#,
            "zero_optimization.offload_optimizer",
        ),
    ] {
        let stage = if extra.is_empty() { 3 } else { 2 };
        let spec = common::spec(config(stage, "AdamW", 1, extra), SHAPE, 1, 5, 9);
        let err = burn_deepspeed::launch::launch(1, std::time::Duration::from_secs(30), |comm| {
            burn_deepspeed_example_gpt::run::run_rank(&spec, comm)
        })
        .expect_err("refused");
        let text = err.to_string();
        assert!(text.contains(key), "{text}");
    }
}

/// A stage-2 checkpoint holds one optimizer file per rank; resuming at the same world size
/// continues the uninterrupted trajectory bit for bit, and at another world size (or stage 1)
/// the slices are re-cut and it continues within 1e-4. A stage-0 checkpoint and a corrupt
/// slice are refused with the reason.
#[test]
fn per_rank_checkpoints_resume_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config(2, "Lamb", 2, "");
    let whole = train(4, cfg.clone(), 6);

    let mut first = common::spec(cfg.clone(), SHAPE, 3, 5, 9);
    first.save_dir = Some(dir.path().to_path_buf());
    common::train(4, &first);
    let ckpt = dir.path().join("global_step3");
    for r in 0..4 {
        assert!(
            ckpt.join(format!("zero_pp_rank_{r}_optim_states.bin"))
                .exists()
        );
    }
    let meta = std::fs::read_to_string(ckpt.join("meta.json")).expect("meta");
    assert!(meta.contains(r#""zero_stage": 2"#), "{meta}");

    let mut rest = common::spec(cfg.clone(), SHAPE, 6, 5, 9);
    rest.resume_from = Some(dir.path().to_path_buf());
    let resumed = common::train(4, &rest);
    assert_eq!(resumed.first_step, 3);
    assert_eq!(resumed.losses, whole.losses[3..]);
    assert_eq!(resumed.final_params, whole.final_params);

    for (world, stage) in [(2, 2), (1, 1), (8, 1)] {
        let mut other = common::spec(config(stage, "Lamb", 2, ""), SHAPE, 6, 5, 9);
        other.resume_from = Some(dir.path().to_path_buf());
        let got = common::train(world, &other);
        let diff = max_rel_diff(&got.losses, &whole.losses[3..]);
        assert!(
            diff <= 1e-4,
            "resumed at world {world} stage {stage}: {diff}"
        );
    }

    let mut stage0 = common::spec(config(0, "Lamb", 2, ""), SHAPE, 6, 5, 9);
    stage0.resume_from = Some(dir.path().to_path_buf());
    let refused = |spec: &burn_deepspeed_example_gpt::run::RunSpec, world| {
        burn_deepspeed::launch::launch(world, std::time::Duration::from_secs(60), |c| {
            burn_deepspeed_example_gpt::run::run_rank(spec, c)
        })
        .expect_err("refused")
        .to_string()
    };
    let err = refused(&stage0, 2);
    assert!(
        err.contains("written at ZeRO stage 2; this engine runs stage 0"),
        "{err}"
    );

    let slice = ckpt.join("zero_pp_rank_1_optim_states.bin");
    let mut bytes = std::fs::read(&slice).expect("slice");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&slice, bytes).expect("write");
    let err = refused(&rest, 4);
    assert!(
        err.contains("zero_pp_rank_1_optim_states.bin is corrupt"),
        "{err}"
    );
}
