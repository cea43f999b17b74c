//! Megatron's column- and row-parallel linear layers (arXiv 1909.08053 §3), cut from a
//! whole Burn [`Linear`] so that a user slices a stock layer instead of writing the split.
//!
//! A column-parallel layer keeps a block of the weight's output columns (and of the bias):
//! its output is this rank's block of the features. A row-parallel layer keeps the matching
//! block of the next weight's input rows: its partial products are summed over the group, and
//! the bias, whole on every rank, is added once after the sum. An MLP `column → activation →
//! row` then needs one all-reduce forward and one backward.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::Tensor;

use super::{SliceLayout, TensorParallel};
use crate::fused::linear;
use crate::inference::{QuantizedMatrix, WeightQuantization};
use crate::{DeepSpeedError, Result};

/// This rank's block of `whole` cut under `layout` over `tp` (see [`SliceLayout`]).
///
/// # Errors
/// When a section does not split into equal blocks over the group.
pub(crate) fn cut<const D: usize>(
    whole: Tensor<D>,
    layout: SliceLayout,
    tp: &TensorParallel,
    what: &str,
) -> Result<Tensor<D>> {
    let n = whole.dims()[layout.dim];
    let (size, rank) = (tp.size(), tp.rank());
    if layout.sections == 0 || !n.is_multiple_of(layout.sections * size) {
        return Err(DeepSpeedError::TensorParallel(format!(
            "{what}: {n} features in {} sections do not split into {size} equal slices; \
             choose a tensor_parallel.tp_size that divides each section",
            layout.sections
        )));
    }
    let section = n / layout.sections;
    let block = section / size;
    let pieces = (0..layout.sections)
        .map(|s| {
            whole
                .clone()
                .narrow(layout.dim, s * section + rank * block, block)
        })
        .collect();
    Ok(Tensor::cat(pieces, layout.dim))
}

/// This rank's slice of `whole` as a parameter with the whole's id (the slices of one
/// logical tensor share it on every rank), its layout recorded in the group.
pub(crate) fn sliced<const D: usize>(
    whole: &Param<Tensor<D>>,
    layout: SliceLayout,
    tp: &TensorParallel,
    what: &str,
) -> Result<Param<Tensor<D>>> {
    if tp.size() == 1 {
        // Whole: the parameter itself, still lazy if it was.
        return Ok(whole.clone());
    }
    let value = cut(whole.val(), layout, tp, what)?.detach();
    tp.record(whole.id, layout);
    let mut param = Param::from_tensor(value);
    param.id = whole.id;
    Ok(param)
}

/// The refusal to cut a layer that is a slice already.
pub(crate) fn sliced_already(what: &str) -> DeepSpeedError {
    DeepSpeedError::TensorParallel(format!(
        "the {what} is a slice already; slice the whole one"
    ))
}

/// A linear layer whose output features are cut across the tensor-parallel group.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// This rank's output columns of the weight, `[d_input, d_output / tp]`.
    pub weight: Param<Tensor<2>>,
    /// This rank's block of the bias, `[d_output / tp]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// The group.
    #[module(skip)]
    pub tp: TensorParallel,
    /// The output is this many equal sections stacked (3 for a fused `[q | k | v]`
    /// projection), each cut on its own.
    #[module(skip)]
    pub sections: usize,
    /// For inference: the weight quantized (then `weight` is empty), see
    /// [`quantized`](Self::quantized).
    #[module(skip)]
    pub quantized: Option<QuantizedMatrix>,
}

impl ColumnParallelLinear {
    /// This rank's slice of `whole` (the same layer on every rank). The parameters keep
    /// `whole`'s ids.
    ///
    /// # Errors
    /// When the output features do not split evenly over the group.
    pub fn from_linear(whole: &Linear, tp: TensorParallel) -> Result<Self> {
        Self::from_linear_sections(whole, 1, tp)
    }

    /// [`from_linear`](Self::from_linear) for a layer whose output is `sections` equal parts
    /// stacked, each cut across the group on its own: a fused `[q | k | v]` projection (3
    /// sections) keeps this rank's heads of each of q, k and v.
    ///
    /// # Errors
    /// When a section's features do not split evenly over the group.
    pub fn from_linear_sections(
        whole: &Linear,
        sections: usize,
        tp: TensorParallel,
    ) -> Result<Self> {
        Self::cut_from(&whole.weight, whole.bias.as_ref(), sections, tp)
    }

    /// This (whole) layer cut across `tp`.
    ///
    /// # Errors
    /// When the layer is a slice already, or does not split evenly over the group.
    pub fn slice(&self, tp: TensorParallel) -> Result<Self> {
        if self.tp.size() != 1 {
            return Err(sliced_already("column-parallel layer"));
        }
        Self::cut_from(&self.weight, self.bias.as_ref(), self.sections, tp)
    }

    fn cut_from(
        weight: &Param<Tensor<2>>,
        bias: Option<&Param<Tensor<1>>>,
        sections: usize,
        tp: TensorParallel,
    ) -> Result<Self> {
        let what = "column-parallel output features";
        let layout = |dim| SliceLayout { dim, sections };
        Ok(Self {
            weight: sliced(weight, layout(1), &tp, what)?,
            bias: bias.map(|b| sliced(b, layout(0), &tp, what)).transpose()?,
            tp,
            sections,
            quantized: None,
        })
    }

    /// This layer (whole or a slice) for inference with its weight quantized under `how`:
    /// the codes replace the f32 weight (left empty, `[0, 0]`), the bias stays as it is,
    /// and [`forward`](Self::forward) runs the fused dequantize-matmul.
    ///
    /// # Errors
    /// When no group fits the weight's rows, or the layer is quantized already.
    pub fn quantized(&self, how: &WeightQuantization) -> Result<Self> {
        let (weight, quantized) = quantize_weight(&self.weight, self.quantized.is_some(), how)?;
        Ok(Self {
            weight,
            bias: self.bias.clone(),
            tp: self.tp.clone(),
            sections: self.sections,
            quantized: Some(quantized),
        })
    }

    /// Bytes of the quantized weight (0 when not quantized).
    pub fn quantized_bytes(&self) -> u64 {
        self.quantized.as_ref().map_or(0, QuantizedMatrix::bytes)
    }

    /// This rank's block of `x · W + b` (its features; `x` is whole on every rank).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        match &self.quantized {
            Some(w) => with_bias(w.matmul(self.tp.copy(x)), bias),
            None => linear(self.tp.copy(x), self.weight.val(), bias),
        }
    }
}

/// `y + b` over `y`'s last dimension.
fn with_bias<const D: usize>(y: Tensor<D>, bias: Option<Tensor<1>>) -> Tensor<D> {
    match bias {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

/// `weight` quantized under `how`, refused when its layer is quantized already: the emptied
/// weight (`[0, 0]`) that replaces it, and the codes.
fn quantize_weight(
    weight: &Param<Tensor<2>>,
    already: bool,
    how: &WeightQuantization,
) -> Result<(Param<Tensor<2>>, QuantizedMatrix)> {
    if already {
        return Err(DeepSpeedError::Data(
            "the layer's weight is quantized already".into(),
        ));
    }
    // On a wgpu or CUDA device the codes move there: the layer multiplies by the CubeCL
    // kernel, which dequantizes the weight as it loads it.
    let weight = weight.val();
    let device = weight.device();
    let codes = QuantizedMatrix::quantize(&weight, how)?.on(&device);
    Ok((Param::from_tensor(Tensor::empty([0, 0], &device)), codes))
}

/// A linear layer whose input features are cut across the tensor-parallel group (the
/// output of a [`ColumnParallelLinear`] feeds it directly).
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// This rank's input rows of the weight, `[d_input / tp, d_output]`.
    pub weight: Param<Tensor<2>>,
    /// The whole bias, added after the sum.
    pub bias: Option<Param<Tensor<1>>>,
    /// The group.
    #[module(skip)]
    pub tp: TensorParallel,
    /// For inference: the weight quantized (then `weight` is empty), see
    /// [`quantized`](Self::quantized).
    #[module(skip)]
    pub quantized: Option<QuantizedMatrix>,
}

impl RowParallelLinear {
    /// This rank's slice of `whole` (the same layer on every rank). The parameters keep
    /// `whole`'s ids.
    ///
    /// # Errors
    /// When the input features do not split evenly over the group.
    pub fn from_linear(whole: &Linear, tp: TensorParallel) -> Result<Self> {
        Self::cut_from(&whole.weight, whole.bias.as_ref(), tp)
    }

    /// This (whole) layer cut across `tp`.
    ///
    /// # Errors
    /// When the layer is a slice already, or does not split evenly over the group.
    pub fn slice(&self, tp: TensorParallel) -> Result<Self> {
        if self.tp.size() != 1 {
            return Err(sliced_already("row-parallel layer"));
        }
        Self::cut_from(&self.weight, self.bias.as_ref(), tp)
    }

    fn cut_from(
        weight: &Param<Tensor<2>>,
        bias: Option<&Param<Tensor<1>>>,
        tp: TensorParallel,
    ) -> Result<Self> {
        let layout = SliceLayout {
            dim: 0,
            sections: 1,
        };
        Ok(Self {
            weight: sliced(weight, layout, &tp, "row-parallel input features")?,
            // Whole on every rank: the same parameter.
            bias: bias.cloned(),
            tp,
            quantized: None,
        })
    }

    /// This layer (whole or a slice) for inference with its weight quantized under `how`
    /// (see [`ColumnParallelLinear::quantized`]).
    ///
    /// # Errors
    /// When no group fits the weight's rows, or the layer is quantized already.
    pub fn quantized(&self, how: &WeightQuantization) -> Result<Self> {
        let (weight, quantized) = quantize_weight(&self.weight, self.quantized.is_some(), how)?;
        Ok(Self {
            weight,
            bias: self.bias.clone(),
            tp: self.tp.clone(),
            quantized: Some(quantized),
        })
    }

    /// Bytes of the quantized weight (0 when not quantized).
    pub fn quantized_bytes(&self) -> u64 {
        self.quantized.as_ref().map_or(0, QuantizedMatrix::bytes)
    }

    /// `x · W + b` whole on every rank, from this rank's block of the input features.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let partial = match &self.quantized {
            Some(w) => w.matmul(x),
            None if self.tp.size() == 1 => {
                return linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()));
            }
            None => linear(x, self.weight.val(), None),
        };
        with_bias(self.tp.reduce(partial), self.bias.as_ref().map(|b| b.val()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Distribution};
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::super::test_util::{close, read};
    use super::*;
    use crate::launch::launch;

    /// Two stock `Linear`s cut over 2 and 3 ranks as column then row: the sliced MLP's output
    /// and the gradients of the input and of each slice (biases included) are the whole MLP's.
    #[test]
    fn sliced_stock_linears_match_the_whole_mlp() {
        let device = Device::flex().autodiff();
        let (d, h) = (4, 6);
        let first = LinearConfig::new(d, h).init(&device);
        let second = LinearConfig::new(h, d).init(&device);
        // Each rank builds its input from the values: a tensor shared across the rank
        // threads would share its autodiff graph.
        let x0 = Tensor::<3>::random([2, 3, d], Distribution::Default, &Device::flex()).into_data();
        let mlp = |a: &dyn Fn(Tensor<3>) -> Tensor<3>, b: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let x = Tensor::<3>::from_data(x0.clone(), &device).require_grad();
            let y = b(a(x.clone()).tanh());
            let grads = (y.clone() * y.clone()).sum().backward();
            (read(y), read(x.grad(&grads).expect("x's gradient")), grads)
        };
        let (whole_y, whole_gx, grads) = mlp(&|x| first.forward(x), &|x| second.forward(x));
        let g = |p: &Param<Tensor<2>>| p.grad(&grads).expect("a weight gradient");
        let (ga, gb) = (g(&first.weight), g(&second.weight));
        let gb_bias = read(
            second
                .bias
                .as_ref()
                .expect("a bias")
                .grad(&grads)
                .expect("bias"),
        );
        for world in [2usize, 3] {
            let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
                let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
                let col = ColumnParallelLinear::from_linear(&first, tp.clone()).expect("splits");
                let row = RowParallelLinear::from_linear(&second, tp.clone()).expect("splits");
                let (y, gx, grads) = mlp(&|x| col.forward(x), &|x| row.forward(x));
                if let Some(e) = tp.take_error() {
                    panic!("{e}");
                }
                let w = |p: &Param<Tensor<2>>| read(p.grad(&grads).expect("a slice's gradient"));
                let bias = read(
                    row.bias
                        .as_ref()
                        .expect("a bias")
                        .grad(&grads)
                        .expect("bias"),
                );
                Ok((tp.rank(), y, gx, w(&col.weight), w(&row.weight), bias))
            })
            .expect("the ranks run");
            let cols = h / world;
            for (r, y, gx, gcol, grow, bias) in ranks {
                close(&y, &whole_y, "output");
                close(&gx, &whole_gx, "input gradient");
                let col_slice = ga.clone().slice([0..d, r * cols..(r + 1) * cols]);
                close(&gcol, &read(col_slice), "column slice");
                let row_slice = gb.clone().slice([r * cols..(r + 1) * cols, 0..d]);
                close(&grow, &read(row_slice), "row slice");
                close(&bias, &gb_bias, "row bias");
            }
        }
    }

    /// A fused `[q | k | v]` projection cut over 2 and 3 ranks keeps each rank's block of
    /// every section, and gathering the slices (weight and bias, by their recorded layouts)
    /// gives back the whole layer.
    #[test]
    fn a_sectioned_slice_gathers_back_whole() {
        let device = Device::flex();
        let (d, sections) = (4, 3);
        let whole = LinearConfig::new(d, sections * 6).init(&device);
        let x0 = Tensor::<2>::random([5, d], Distribution::Default, &device).into_data();
        let whole_y = whole.forward(Tensor::<2>::from_data(x0.clone(), &device));
        for world in [2usize, 3] {
            let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
                let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
                let layer =
                    ColumnParallelLinear::from_linear_sections(&whole, sections, tp.clone())
                        .expect("each section splits");
                let y = layer.forward(Tensor::<2>::from_data(x0.clone(), &device));
                let layout = tp.layout(layer.weight.id).expect("the weight's layout");
                let weight = tp.gather(layer.weight.val(), layout)?;
                let bias = layer.bias.as_ref().expect("a bias");
                let bias_layout = tp.layout(bias.id).expect("the bias's layout");
                let bias = tp.gather(bias.val(), bias_layout)?;
                Ok((tp.rank(), read(y), read(weight), read(bias)))
            })
            .expect("the ranks run");
            let block = 6 / world;
            for (r, y, weight, bias) in ranks {
                let mine: Vec<_> = (0..sections)
                    .map(|s| whole_y.clone().narrow(1, s * 6 + r * block, block))
                    .collect();
                close(
                    &y,
                    &read(Tensor::cat(mine, 1)),
                    "this rank's heads of q, k and v",
                );
                close(&weight, &read(whole.weight.val()), "the gathered weight");
                let whole_bias = whole.bias.as_ref().expect("a bias").val();
                close(&bias, &read(whole_bias), "the gathered bias");
            }
        }
    }
}
