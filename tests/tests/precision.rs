//! Mixed precision on the GPT example: its working copy in f16 or bf16 runs forward and
//! backward on Flex (no op mixes dtypes) with the f32 loss to the dtype's precision; the
//! engine trains in bf16 with fp32 masters at ZeRO stages 1 and 2, following the fp32 run,
//! and resumes a bf16 checkpoint exactly.

mod common;

use std::time::Duration;

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType};
use burn::train::TrainStep;
use burn_deepspeed::engine::flat::{ParamLayout, for_each_grad};
use burn_deepspeed::launch::launch;
use burn_deepspeed::precision::cast_module;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
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

fn config(stage: u8, bf16: bool) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_clipping": 1.0, "bf16": {{"enabled": {bf16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000,
                                   "allgather_bucket_size": 5000}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn mean_tail(losses: &[f64]) -> f64 {
    let tail = &losses[losses.len() - 20..];
    tail.iter().sum::<f64>() / tail.len() as f64
}

/// bf16 with fp32 masters at ZeRO stages 1 and 2 on 2 ranks: the final mean loss (last 20
/// of 120 steps) within 2% of fp32's, and the two stages within 1e-4 of each other.
#[test]
fn bf16_with_fp32_masters_follows_fp32_at_stages_1_and_2() {
    const STEPS: u64 = 120;
    let fp32 = common::train(2, &common::spec(config(1, false), SHAPE, STEPS, 5, 9));
    let base = mean_tail(&fp32.losses);
    let mut by_stage = Vec::new();
    for stage in [1, 2] {
        let run = common::train(2, &common::spec(config(stage, true), SHAPE, STEPS, 5, 9));
        let tail = mean_tail(&run.losses);
        let rel = (tail - base).abs() / base;
        println!(
            "stage {stage}: bf16 mean loss (last 20 of {STEPS}) {tail:.4} vs fp32 {base:.4} \
             (rel {rel:.2e}); first loss {:.4}",
            run.losses[0]
        );
        assert!(rel <= 0.02, "stage {stage}: {tail} vs {base}");
        by_stage.push(tail);
    }
    let across = (by_stage[0] - by_stage[1]).abs() / by_stage[0];
    println!("bf16 stage 1 vs stage 2: rel {across:.2e}");
    assert!(across <= 1e-4, "{across}");
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
                DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config(2, true), comm)?;
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

/// What bf16 and fp16 do not run yet is refused by name.
#[test]
fn precision_not_built_yet_is_refused_by_name() {
    let device = Device::flex().autodiff();
    for (stage, key) in [(0, "bf16.enabled"), (3, "bf16.enabled")] {
        let e = launch(1, Duration::from_secs(60), |comm| {
            DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config(stage, true), comm).map(|_| ())
        })
        .expect_err("refused")
        .to_string();
        assert!(e.contains(key), "stage {stage}: {e}");
    }
    let mut fp16 = config(1, false);
    fp16.fp16.enabled = true;
    let e = launch(1, Duration::from_secs(60), |comm| {
        DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), fp16.clone(), comm).map(|_| ())
    })
    .expect_err("refused")
    .to_string();
    assert!(e.contains("fp16.enabled"), "{e}");
}
