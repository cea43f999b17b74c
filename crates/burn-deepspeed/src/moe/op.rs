//! The token exchange of expert parallelism as a Burn backend extension with a hand-written
//! backward: `ep_all_to_all` sends chunk `j` of its input to rank `j` of the group, and its
//! backward sends each gradient chunk back where its values came from (DeepSpeed's
//! `_AllToAll`, which is its own backward).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::Tensor;

use crate::primitive::FlatPrimitive;
use crate::tensor_parallel::resolve;

/// Backends that run expert-parallel MoE layers.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait ExpertParallelOps: burn::backend::Backend {
    /// `x`'s equal chunks (along its flat order) exchanged over group `group`.
    fn ep_all_to_all(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self>;
}

/// The exchange of a primitive over group `group`, on its device.
fn exchange<B: FlatPrimitive>(x: FloatTensor<B>, group: u64) -> FloatTensor<B> {
    let shape = x.shape();
    let out = resolve(group).all_to_all(B::into_flat(x));
    B::from_flat(out, shape)
}

macro_rules! plain_ep_ops {
    ($backend:ty) => {
        impl ExpertParallelOps for $backend {
            fn ep_all_to_all(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self> {
                exchange::<Self>(x, group)
            }
        }
    };
}

plain_ep_ops!(Flex);
#[cfg(feature = "cube")]
plain_ep_ops!(burn::backend::Cube);

#[derive(Debug)]
struct AllToAllBackward;

impl<B: FlatPrimitive> Backward<B, 1> for AllToAllBackward {
    /// The group.
    type State = u64;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| exchange::<B>(g, group));
    }
}

impl<B: FlatPrimitive, C: CheckpointStrategy> ExpertParallelOps for Autodiff<B, C> {
    fn ep_all_to_all(x: FloatTensor<Self>, group: u64) -> FloatTensor<Self> {
        match AllToAllBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(group, exchange::<B>(x.into_primitive(), group)),
            OpsKind::UnTracked(prep) => prep.finish(exchange::<B>(x.into_primitive(), group)),
        }
    }
}

/// The exchange on a tensor.
pub(crate) fn ep_all_to_all<const D: usize>(x: Tensor<D>, group: u64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ExpertParallelOps>::ep_all_to_all(
        x.into_dispatch(),
        group,
    ))
}
