//! Mixed precision on the GPT example: its working copy in f16 or bf16 runs forward and
//! backward on Flex (no op mixes dtypes) with the f32 loss to the dtype's precision; the
//! engine trains in bf16, and in fp16 with dynamic loss scaling, with fp32 masters at ZeRO
//! stages 1 and 2, following the fp32 run; an fp16 overflow on one rank skips that step on
//! every rank and moves the scale exactly as DeepSpeed's scaler does; 16-bit checkpoints
//! resume exactly and load into fp32 runs and back.

use crate::common;

use std::time::Duration;

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType};
use burn::train::TrainStep;
use burn_deepspeed::flat::{ParamLayout, for_each_grad};
use burn_deepspeed::launch::launch;
use burn_deepspeed::precision::{DynamicLossScaler, cast_module};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_tests::{Toy, toy_batch};

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

#[test]
fn the_gpt_trains_forward_and_backward_in_16_bit_dtypes() {
    let device = Device::flex().autodiff();
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7);
    let batch = || corpus.batch(0, 0, 4, SHAPE.seq_len, &Device::flex());
    let model = Gpt::new(SHAPE, 5, &device);
    let layout = ParamLayout::of(&model);
    let loss32 = TrainStep::step(&model, batch())
        .item
        .loss
        .into_scalar::<f32>();
    for (dtype, tolerance) in [(FloatDType::F16, 2e-3), (FloatDType::BF16, 1e-2)] {
        let working = cast_module(model.clone(), dtype);
        let cast = ParamLayout::of(&working);
        let same_ids = cast
            .slots
            .iter()
            .zip(&layout.slots)
            .all(|(a, b)| a.id == b.id && a.shape == b.shape);
        assert!(
            same_ids,
            "{dtype:?}: the parameters keep their ids and shapes"
        );
        let mut dtypes = Vec::new();
        working.visit(&mut DTypes(&mut dtypes));
        assert!(
            dtypes.iter().all(|d| *d == DType::from(dtype)),
            "{dtype:?}: {dtypes:?}"
        );
        let out = TrainStep::step(&working, batch());
        let loss = out.item.loss.into_scalar::<f32>();
        let rel = ((loss - loss32) / loss32).abs();
        println!("{dtype:?}: loss {loss} vs f32 {loss32} (rel {rel:.2e})");
        assert!(rel <= tolerance, "{dtype:?}: {loss} vs {loss32}");
        let mut seen = 0;
        let mut finite = true;
        for_each_grad(&working, &cast, &out.grads, &mut None, |_, g| {
            if let Some(g) = g {
                seen += 1;
                finite &= g.iter().all(|x| x.is_finite());
            }
        });
        assert_eq!(
            seen,
            layout.slots.len(),
            "{dtype:?}: every parameter has a gradient"
        );
        assert!(finite, "{dtype:?}: finite gradients");
    }
}

/// Collects the dtype of every float parameter.
struct DTypes<'a>(&'a mut Vec<DType>);

impl burn::module::ModuleVisitor for DTypes<'_> {
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<D>>,
    ) {
        self.0.push(param.val().dtype());
    }
}

/// The GPT runs' config at `stage` in `precision` (`fp32`, `fp16` or `bf16`). Stage 3 keeps no
/// tensor whole, so that every parameter is gathered.
fn config(stage: u8, precision: &str) -> DeepSpeedConfig {
    let (fp16, bf16) = (precision == "fp16", precision == "bf16");
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_clipping": 1.0,
            "fp16": {{"enabled": {fp16}}}, "bf16": {{"enabled": {bf16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000,
                                   "allgather_bucket_size": 5000,
                                   "stage3_param_persistence_threshold": 0}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn mean_tail(losses: &[f64]) -> f64 {
    let tail = &losses[losses.len() - 20..];
    tail.iter().sum::<f64>() / tail.len() as f64
}

/// `precision` with fp32 masters at ZeRO stages 0-3 on 2 ranks: the final mean loss (last 20
/// of 120 steps) within 2% of fp32's, and the stages within 1e-4 of each other.
fn follows_fp32_at_every_stage(precision: &str) {
    const STEPS: u64 = 120;
    let fp32 = common::train(2, &common::spec(config(1, "fp32"), SHAPE, STEPS, 5, 9));
    let base = mean_tail(&fp32.losses);
    let mut by_stage = Vec::new();
    for stage in [0, 1, 2, 3] {
        let run = common::train(
            2,
            &common::spec(config(stage, precision), SHAPE, STEPS, 5, 9),
        );
        let tail = mean_tail(&run.losses);
        let rel = (tail - base).abs() / base;
        println!(
            "stage {stage}: {precision} mean loss (last 20 of {STEPS}) {tail:.4} vs fp32 \
             {base:.4} (rel {rel:.2e}); first loss {:.4}",
            run.losses[0]
        );
        assert!(rel <= 0.02, "stage {stage}: {tail} vs {base}");
        by_stage.push(tail);
    }
    for (stage, tail) in by_stage.iter().enumerate().skip(1) {
        let across = (by_stage[0] - tail).abs() / by_stage[0];
        println!("{precision} stage 0 vs stage {stage}: rel {across:.2e}");
        assert!(across <= 1e-4, "stage {stage}: {across}");
    }
}

#[test]
fn bf16_with_fp32_masters_follows_fp32_at_every_stage() {
    follows_fp32_at_every_stage("bf16");
}

#[test]
fn fp16_with_dynamic_loss_scaling_follows_fp32_at_every_stage() {
    follows_fp32_at_every_stage("fp16");
}

/// 1-bit Adam (warm-up, then compressed momenta) in fp16 and bf16 steps fp32 masters: the final
/// mean loss within 2% of its fp32 run's. (At lr 3e-3 this small model's compressed stage is
/// unstable: a 1e-4 change of lr moves the fp32 run's final loss by 1.2%.)
#[test]
fn one_bit_adam_in_16_bit_follows_fp32() {
    const STEPS: u64 = 120;
    let config = |precision: &str| {
        let mut c = config(0, precision);
        let text = r#"{"train_batch_size": 16, "optimizer": {"type": "OneBitAdam",
            "params": {"lr": 1e-3, "freeze_step": 40}}}"#;
        let one_bit = DeepSpeedConfig::from_json_str(text).expect("valid").0;
        c.optimizer = one_bit.optimizer;
        c
    };
    let fp32 = common::train(2, &common::spec(config("fp32"), SHAPE, STEPS, 5, 9));
    let base = mean_tail(&fp32.losses);
    let mut rels = Vec::new();
    for precision in ["fp16", "bf16"] {
        let run = common::train(2, &common::spec(config(precision), SHAPE, STEPS, 5, 9));
        let tail = mean_tail(&run.losses);
        let rel = (tail - base).abs() / base;
        println!(
            "1-bit Adam {precision}: mean loss (last 20 of {STEPS}) {tail:.4} vs fp32 {base:.4} \
             (rel {rel:.2e}); {} compressed steps, {} skipped",
            run.compressed_steps, run.skipped_steps
        );
        assert!(run.compressed_steps >= 70, "the compression stage ran");
        rels.push(rel);
    }
    assert!(rels.iter().all(|r| *r <= 0.02), "{rels:?}");
}

/// A bf16 checkpoint holds the fp32 masters: a run resumed from it continues exactly.
#[test]
fn a_bf16_checkpoint_resumes_exactly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7);
    let run = |steps: std::ops::Range<u64>, save_at: Option<u64>, load: bool| {
        let (_, losses) = launch(2, Duration::from_secs(120), |comm| {
            let rank = comm.rank() as u64;
            let device = Device::flex().autodiff();
            let mut engine =
                DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config(2, "bf16"), comm)?;
            if load {
                engine.load_checkpoint(dir.path(), None)?;
            }
            let mut losses = Vec::new();
            for step in steps.clone() {
                let batches =
                    (0..1).map(|_| corpus.batch(step, rank * 8, 8, SHAPE.seq_len, &Device::flex()));
                losses.push(engine.train_batch(batches)?.loss);
                if save_at == Some(step) {
                    engine.save_checkpoint(dir.path(), None)?;
                }
            }
            Ok(losses)
        })
        .expect("training runs");
        losses.into_iter().next().expect("rank 0")
    };
    let whole = run(0..6, Some(2), false);
    let resumed = run(3..6, None, true);
    println!("bf16 losses {whole:?}; resumed from step 3: {resumed:?}");
    assert_eq!(&whole[3..], &resumed[..]);
}

/// DeepSpeed's `fp16.auto_cast` casts inputs for a framework with autocast; Burn has none, so
/// it is refused by name.
#[test]
fn fp16_auto_cast_is_refused_by_name() {
    let device = Device::flex().autodiff();
    let mut auto_cast = config(1, "fp16");
    auto_cast.fp16.auto_cast = true;
    let e = launch(1, Duration::from_secs(60), |comm| {
        DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), auto_cast.clone(), comm).map(|_| ())
    })
    .expect_err("refused")
    .to_string();
    assert!(e.contains("fp16.auto_cast"), "{e}");
}

const ROWS: usize = 4;

/// The Toy runs' config: fp16 at `stage` with the scaler settings in `fp16` (JSON members),
/// from a scale of 2^10 (the Toy's clean gradients times 2^16 come close to f16's maximum).
fn toy_fp16_config(stage: u8, fp16: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": {ROWS},
            "gradient_clipping": 1.0,
            "fp16": {{"enabled": true, "initial_scale_power": 10 {fp16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

/// What one rank saw of an fp16 Toy run, step by step.
#[derive(Debug, Clone, PartialEq)]
struct Fp16Seen {
    overflows: Vec<bool>,
    /// The scale each step's gradients were computed with.
    scales: Vec<f32>,
    /// The parameters after each step.
    params: Vec<Vec<f32>>,
    skipped: u64,
}

/// An input of 3e4 is finite in f16, but the gradient of its loss times the scale is not: the
/// overflow comes from the scale, as it does in real fp16 runs.
const OVERFLOWING_INPUT: f32 = 3e4;

fn toy_fp16_run(config: &DeepSpeedConfig, steps: u64, overflow_at: &[(u64, usize)]) -> Fp16Seen {
    let (_, seen) = launch(2, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let mut engine = DeepSpeedEngine::new(Toy::new(5, &device), config.clone(), comm)?;
        let device = device.inner();
        let gas = engine.batch().gradient_accumulation_steps;
        let mut seen = Fp16Seen {
            overflows: Vec::new(),
            scales: Vec::new(),
            params: Vec::new(),
            skipped: 0,
        };
        for step in 0..steps {
            let poison = |k: u64| {
                (k == 1 && overflow_at.contains(&(step, rank))).then_some(OVERFLOWING_INPUT)
            };
            let batches = (0..gas).map(|k| toy_batch(step, rank, k, ROWS, poison(k), &device));
            let report = engine.train_batch(batches)?;
            seen.overflows.push(report.overflow);
            seen.scales
                .push(report.loss_scale.expect("fp16 reports its scale"));
            seen.params.push(engine.flat_params()?);
        }
        seen.skipped = engine.skipped_steps();
        Ok(seen)
    })
    .expect("training runs");
    assert_eq!(seen[0], seen[1], "both ranks see the same run");
    seen.into_iter().next().expect("rank 0")
}

/// An overflow in one gradient on one rank at step k skips exactly that step on every rank
/// (parameters unchanged), and the scale follows DeepSpeed's `update_scale` (hysteresis 1
/// halves at once, 2 waits for a second overflow; a window of 3 clean steps doubles it).
#[test]
fn an_fp16_overflow_on_one_rank_skips_that_step_everywhere_and_moves_the_scale() {
    let overflow_at = [(2, 1), (5, 0), (6, 1)];
    const STEPS: u64 = 12;
    for stage in [0, 1, 2, 3] {
        for hysteresis in [1, 2] {
            let settings = format!(r#", "loss_scale_window": 3, "hysteresis": {hysteresis}"#);
            let config = toy_fp16_config(stage, &settings);
            let seen = toy_fp16_run(&config, STEPS, &overflow_at);
            let mut reference = DynamicLossScaler::new(&config.fp16).expect("valid section");
            let (mut scales, mut overflows) = (Vec::new(), Vec::new());
            for step in 0..STEPS {
                let overflow = overflow_at.iter().any(|&(s, _)| s == step);
                scales.push(reference.scale());
                overflows.push(overflow);
                reference.update(overflow).expect("above the minimum");
            }
            println!(
                "stage {stage}, hysteresis {hysteresis}: scales {:?}",
                seen.scales
            );
            assert_eq!(
                seen.overflows, overflows,
                "stage {stage}, hysteresis {hysteresis}"
            );
            assert_eq!(
                seen.scales, scales,
                "stage {stage}, hysteresis {hysteresis}"
            );
            assert_eq!(seen.skipped, 3);
            for &(step, _) in &overflow_at {
                let step = step as usize;
                assert_eq!(
                    seen.params[step],
                    seen.params[step - 1],
                    "a skipped step leaves the parameters (and masters) as they were"
                );
            }
            assert_ne!(seen.params[3], seen.params[2], "clean steps move them");
        }
    }
}

/// A TrainStep that calls plain `loss.backward()` under fp16 would train on unscaled f16
/// gradients: the step is refused on every rank, with the fix in the message.
#[test]
fn an_fp16_train_step_without_the_scaled_backward_is_refused() {
    let config = toy_fp16_config(1, "");
    let e = launch(2, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let mut engine = DeepSpeedEngine::new(
            Plain {
                toy: Toy::new(5, &device),
            },
            config.clone(),
            comm,
        )?;
        let device = device.inner();
        let batches = (0..2).map(|k| toy_batch(0, rank, k, ROWS, None, &device));
        engine.train_batch(batches).map(|_| ())
    })
    .expect_err("refused")
    .to_string();
    assert!(e.contains("precision::backward"), "{e}");
}

/// [`Toy`] with a TrainStep that ignores the loss scale.
#[derive(Module, Debug)]
struct Plain {
    toy: Toy,
}

impl TrainStep for Plain {
    type Input = burn_deepspeed_tests::ToyBatch;
    type Output = burn::train::RegressionOutput;

    fn step(&self, batch: Self::Input) -> burn::train::TrainOutput<Self::Output> {
        let output = self.toy.forward(batch.inputs).cast(FloatDType::F32);
        let loss = burn::nn::loss::MseLoss::new().forward(
            output.clone(),
            batch.targets.clone(),
            burn::nn::loss::Reduction::Mean,
        );
        let grads = loss.backward();
        burn::train::TrainOutput::new(
            self,
            grads,
            burn::train::RegressionOutput::new(loss, output, batch.targets),
        )
    }
}

/// An fp16 checkpoint keeps the fp32 masters and the scaler: a run resumed from it goes on
/// exactly (losses and scales). An fp32 checkpoint loads into an fp16 run (which starts a
/// fresh scaler) and an fp16 checkpoint into an fp32 run, parameters intact both ways.
#[test]
fn fp16_checkpoints_resume_exactly_and_cross_to_fp32_and_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Overflows at steps 1 and 2 move the scale, so that a restored scaler is visible.
    let overflow_at = [(1u64, 0usize), (2, 1)];
    let window = r#", "loss_scale_window": 2, "hysteresis": 1"#;
    let fp16 = toy_fp16_config(2, window);
    let mut fp32 = fp16.clone();
    fp32.fp16.enabled = false;
    let run = |config: &DeepSpeedConfig,
               steps: std::ops::Range<u64>,
               save_at: Option<(u64, &str)>,
               load: Option<&str>| {
        let (_, out) = launch(2, Duration::from_secs(60), |comm| {
            let device = Device::flex().autodiff();
            let rank = comm.rank();
            let mut engine = DeepSpeedEngine::new(Toy::new(5, &device), config.clone(), comm)?;
            let loaded = match load {
                Some(tag) => {
                    engine.load_checkpoint(dir.path(), Some(tag))?;
                    Some(engine.flat_params()?)
                }
                None => None,
            };
            let device = device.inner();
            let (mut losses, mut scales) = (Vec::new(), Vec::new());
            for step in steps.clone() {
                let poison = |k: u64| {
                    (k == 0 && overflow_at.contains(&(step, rank))).then_some(OVERFLOWING_INPUT)
                };
                let batches = (0..2).map(|k| toy_batch(step, rank, k, ROWS, poison(k), &device));
                let report = engine.train_batch(batches)?;
                losses.push(report.loss);
                scales.push(report.loss_scale);
                if let Some((at, tag)) = save_at
                    && at == step
                {
                    engine.save_checkpoint(dir.path(), Some(tag))?;
                }
            }
            Ok((losses, scales, loaded, engine.flat_params()?))
        })
        .expect("training runs");
        out.into_iter().next().expect("rank 0")
    };
    let (losses, scales, _, _) = run(&fp16, 0..7, Some((3, "fp16")), None);
    let (resumed, resumed_scales, _, _) = run(&fp16, 4..7, None, Some("fp16"));
    println!("fp16 scales {scales:?}; resumed {resumed_scales:?}");
    assert_eq!(&losses[4..], &resumed[..], "losses go on exactly");
    assert_eq!(
        &scales[4..],
        &resumed_scales[..],
        "the scaler goes on exactly"
    );

    // fp16 -> fp32: the fp32 run starts from the fp16 run's masters, bit for bit.
    let (_, _, _, masters_at_3) = run(&fp16, 0..4, None, None);
    let (_, _, into_fp32, _) = run(&fp32, 4..5, None, Some("fp16"));
    assert_eq!(into_fp32.expect("loaded"), masters_at_3);
    // fp32 -> fp16: the fp16 run holds the fp32 parameters as masters, and a fresh scaler.
    let (_, _, _, fp32_params) = run(&fp32, 0..3, Some((2, "fp32")), None);
    let (_, fresh_scales, into_fp16, _) = run(&fp16, 3..4, None, Some("fp32"));
    assert_eq!(into_fp16.expect("loaded"), fp32_params);
    assert_eq!(fresh_scales, [Some(1024.0)]);
}

/// ZeRO stage 3 gathers the 16-bit chunks as they are: the forward fetches are the same as
/// the fp32 run's, and the parameter fetches send at most half its bytes (measured by the
/// transport). The backward re-gathers no more tensors than fp32's (fewer here: Burn's
/// checkpointer keeps some small tensors that the 16-bit forward casts to f32 rather than
/// gathering them again).
#[test]
fn stage_3_gathers_move_half_the_bytes_in_16_bit() {
    let mut seen = Vec::new();
    for precision in ["fp32", "bf16", "fp16"] {
        let run = common::train(2, &common::spec(config(3, precision), SHAPE, 3, 5, 9));
        let stats = run.gather_stats.expect("stage 3 reports its gathers");
        println!("{precision}: {stats:?}");
        seen.push(stats);
    }
    let fp32 = seen[0];
    assert!(fp32.gather_bytes_sent > 0);
    assert_eq!(seen[1].forward_gathers, fp32.forward_gathers);
    assert!(seen[1].backward_gathers <= fp32.backward_gathers);
    assert!(
        2 * seen[1].gather_bytes_sent <= fp32.gather_bytes_sent,
        "bf16: at most half"
    );
    assert_eq!(seen[2].forward_gathers, fp32.forward_gathers);
    assert!(
        2 * seen[2].gather_bytes_sent <= fp32.gather_bytes_sent,
        "fp16: at most half"
    );
}

/// At stage 0 an fp32 run keeps Burn's optimizer record and a 16-bit run the flat state of its
/// masters: loading one into the other is refused with that reason, on every rank.
#[test]
fn a_stage_0_checkpoint_does_not_cross_precisions() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fp16 = toy_fp16_config(0, "");
    let mut fp32 = fp16.clone();
    fp32.fp16.enabled = false;
    let run = |config: &DeepSpeedConfig, save: bool| {
        launch(2, Duration::from_secs(60), |comm| {
            let device = Device::flex().autodiff();
            let rank = comm.rank();
            let mut engine = DeepSpeedEngine::new(Toy::new(5, &device), config.clone(), comm)?;
            if save {
                let device = device.inner();
                let batches = (0..2).map(|k| toy_batch(0, rank, k, ROWS, None, &device));
                engine.train_batch(batches)?;
                engine.save_checkpoint(dir.path(), None)?;
            } else {
                engine.load_checkpoint(dir.path(), None)?;
            }
            Ok(())
        })
    };
    for (from, into) in [(&fp32, &fp16), (&fp16, &fp32)] {
        run(from, true).expect("saves");
        let e = run(into, false).expect_err("refused").to_string();
        println!("{e}");
        assert!(e.contains("ZeRO stage 0"), "{e}");
    }
}

/// The model states a rank holds in 16-bit (measured where they are allocated) follow their
/// formulas within 5%: fp16 the paper's 2Ψ + 2Ψ + 12Ψ (fp16 gradient buffers), bf16
/// 2Ψ + 4Ψ + 12Ψ (fp32 gradient buffers, as DeepSpeed's bf16 optimizer), cut by stage.
#[test]
fn measured_16_bit_model_states_follow_their_formula() {
    for precision in ["fp16", "bf16"] {
        for stage in [0, 1, 2, 3] {
            let run = common::train(2, &common::spec(config(stage, precision), SHAPE, 2, 5, 9));
            let (measured, formula) = (
                run.model_state_bytes_per_rank as f64,
                run.model_state_bytes_formula as f64,
            );
            let rel = (measured - formula).abs() / formula;
            println!(
                "{precision} stage {stage}: measured {measured} bytes per rank, formula \
                 {formula} (rel {rel:.2e})"
            );
            assert!(
                rel <= 0.05,
                "{precision} stage {stage}: {measured} vs {formula}"
            );
        }
    }
}

/// GPT `tiny` on 4 ranks in fp16: the model states each rank holds (measured where they are
/// allocated) are within 5% of the paper's mixed-precision formulas (arXiv 1910.02054 §5):
/// 2Ψ + 2Ψ + 12Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N, never below (stage 3 pads its chunks),
/// and what `estimate-memory --precision mixed` prints is that formula. Stage 3's gathers
/// (measured by the transport) move at most half of the fp32 run's bytes.
#[test]
fn fp16_model_states_on_gpt_tiny_follow_the_papers_formulas() {
    use burn_deepspeed::memory::estimate::{StatePrecision, estimate_model_states};
    let shape = GptShape::TINY;
    let world = 4u64;
    let mut gathers = Vec::new();
    for (stage, precision) in [
        (0, "fp16"),
        (1, "fp16"),
        (2, "fp16"),
        (3, "fp16"),
        (3, "fp32"),
    ] {
        let run = common::train(
            world as usize,
            &common::spec(config(stage, precision), shape, 1, 5, 9),
        );
        if precision == "fp16" {
            let psi = run.params as u64;
            let formula =
                estimate_model_states(psi, world, stage, StatePrecision::Mixed, 0, 0).total;
            assert_eq!(run.model_state_bytes_formula, formula, "stage {stage}");
            let held = run.model_state_bytes_per_rank;
            let ratio = held as f64 / formula as f64;
            println!(
                "fp16 stage {stage}: measured {held} B per rank, formula {formula} B ({ratio:.4})"
            );
            assert!((1.0..=1.05).contains(&ratio), "stage {stage}: {ratio}");
        }
        if stage == 3 {
            let stats = run.gather_stats.expect("stage 3 reports its gathers");
            println!(
                "{precision} stage 3: {} bytes gathered by rank 0",
                stats.gather_bytes_sent
            );
            gathers.push(stats.gather_bytes_sent);
        }
    }
    assert!(
        gathers[1] > 0 && 2 * gathers[0] <= gathers[1],
        "{gathers:?}"
    );
}
