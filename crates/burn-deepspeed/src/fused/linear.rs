//! [`linear`]: `x · w + b`, whose product on Flex runs through the system's OpenBLAS when the
//! `blas` feature is on (a hand-written backward of two more products), and is Burn's own
//! [`linear`](burn::tensor::module::linear) otherwise.
//!
//! Flex multiplies with the `gemm` crate; on the GPT's shapes OpenBLAS's AVX-512 kernels ran
//! 1.4-1.7x its speed on the machine the benchmarks use (BENCHMARKS.md, "CPU compute").

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// Backends that run [`linear`]'s product.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FusedMatmulOps: Backend {
    /// `a · b` for `a` `[m, k]` and `b` `[k, n]`.
    fn fused_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Whether [`linear`] multiplies through OpenBLAS (with the `blas` feature; on by default).
static BLAS: AtomicBool = AtomicBool::new(true);

/// Turns [`linear`]'s OpenBLAS products on (the default with the `blas` feature) or off (Flex's
/// own `gemm`, as without the feature), for comparing the two in one process.
pub fn set_blas(on: bool) {
    BLAS.store(on, Ordering::Relaxed);
}

/// Whether [`linear`] multiplies through OpenBLAS now: built with the `blas` feature and not
/// turned off by [`set_blas`].
pub fn blas_enabled() -> bool {
    cfg!(feature = "blas") && BLAS.load(Ordering::Relaxed)
}

impl FusedMatmulOps for Flex {
    fn fused_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "blas")]
        if blas_enabled()
            && let Some(c) = blas::matmul(&a, &b)
        {
            return c;
        }
        Flex::float_matmul(a, b)
    }
}

#[cfg(feature = "blas")]
mod blas {
    use burn::backend::DType;
    use burn::backend::flex::FlexTensor;
    use burn::tensor::TensorData;
    use burn_deepspeed_cubecl_kernels::blas::{MatrixView, sgemm};

    /// A 2-D f32 Flex tensor as BLAS reads it, when it can.
    fn view(t: &FlexTensor) -> Option<MatrixView<'_>> {
        let layout = t.layout();
        let shape = layout.shape();
        if t.dtype() != DType::F32 || shape.num_dims() != 2 {
            return None;
        }
        let [rs, cs] = [layout.strides()[0], layout.strides()[1]].map(|s| usize::try_from(s).ok());
        Some(MatrixView {
            values: t.storage::<f32>(),
            offset: layout.start_offset(),
            shape: shape.dims(),
            steps: [rs?, cs?],
        })
    }

    /// `a · b` through OpenBLAS; `None` when a layout is one BLAS cannot read.
    pub(super) fn matmul(a: &FlexTensor, b: &FlexTensor) -> Option<FlexTensor> {
        let (va, vb) = (view(a)?, view(b)?);
        let out = sgemm(va, vb).ok()?;
        let shape = [va.shape[0], vb.shape[1]];
        Some(FlexTensor::from_data(TensorData::new(out, shape)))
    }
}

#[cfg(feature = "cube")]
impl FusedMatmulOps for burn::backend::Cube {
    fn fused_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        burn::backend::Cube::float_matmul(a, b)
    }
}

/// The backward of `c = a · b`: `da = dc · bᵀ`, `db = aᵀ · dc`, each one more product.
#[derive(Debug)]
struct MatmulBackward;

impl<B: FusedMatmulOps> Backward<B, 2> for MatmulBackward {
    /// The nodes of `a` and `b`, retrieved through the checkpointer (a ZeRO-3 weight is
    /// gathered again rather than kept whole).
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (a, b) = ops.state;
        let dc = grads.consume::<B>(&ops.node);
        let [pa, pb] = ops.parents;
        if let Some(node) = pa {
            let b = checkpointer.retrieve_node_output::<FloatTensor<B>>(b);
            grads.register::<B>(node.id, B::fused_matmul(dc.clone(), B::float_transpose(b)));
        }
        if let Some(node) = pb {
            let a = checkpointer.retrieve_node_output::<FloatTensor<B>>(a);
            grads.register::<B>(node.id, B::fused_matmul(B::float_transpose(a), dc));
        }
    }
}

impl<B: FusedMatmulOps, C: CheckpointStrategy> FusedMatmulOps for Autodiff<B, C> {
    fn fused_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        match MatmulBackward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&a), prep.checkpoint(&b));
                prep.finish(
                    state,
                    B::fused_matmul(a.into_primitive(), b.into_primitive()),
                )
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::fused_matmul(a.into_primitive(), b.into_primitive()))
            }
        }
    }
}

/// `x · w + b` over `x`'s last dimension (`w` `[d_in, d_out]`, as Burn's `Linear` holds it).
/// With the `blas` feature and under autodiff the product is
/// [`FusedMatmulOps::fused_matmul`] (OpenBLAS on Flex); otherwise Burn's
/// [`linear`](burn::tensor::module::linear), unchanged.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<D> {
    // As the other fused ops: only under autodiff (training), where every backend the op
    // knows is below (a capture device for the flops profiler is not).
    if !blas_enabled() || D < 2 || !x.is_autodiff() {
        return burn::tensor::module::linear(x, w, b);
    }
    let dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims.iter().product::<usize>() / d_in.max(1);
    let d_out = w.dims()[1];
    let product = Tensor::<2>::from_dispatch(<Dispatch as FusedMatmulOps>::fused_matmul(
        x.reshape([rows, d_in]).into_dispatch(),
        w.into_dispatch(),
    ));
    let mut out_dims = dims;
    out_dims[D - 1] = d_out;
    let y: Tensor<D> = product.reshape(out_dims);
    match b {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tolerance};

    use super::*;

    /// Values and the gradients of x, w and b equal Burn's `linear` under autodiff, for a 3-D
    /// input and a transposed (strided) weight.
    #[test]
    fn matches_burns_linear_and_its_gradients() {
        let device = Device::flex().autodiff();
        let x = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<2>::random([3, 7], Distribution::Normal(0.0, 1.0), &device);
        let b = Tensor::<1>::random([3], Distribution::Normal(0.0, 1.0), &device);
        let g = Tensor::<3>::random([2, 5, 3], Distribution::Default, &device);
        let run = |ours: bool| {
            let x = x.clone().detach().require_grad();
            let w = w.clone().detach().require_grad();
            let b = b.clone().detach().require_grad();
            // A transposed view: strided, as a tied or sliced weight may be.
            let wt = w.clone().transpose();
            let y = match ours {
                true => linear(x.clone(), wt, Some(b.clone())),
                false => burn::tensor::module::linear(x.clone(), wt, Some(b.clone())),
            };
            let grads = (y.clone() * g.clone()).sum().backward();
            let data = |t: Option<Tensor<3>>| t.expect("a gradient").into_data();
            let gr = [
                data(x.grad(&grads)),
                data(w.grad(&grads).map(|t| t.unsqueeze())),
                data(b.grad(&grads).map(|t| t.unsqueeze())),
            ];
            (y.inner().into_data(), gr)
        };
        let (y, gr) = run(true);
        let (y_ref, gr_ref) = run(false);
        let tol = Tolerance::absolute(1e-5);
        y.assert_approx_eq::<f32>(&y_ref, tol);
        for (a, b) in gr.iter().zip(&gr_ref) {
            a.assert_approx_eq::<f32>(b, tol);
        }
    }
}
