//! The stage-3 gather as a Burn backend extension op with a hand-written backward.
//!
//! `zero3_gather(shard, key)` returns the whole parameter from this rank's chunk. Under
//! autodiff it is a *memory-bound* op with a retro-forward: on a device with gradient
//! checkpointing (`Device::autodiff().gradient_checkpointing()`, which the engine uses at
//! stage 3) the consumer of the whole weight (a linear, a matmul, an embedding) does not keep
//! it for its backward; the weight is gathered again when that backward runs, so a gathered
//! weight lives only while it is used. Its backward reduce-scatters the whole gradient into
//! the chunk. Without gradient checkpointing Burn keeps the consumer's inputs, so the
//! gathered weights stay alive until the backward (still correct, but no saving during the
//! step).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Shape, Tensor, TensorData, read_sync};

use super::group::Phase;
use super::registry::{Resolved, resolve};
use crate::transfer;

/// Backends that run the ZeRO stage-3 gather.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait Zero3Ops: Backend {
    /// The whole parameter of `key` from this rank's `shard` (a collective).
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self>;
}

fn to_vec<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    let data = read_sync(B::float_into_data(t)).expect("reading a parameter shard");
    transfer::count_primitive::<B>(data.bytes().len());
    data.convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data")
}

fn from_data<B: Backend>(data: TensorData, device: &B::Device) -> FloatTensor<B> {
    transfer::count_primitive::<B>(data.bytes().len());
    B::float_from_data(data, device)
}

/// How a backend's primitives reach the group: on the host (the tensor's values read and the
/// result written back, which stages the group's host collectives), or, for a Cube device
/// whose group gathers on the device, through its device collectives on the buffers
/// themselves.
pub trait ShardIo: Backend {
    /// The whole parameter of `key` from this rank's `shard` (returned as is when the group
    /// is whole again).
    fn gather_shard(shard: FloatTensor<Self>, key: u64, phase: Phase) -> FloatTensor<Self>;
    /// The chunk of `key` (shaped `chunk_shape`) of the sum over ranks of the whole gradient
    /// `grad`.
    fn reduce_scatter_grad(
        grad: FloatTensor<Self>,
        key: u64,
        chunk_shape: Shape,
    ) -> FloatTensor<Self>;
}

/// The gather through host memory: its copies stage the group's host collective.
fn gather_on_host<B: Backend>(shard: FloatTensor<B>, key: u64, phase: Phase) -> FloatTensor<B> {
    match resolve(key) {
        Resolved::Whole => shard,
        Resolved::Group(group, t) => transfer::staging(|| {
            let device = shard.device();
            let dtype = shard.dtype();
            let values = group.gather(t, to_vec::<B>(shard), phase);
            let data = TensorData::new(values, Shape::from(group.shape(t).to_vec()));
            from_data::<B>(data.convert_dtype(dtype), &device)
        }),
    }
}

/// The backward of the gather through host memory: the whole gradient reduce-scattered into
/// the chunk's shape.
fn reduce_scatter_on_host<B: Backend>(
    grad: FloatTensor<B>,
    key: u64,
    chunk_shape: Shape,
) -> FloatTensor<B> {
    match resolve(key) {
        Resolved::Whole => grad,
        Resolved::Group(group, t) => transfer::staging(|| {
            let device = grad.device();
            let dtype = grad.dtype();
            let chunk = group.reduce_scatter(t, to_vec::<B>(grad));
            let data = TensorData::new(chunk, chunk_shape);
            from_data::<B>(data.convert_dtype(dtype), &device)
        }),
    }
}

impl ShardIo for Flex {
    fn gather_shard(shard: FloatTensor<Self>, key: u64, phase: Phase) -> FloatTensor<Self> {
        gather_on_host::<Self>(shard, key, phase)
    }

    fn reduce_scatter_grad(
        grad: FloatTensor<Self>,
        key: u64,
        chunk_shape: Shape,
    ) -> FloatTensor<Self> {
        reduce_scatter_on_host::<Self>(grad, key, chunk_shape)
    }
}

#[cfg(feature = "cube")]
mod cube {
    use burn::backend::Cube;

    use super::*;
    use crate::primitive::FlatPrimitive;

    impl ShardIo for Cube {
        fn gather_shard(shard: FloatTensor<Self>, key: u64, phase: Phase) -> FloatTensor<Self> {
            match resolve(key) {
                Resolved::Group(group, t) if group.device_collectives().is_some() => {
                    let whole = group.gather(t, Cube::into_flat(shard), phase);
                    Cube::from_flat(whole, Shape::from(group.shape(t).to_vec()))
                }
                _ => gather_on_host::<Self>(shard, key, phase),
            }
        }

        fn reduce_scatter_grad(
            grad: FloatTensor<Self>,
            key: u64,
            chunk_shape: Shape,
        ) -> FloatTensor<Self> {
            match resolve(key) {
                Resolved::Group(group, t) if group.device_collectives().is_some() => {
                    let chunk = group.reduce_scatter(t, Cube::into_flat(grad));
                    Cube::from_flat(chunk, chunk_shape)
                }
                _ => reduce_scatter_on_host::<Self>(grad, key, chunk_shape),
            }
        }
    }
}

impl Zero3Ops for Flex {
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self> {
        Self::gather_shard(shard, key, Phase::Forward)
    }
}

#[cfg(feature = "cube")]
impl Zero3Ops for burn::backend::Cube {
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self> {
        Self::gather_shard(shard, key, Phase::Forward)
    }
}

#[derive(Debug)]
struct GatherBackward;

impl<B: ShardIo> Backward<B, 1> for GatherBackward {
    /// The key and the chunk's shape.
    type State = (u64, Shape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (key, chunk_shape) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::reduce_scatter_grad(g, key, chunk_shape)
        });
    }
}

/// Re-gathers the weight when a backward step asks for it.
#[derive(Debug)]
struct GatherRetro<B> {
    shard: NodeId,
    key: u64,
    _backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: ShardIo> RetroForward for GatherRetro<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard: FloatTensor<B> = states.get_state(&self.shard);
        states.save(out_node, B::gather_shard(shard, self.key, Phase::Backward));
    }
}

impl<B: ShardIo, C: CheckpointStrategy> Zero3Ops for Autodiff<B, C> {
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self> {
        let chunk_shape = shard.shape();
        let retro = GatherRetro::<B> {
            shard: shard.id(),
            key,
            _backend: std::marker::PhantomData,
        };
        match GatherBackward
            .prepare::<C>([shard.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&shard])
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let whole = B::gather_shard(shard.primitive().clone(), key, Phase::Forward);
                prep.finish((key, chunk_shape), whole)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::gather_shard(shard.into_primitive(), key, Phase::Forward))
            }
        }
    }
}

/// The whole parameter of `key` from this rank's chunk `shard` (see the module docs).
pub fn zero3_gather<const D: usize>(shard: Tensor<D>, key: u64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as Zero3Ops>::zero3_gather(
        shard.into_dispatch(),
        key,
    ))
}
