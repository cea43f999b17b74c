//! [`softmax`]: the backend's fused softmax, with a hand-written backward under autodiff.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::ops::ActivationOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// Backends that run the fused softmax (use [`softmax`]).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FusedSoftmaxOps: Backend {
    /// `softmax(x)` along `dim`.
    fn fused_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
}

impl FusedSoftmaxOps for Flex {
    fn fused_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        Flex::softmax(x, dim)
    }
}

#[cfg(feature = "cube")]
impl FusedSoftmaxOps for burn::backend::Cube {
    fn fused_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        burn::backend::Cube::softmax(x, dim)
    }
}

/// The backward of `y = softmax(x)` along `dim`: `dx = y ⊙ (dy − Σ_dim dy ⊙ y)`.
#[derive(Debug)]
struct SoftmaxBackward;

impl<B: Backend> Backward<B, 1> for SoftmaxBackward {
    /// The output and the dimension.
    type State = (FloatTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (y, dim) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            softmax_backward::<B>(y, dy, dim)
        });
    }
}

/// `y ⊙ (dy − Σ_dim dy ⊙ y)`, on any backend's primitives.
fn softmax_backward<B: Backend>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    dim: usize,
) -> FloatTensor<B> {
    let weighted = B::float_mul(dy, y.clone());
    let sum = B::float_sum_dim(weighted.clone(), dim);
    B::float_sub(weighted, B::float_mul(y, sum))
}

impl<B: Backend, C: CheckpointStrategy> FusedSoftmaxOps for Autodiff<B, C> {
    fn fused_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        // Compute-bound: the output is kept for the backward (as the decomposition kept its
        // exponentials), never recomputed.
        match SoftmaxBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::softmax(x.into_primitive(), dim);
                prep.finish((y.clone(), dim), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::softmax(x.into_primitive(), dim)),
        }
    }
}

/// `softmax(x)` along `dim`: Burn's [`softmax`](burn::tensor::activation::softmax), except
/// that under autodiff the forward is the backend's fused softmax (one op instead of five)
/// and the backward is one hand-written step, `dx = y ⊙ (dy − Σ dy ⊙ y)`.
pub fn softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    assert!(dim < D, "softmax: dimension {dim} of a rank-{D} tensor");
    if !x.is_autodiff() {
        return burn::tensor::activation::softmax(x, dim);
    }
    Tensor::from_dispatch(<Dispatch as FusedSoftmaxOps>::fused_softmax(
        x.into_dispatch(),
        dim,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::*;

    /// Values and input gradients equal Burn's decomposed softmax under autodiff, along the
    /// last and a middle dimension, with a masked (−inf) entry.
    #[test]
    fn matches_burns_softmax_and_its_gradient() {
        let device = Device::flex().autodiff();
        for dim in [2, 1] {
            let x = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 2.0), &device);
            let x = x.slice_assign(
                [0..1, 0..1, 0..1],
                Tensor::full([1, 1, 1], f32::NEG_INFINITY, &device),
            );
            let w = Tensor::<3>::random([2, 5, 7], Distribution::Default, &device);
            let run = |fused: bool| {
                let x = x.clone().detach().require_grad();
                let y = match fused {
                    true => softmax(x.clone(), dim),
                    false => burn::tensor::activation::softmax(x.clone(), dim),
                };
                let grads = (y.clone() * w.clone()).sum().backward();
                (y.inner(), x.grad(&grads).expect("a gradient"))
            };
            let (y, g) = run(true);
            let (y_ref, g_ref) = run(false);
            y.into_data()
                .assert_approx_eq::<f32>(&y_ref.into_data(), Tolerance::absolute(1e-6));
            g.into_data()
                .assert_approx_eq::<f32>(&g_ref.into_data(), Tolerance::absolute(1e-6));
        }
    }

    /// Without autodiff it is Burn's softmax, bit for bit.
    #[test]
    fn without_autodiff_it_is_burns_softmax() {
        let device = Device::flex();
        let x = Tensor::<2>::random([4, 9], Distribution::Normal(0.0, 1.0), &device);
        let ours = softmax(x.clone(), 1).into_data();
        let burns = burn::tensor::activation::softmax(x, 1).into_data();
        assert_eq!(ours, burns);
    }
}
