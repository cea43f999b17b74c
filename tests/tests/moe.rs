//! Mixture of Experts (DeepSpeed-MoE, arXiv 2201.05596) in training: GPT `tiny-moe` with its
//! experts split over expert-parallel groups of 2 and 4 ranks follows the run where every
//! rank holds every expert; ZeRO stages 1-2 partition the experts in their own groups; what
//! cannot run is refused by key.

use crate::common;

use std::time::Duration;

use crate::common::{max_abs_diff, max_rel_diff};
use burn::tensor::Device;
use burn_deepspeed::checkpoint::consolidate;
use burn_deepspeed::grid::Grid;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_rank};

const STEPS: u64 = 20;

/// `tiny-moe`'s blocks (4, experts in blocks 2 and 4, top-1) at a quarter of its width and an
/// eighth of its context: the routing, the all-to-alls and the partitions are the same.
const SHAPE: GptShape = GptShape {
    d_model: 32,
    heads: 2,
    seq_len: 16,
    ..GptShape::TINY_MOE
};

fn config(stage: u8) -> DeepSpeedConfig {
    config_micro(stage, 2)
}

/// [`config`] with micro-batches of `micro` sequences (16 in all over 4 ranks: 2 gives two
/// micro-batches per step, 4 one).
fn config_micro(stage: u8, micro: usize) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 16, "train_micro_batch_size_per_gpu": {micro},
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50000}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn spec(stage: u8, ep_size: usize) -> RunSpec {
    let mut spec = common::spec(config(stage), SHAPE, STEPS, 3, 7);
    spec.ep_size = ep_size;
    spec
}

fn train(stage: u8, ep_size: usize) -> RunReport {
    common::train(4, &spec(stage, ep_size))
}

/// Four data-parallel ranks at ep 1, 2 and 4 (each rank then holds 4, 2 or 1 of the 4
/// experts of each MoE block): the same losses within 1e-4 relative over 20 steps, with
/// gradient clipping by the joint norm of the dense and expert gradients on. Tokens cross
/// ranks only at ep > 1.
#[test]
fn expert_parallel_runs_follow_every_expert_on_every_rank() {
    let whole = train(0, 1);
    let moe = whole.moe.as_ref().expect("a GPT-MoE reports its routing");
    assert_eq!(
        moe.all_to_all_bytes,
        vec![0; STEPS as usize],
        "ep 1 exchanges nothing"
    );
    assert!(moe.tokens_routed.iter().all(|&t| t > 0));
    assert!(moe.l_aux.iter().all(|l| l.is_finite() && *l > 0.0));
    assert!(
        whole.grad_norms.iter().any(|&n| n > 1.0),
        "clipping is active"
    );
    assert!(
        whole.losses[STEPS as usize - 1] < whole.losses[0] - 0.5,
        "the GPT-MoE learns: {:?}",
        whole.losses
    );
    for ep in [2, 4] {
        let cut = train(0, ep);
        let diff = max_rel_diff(&whole.losses, &cut.losses);
        let norms = max_rel_diff(&whole.grad_norms, &cut.grad_norms);
        let moe_cut = cut.moe.as_ref().expect("routing");
        println!(
            "ep {ep}: max rel loss diff {diff:.2e}, grad norm diff {norms:.2e}, all-to-all \
             bytes per step {}",
            moe_cut.all_to_all_bytes[0]
        );
        assert!(diff <= 1e-4, "ep {ep}: losses differ by {diff}");
        assert_eq!(
            moe_cut.tokens_dropped, moe.tokens_dropped,
            "ep {ep}: same drops"
        );
        assert!(
            moe_cut.all_to_all_bytes.iter().all(|&b| b > 0),
            "ep {ep} exchanges"
        );
        assert_eq!(cut.ep_size, ep);
        assert_eq!(
            cut.params, whole.params,
            "ep {ep}: the whole model's parameters"
        );
    }
}

/// At ep 2, ZeRO stages 1 and 2 (the dense state partitioned over the 4 data-parallel ranks,
/// the experts' over their 2-rank expert-data groups) follow stage 0: stage 1 reduces in the
/// same order and is identical; stage 2 reduces each micro-batch as it comes (2 per step
/// here), a different order of the same sums, within 1e-5 of the losses. Its parameters stay
/// within 1e-3: the discrete routing can send a token elsewhere when an fp32 rounding moves a
/// near tie, and Adam's normalised update turns the few parameters that token reaches into
/// differences of a fraction of the learning rate.
#[test]
fn zero_stages_1_and_2_partition_experts_in_their_groups() {
    let base = train(0, 2);
    for stage in [1, 2] {
        let z = train(stage, 2);
        let diff = max_rel_diff(&base.losses, &z.losses);
        let params = max_abs_diff(&base.final_params, &z.final_params);
        println!("ep 2 stage {stage}: max rel loss diff {diff:.2e}, max param diff {params:.2e}");
        match stage {
            1 => {
                assert_eq!(base.losses, z.losses, "stage 1's losses");
                assert_eq!(params, 0.0, "stage 1's parameters");
            }
            _ => {
                assert!(diff <= 1e-5, "stage {stage}: losses differ by {diff}");
                assert!(
                    params <= 1e-3,
                    "stage {stage}: parameters differ by {params}"
                );
            }
        }
        assert!(
            z.model_state_bytes_per_rank < base.model_state_bytes_per_rank,
            "stage {stage} holds less optimizer state"
        );
    }
}

/// Without gradient accumulation (one micro-batch per step) stage 2 sums each gradient in
/// stage 1's order, so ZeRO stage 2 on top of ep 2 changes nothing: the losses and the
/// parameters are stage 0's bit for bit over 8 steps, with the model state partitioned.
#[test]
fn zero_stage_2_without_accumulation_is_stage_0_exactly() {
    let run = |stage: u8| {
        let mut spec = common::spec(config_micro(stage, 4), SHAPE, 8, 3, 7);
        spec.ep_size = 2;
        common::train(4, &spec)
    };
    let (base, z2) = (run(0), run(2));
    println!(
        "ep 2, one micro-batch: stage 2 losses {:?}, max param diff {:.2e}",
        z2.losses,
        max_abs_diff(&base.final_params, &z2.final_params)
    );
    assert_eq!(base.losses, z2.losses, "stage 2's losses");
    assert_eq!(base.final_params, z2.final_params, "stage 2's parameters");
    assert!(z2.model_state_bytes_per_rank < base.model_state_bytes_per_rank);
}

/// An `ep_size` that does not divide the ranks, stage 3 with experts, and an engine that
/// does not know the experts (built with `DeepSpeedEngine::new`) are refused by key.
#[test]
fn what_expert_parallelism_cannot_run_is_refused_by_key() {
    let refused = |spec: &RunSpec| {
        launch(4, Duration::from_secs(60), |comm| run_rank(spec, comm))
            .expect_err("refused")
            .to_string()
    };
    let err = refused(&spec(0, 3));
    assert!(
        err.contains("moe.ep_size") && err.contains("divide"),
        "{err}"
    );
    let err = refused(&spec(3, 2));
    assert!(err.contains("zero_optimization.stage"), "{err}");

    let err = launch(2, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        let grid = Grid::data_parallel(comm.clone())?.with_expert_parallel(2, &device)?;
        let model =
            Gpt::new(GptShape::TINY_MOE, 1, &device).with_experts(grid.expert_parallel(), 1)?;
        DeepSpeedEngine::new(model, config(0), comm).map(|_| ())
    })
    .expect_err("the plain engine refuses experts")
    .to_string();
    assert!(
        err.contains("moe.ep_size") && err.contains("with_grid"),
        "{err}"
    );
}

/// Mixed precision with expert parallelism: bf16 and fp16 (with dynamic loss scaling) at
/// ep 2 follow ep 1 in the same precision, each side keeping fp32 masters.
#[test]
fn mixed_precision_expert_parallel_runs_follow_ep_1() {
    for section in [
        r#""bf16": {"enabled": true}"#,
        r#""fp16": {"enabled": true, "initial_scale_power": 12}"#,
    ] {
        let text = format!(
            r#"{{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": 1.0, {section},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
                "zero_optimization": {{"stage": 1}}}}"#
        );
        let config = DeepSpeedConfig::from_json_str(&text).expect("valid").0;
        let run = |ep: usize| {
            let mut spec = common::spec(config.clone(), SHAPE, 6, 3, 7);
            spec.ep_size = ep;
            common::train(4, &spec)
        };
        let (whole, cut) = (run(1), run(2));
        let diff = max_rel_diff(&whole.losses, &cut.losses);
        println!("{section}: ep 2 vs ep 1 max rel loss diff {diff:.2e}");
        assert!(
            diff <= 5e-4,
            "{section}: {:?} vs {:?}",
            cut.losses,
            whole.losses
        );
        assert!(cut.dtype != "fp32");
    }
}

/// Checkpoints hold the whole model, every expert with its optimizer state, in the order of
/// the model that holds every expert. Saved at ep 2 (ZeRO stage 1) after 6 steps, training
/// continues at ep 4, at ep 1 (the plain regime, no experts cut) and at ep 2 with stage 2 on
/// the uninterrupted run's losses and parameters; the files consolidate into the whole model.
/// Saved at stage 0 (the flat state of fp32 masters) it continues at ep 4, and an fp32
/// stage-0 run at ep 1 (Burn's optimizer record) refuses it with the reason.
#[test]
fn checkpoints_hold_every_expert_and_reload_at_another_ep_size() {
    const SAVED_AT: u64 = 6;
    const STEPS: u64 = 12;
    let short = |stage: u8, ep: usize, steps: u64| {
        let mut spec = common::spec(config(stage), SHAPE, steps, 3, 7);
        spec.ep_size = ep;
        spec
    };
    for (stage, resumes) in [
        (1u8, vec![(1u8, 4usize), (1, 1), (2, 2)]),
        (0, vec![(0, 4)]),
    ] {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let uninterrupted = common::train(4, &short(stage, 2, STEPS));
        let mut first = short(stage, 2, SAVED_AT);
        first.save_dir = Some(dir.path().to_path_buf());
        let saved = common::train(4, &first);
        assert_eq!(saved.losses, uninterrupted.losses[..SAVED_AT as usize]);
        let whole = consolidate(dir.path(), None, &dir.path().join("whole.safetensors"))
            .expect("consolidates");
        assert_eq!(
            whole.values, saved.params,
            "every expert of the whole model"
        );
        assert_eq!(whole.values, saved.final_params.0.len());
        for (at_stage, ep) in resumes {
            let mut resumed = short(at_stage, ep, STEPS);
            resumed.resume_from = Some(dir.path().to_path_buf());
            let run = common::train(4, &resumed);
            assert_eq!(run.first_step, SAVED_AT);
            let want = &uninterrupted.losses[SAVED_AT as usize..];
            let diff = max_rel_diff(want, &run.losses);
            let params = max_abs_diff(&uninterrupted.final_params, &run.final_params);
            println!(
                "saved at ep 2 stage {stage}, resumed at ep {ep} stage {at_stage}: max rel \
                 loss diff {diff:.2e}, max param diff {params:.2e}"
            );
            assert!(
                diff <= 1e-4,
                "ep {ep} stage {at_stage}: losses differ by {diff}"
            );
            assert!(
                params <= 1e-3,
                "ep {ep} stage {at_stage}: params differ by {params}"
            );
        }
        if stage == 0 {
            let mut plain = short(0, 1, STEPS);
            plain.resume_from = Some(dir.path().to_path_buf());
            let err = launch(4, Duration::from_secs(60), |comm| run_rank(&plain, comm))
                .expect_err("Burn's optimizer cannot read flat state")
                .to_string();
            assert!(err.contains("expert parallelism (ep_size 2)"), "{err}");
        }
    }
}

/// PR-MoE (a residual MLP beside the experts, 2 experts in the first MoE block and 4 in the
/// last: the pyramid) at ep 2 follows ep 1: the same losses and, through the whole-model
/// layout that checkpoints use, the same parameters.
#[test]
fn a_pr_moe_pyramid_splits_over_expert_parallel_ranks() {
    let run = |ep: usize| {
        let mut spec = common::spec(config(1), GptShape::TINY_PR_MOE, 6, 3, 7);
        spec.ep_size = ep;
        common::train(2, &spec)
    };
    let (whole, cut) = (run(1), run(2));
    let dense = run_params(GptShape::TINY);
    // Two MoE blocks replace two dense MLPs (4d² + 4d + 4d² + d each) with 2 + 4 experts and
    // a residual MLP of that size, plus their gates (d·E) and coefficients (2d + 2).
    let (d, mlp) = (128usize, 8 * 128 * 128 + 5 * 128);
    let want = dense - 2 * mlp + (2 + 4 + 2) * mlp + d * (2 + 4) + 2 * (2 * d + 2);
    assert_eq!(whole.params, want, "the pyramid's experts");
    assert_eq!(cut.params, whole.params);
    let diff = max_rel_diff(&whole.losses, &cut.losses);
    let params = max_abs_diff(&whole.final_params, &cut.final_params);
    println!("tiny-pr-moe ep 2 vs ep 1: max rel loss diff {diff:.2e}, max param diff {params:.2e}");
    assert!(diff <= 1e-4, "losses differ by {diff}");
    assert!(params <= 1e-4, "parameters differ by {params}");
}

fn run_params(shape: GptShape) -> usize {
    burn::module::Module::num_params(&Gpt::new(shape, 1, &Device::flex()))
}
