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
use burn::tensor::module::linear;

use super::TensorParallel;

/// The block `rank` of `parts` equal blocks of `n`, refusing a split that is not even.
fn block(n: usize, parts: usize, rank: usize, what: &str) -> std::ops::Range<usize> {
    assert!(
        n.is_multiple_of(parts),
        "{what}: {n} does not split into {parts} equal tensor-parallel slices"
    );
    let len = n / parts;
    rank * len..(rank + 1) * len
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
}

impl ColumnParallelLinear {
    /// This rank's slice of `whole` (the same layer on every rank).
    ///
    /// # Panics
    /// When the output features do not split evenly over the group.
    pub fn from_linear(whole: &Linear, tp: TensorParallel) -> Self {
        let w = whole.weight.val();
        let [d_in, d_out] = w.dims();
        let cols = block(
            d_out,
            tp.size(),
            tp.rank(),
            "column-parallel output features",
        );
        let weight = Param::from_tensor(w.slice([0..d_in, cols.clone()]).detach());
        let bias = whole
            .bias
            .as_ref()
            .map(|b| Param::from_tensor(b.val().slice([cols.clone()]).detach()));
        Self { weight, bias, tp }
    }

    /// This rank's block of `x · W + b` (its features; `x` is whole on every rank).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        linear(self.tp.copy(x), self.weight.val(), bias)
    }
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
}

impl RowParallelLinear {
    /// This rank's slice of `whole` (the same layer on every rank).
    ///
    /// # Panics
    /// When the input features do not split evenly over the group.
    pub fn from_linear(whole: &Linear, tp: TensorParallel) -> Self {
        let w = whole.weight.val();
        let [d_in, d_out] = w.dims();
        let rows = block(d_in, tp.size(), tp.rank(), "row-parallel input features");
        let weight = Param::from_tensor(w.slice([rows, 0..d_out]).detach());
        let bias = whole
            .bias
            .as_ref()
            .map(|b| Param::from_tensor(b.val().detach()));
        Self { weight, bias, tp }
    }

    /// `x · W + b` whole on every rank, from this rank's block of the input features.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let partial = linear(x, self.weight.val(), None);
        let sum = self.tp.reduce(partial);
        match &self.bias {
            Some(b) => sum + b.val().unsqueeze(),
            None => sum,
        }
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
                let col = ColumnParallelLinear::from_linear(&first, tp.clone());
                let row = RowParallelLinear::from_linear(&second, tp.clone());
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
}
