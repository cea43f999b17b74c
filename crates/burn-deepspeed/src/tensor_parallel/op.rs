//! Megatron's conjugate ops as a Burn backend extension with hand-written backward:
//! `tp_copy` (identity forward, all-reduce backward) and `tp_reduce` (all-reduce forward,
//! identity backward), over the tensor-parallel group of a key.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::Tensor;
use burn_deepspeed_strategies::comm::ReduceOp;

use super::group::resolve;
use crate::primitive::FlatPrimitive;

/// Backends that run tensor-parallel layers.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait TensorParallelOps: burn::backend::Backend {
    /// Megatron's `f` over group `group`: `x`; its backward sums the gradient over the group.
    fn tp_copy(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self>;
    /// Megatron's `g` over group `group`: `x` summed over the group; its backward passes the
    /// gradient through.
    fn tp_reduce(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self>;
}

/// The sum of a primitive over group `group`, on its device.
fn all_reduce<B: FlatPrimitive>(x: FloatTensor<B>, group: u64) -> FloatTensor<B> {
    let shape = x.shape();
    let sum = resolve(group).all_reduce(B::into_flat(x), ReduceOp::Sum);
    B::from_flat(sum, shape)
}

macro_rules! plain_tp_ops {
    ($backend:ty) => {
        impl TensorParallelOps for $backend {
            fn tp_copy(x: FloatTensor<Self>, _: u64) -> FloatTensor<Self> {
                x
            }

            fn tp_reduce(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self> {
                all_reduce::<Self>(x, group)
            }
        }
    };
}

plain_tp_ops!(Flex);
#[cfg(feature = "cube")]
plain_tp_ops!(burn::backend::Cube);

#[derive(Debug)]
struct CopyBackward;

impl<B: FlatPrimitive> Backward<B, 1> for CopyBackward {
    /// The group.
    type State = u64;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| all_reduce::<B>(g, group));
    }
}

#[derive(Debug)]
struct ReduceBackward;

impl<B: FlatPrimitive> Backward<B, 1> for ReduceBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |g| g);
    }
}

impl<B: FlatPrimitive, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self> {
        match CopyBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(group, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }

    fn tp_reduce(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self> {
        match ReduceBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), all_reduce::<B>(x.into_primitive(), group)),
            OpsKind::UnTracked(prep) => prep.finish(all_reduce::<B>(x.into_primitive(), group)),
        }
    }
}

/// Megatron's `f` on a tensor.
pub(crate) fn tp_copy<const D: usize>(x: Tensor<D>, group: u64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as TensorParallelOps>::tp_copy(
        x.into_dispatch(),
        group,
    ))
}

/// Megatron's `g` on a tensor.
pub(crate) fn tp_reduce<const D: usize>(x: Tensor<D>, group: u64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as TensorParallelOps>::tp_reduce(
        x.into_dispatch(),
        group,
    ))
}
