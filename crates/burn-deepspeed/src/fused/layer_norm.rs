//! [`layer_norm`]: the backend's fused layer norm, with a hand-written backward under
//! autodiff.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor};

/// Backends that run the fused layer norm (use [`layer_norm`]).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FusedLayerNormOps: Backend {
    /// `(x − mean) / sqrt(var + epsilon) · gamma + beta` over the last dimension.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

impl FusedLayerNormOps for Flex {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        Flex::layer_norm(x, gamma, Some(beta), epsilon)
    }
}

#[cfg(feature = "cube")]
impl FusedLayerNormOps for burn::backend::Cube {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        burn::backend::Cube::layer_norm(x, gamma, Some(beta), epsilon)
    }
}

/// The backward of a layer norm over the last dimension with parents `x`, `gamma` and `beta`. With `x̂ = (x − μ)·r`, `r = 1/sqrt(σ² + ε)` and `h = dy ⊙ γ`:
/// `dx = r · (h − mean(h) − x̂ ⊙ mean(h ⊙ x̂))`, `dγ = Σ_rows dy ⊙ x̂`, `dβ = Σ_rows dy`.
#[derive(Debug)]
struct LayerNormBackward;

impl<B: Backend> Backward<B, 3> for LayerNormBackward {
    /// The input's and gamma's nodes (retrieved through the checkpointer, so that a ZeRO-3
    /// gamma is gathered again rather than kept whole) and epsilon; the mean and variance are
    /// recomputed from the input.
    type State = (NodeId, NodeId, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (x, gamma, epsilon) = ops.state;
        let x = checkpointer.retrieve_node_output(x);
        let gamma = checkpointer.retrieve_node_output(gamma);
        let dy = grads.consume::<B>(&ops.node);
        let [dx, dgamma, dbeta] = layer_norm_backward::<B>(x, gamma, dy, epsilon);
        for (parent, grad) in ops.parents.into_iter().zip([dx, dgamma, dbeta]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The gradients of `x`, `gamma` and `beta` (see [`LayerNormBackward`]), on any backend's
/// primitives.
fn layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    dy: FloatTensor<B>,
    epsilon: f64,
) -> [FloatTensor<B>; 3] {
    let shape = x.shape();
    let d = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / d.max(1);
    let x = B::float_reshape(x, Shape::new([rows, d]));
    let dy = B::float_reshape(dy, Shape::new([rows, d]));
    let mean = B::float_mean_dim(x.clone(), 1);
    let centered = B::float_sub(x, mean);
    let var = B::float_mean_dim(B::float_mul(centered.clone(), centered.clone()), 1);
    let r = B::float_recip(B::float_sqrt(B::float_add_scalar(var, epsilon.into())));
    let xhat = B::float_mul(centered, r.clone());
    let dgamma = B::float_sum_dim(B::float_mul(dy.clone(), xhat.clone()), 0);
    let dbeta = B::float_sum_dim(dy.clone(), 0);
    let h = B::float_mul(dy, B::float_reshape(gamma, Shape::new([1, d])));
    let mean_h = B::float_mean_dim(h.clone(), 1);
    let mean_hx = B::float_mean_dim(B::float_mul(h.clone(), xhat.clone()), 1);
    let inner = B::float_sub(B::float_sub(h, mean_h), B::float_mul(xhat, mean_hx));
    let dx = B::float_mul(inner, r);
    [
        B::float_reshape(dx, shape),
        B::float_reshape(dgamma, Shape::new([d])),
        B::float_reshape(dbeta, Shape::new([d])),
    ]
}

impl<B: Backend, C: CheckpointStrategy> FusedLayerNormOps for Autodiff<B, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        // Compute-bound: the output is not recomputed; the input and gamma are checkpointed
        // as Burn's own ops checkpoint theirs.
        match LayerNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&x), prep.checkpoint(&gamma), epsilon);
                let y = B::layer_norm(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    Some(beta.into_primitive()),
                    epsilon,
                );
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::layer_norm(
                x.into_primitive(),
                gamma.into_primitive(),
                Some(beta.into_primitive()),
                epsilon,
            )),
        }
    }
}

/// A layer norm over the last dimension, `(x − mean) / sqrt(var + epsilon) · gamma + beta`:
/// Burn's [`layer_norm`](burn::tensor::module::layer_norm), except that under autodiff the
/// forward is the backend's fused layer norm and the backward one hand-written step instead
/// of the decomposition's. A 16-bit input is normalised in f32 and rounded back, as Burn's
/// `LayerNorm` does.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    let dtype = x.dtype();
    if matches!(dtype, DType::F16 | DType::BF16) {
        let wide = DType::F32;
        let out = layer_norm(
            x.cast(wide),
            gamma.cast(wide),
            beta.map(|b| b.cast(wide)),
            epsilon,
        );
        return out.cast(dtype);
    }
    if !x.is_autodiff() {
        return burn::tensor::module::layer_norm(x, gamma, beta, epsilon);
    }
    // Without beta, a constant zero bias (no gradient is asked of it).
    let beta = beta.unwrap_or_else(|| gamma.zeros_like());
    Tensor::from_dispatch(<Dispatch as FusedLayerNormOps>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::*;

    /// Values and the gradients of the input, gamma and beta equal Burn's decomposed layer
    /// norm under autodiff, with and without beta.
    #[test]
    fn matches_burns_layer_norm_and_its_gradients() {
        let device = Device::flex().autodiff();
        let x = Tensor::<3>::random([3, 4, 16], Distribution::Normal(0.5, 2.0), &device);
        let gamma = Tensor::<1>::random([16], Distribution::Normal(1.0, 0.3), &device);
        let beta = Tensor::<1>::random([16], Distribution::Normal(0.0, 0.3), &device);
        let w = Tensor::<3>::random([3, 4, 16], Distribution::Default, &device);
        for with_beta in [true, false] {
            let run = |fused: bool| {
                let x = x.clone().detach().require_grad();
                let g = gamma.clone().detach().require_grad();
                let b = beta.clone().detach().require_grad();
                let bias = with_beta.then(|| b.clone());
                let y = match fused {
                    true => layer_norm(x.clone(), g.clone(), bias, 1e-5),
                    false => burn::tensor::module::layer_norm(x.clone(), g.clone(), bias, 1e-5),
                };
                let grads = (y.clone() * w.clone()).sum().backward();
                let db = with_beta.then(|| b.grad(&grads).expect("beta's gradient"));
                (
                    y.inner(),
                    x.grad(&grads).expect("x's gradient"),
                    g.grad(&grads).expect("gamma's gradient"),
                    db,
                )
            };
            let (y, dx, dg, db) = run(true);
            let (y_ref, dx_ref, dg_ref, db_ref) = run(false);
            let tol = Tolerance::absolute(2e-5);
            y.into_data()
                .assert_approx_eq::<f32>(&y_ref.into_data(), tol);
            dx.into_data()
                .assert_approx_eq::<f32>(&dx_ref.into_data(), tol);
            dg.into_data()
                .assert_approx_eq::<f32>(&dg_ref.into_data(), tol);
            if let (Some(db), Some(db_ref)) = (db, db_ref) {
                db.into_data()
                    .assert_approx_eq::<f32>(&db_ref.into_data(), tol);
            }
        }
    }

    /// Without autodiff it is Burn's layer norm, bit for bit; a bf16 input is normalised in
    /// f32 and comes back in bf16.
    #[test]
    fn without_autodiff_it_is_burns_layer_norm() {
        let device = Device::flex();
        let x = Tensor::<2>::random([5, 8], Distribution::Normal(0.0, 1.0), &device);
        let gamma = Tensor::<1>::ones([8], &device);
        let beta = Tensor::<1>::zeros([8], &device);
        let ours = layer_norm(x.clone(), gamma.clone(), Some(beta.clone()), 1e-5);
        let burns =
            burn::tensor::module::layer_norm(x.clone(), gamma.clone(), Some(beta.clone()), 1e-5);
        assert_eq!(ours.into_data(), burns.into_data());
        let half = layer_norm(x.cast(DType::BF16), gamma, Some(beta), 1e-5);
        assert_eq!(half.dtype(), DType::BF16);
    }
}
