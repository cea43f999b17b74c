//! Mixed precision building blocks on the GPT example: its working copy in f16 or bf16 runs
//! forward and backward on Flex (no op mixes dtypes), and gives the f32 loss to the dtype's
//! precision, with a gradient for every parameter.

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType};
use burn::train::TrainStep;
use burn_deepspeed::engine::flat::{ParamLayout, for_each_grad};
use burn_deepspeed::precision::cast_module;
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
