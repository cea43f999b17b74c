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

use super::group::{Phase, Resolved, resolve};
use crate::engine::transfer;

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

/// The gather on a plain backend: `shard` is returned as is when the group is whole again.
/// Its copies stage the group's host collective.
fn gather_primitive<B: Backend>(shard: FloatTensor<B>, key: u64, phase: Phase) -> FloatTensor<B> {
    transfer::staging(|| gather_staged::<B>(shard, key, phase))
}

fn gather_staged<B: Backend>(shard: FloatTensor<B>, key: u64, phase: Phase) -> FloatTensor<B> {
    match resolve(key) {
        Resolved::Whole => shard,
        Resolved::Group(group, t) => {
            let device = shard.device();
            let dtype = shard.dtype();
            let values = group.gather(t, to_vec::<B>(shard), phase);
            let data = TensorData::new(values, Shape::from(group.shape(t).to_vec()));
            from_data::<B>(data.convert_dtype(dtype), &device)
        }
    }
}

/// The backward of the gather: the whole gradient reduce-scattered into the chunk's shape.
fn reduce_scatter_primitive<B: Backend>(
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

impl Zero3Ops for Flex {
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self> {
        gather_primitive::<Flex>(shard, key, Phase::Forward)
    }
}

#[cfg(feature = "cube")]
impl Zero3Ops for burn::backend::Cube {
    fn zero3_gather(shard: FloatTensor<Self>, key: u64) -> FloatTensor<Self> {
        gather_primitive::<Self>(shard, key, Phase::Forward)
    }
}

#[derive(Debug)]
struct GatherBackward;

impl<B: Backend> Backward<B, 1> for GatherBackward {
    /// The key and the chunk's shape.
    type State = (u64, Shape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (key, chunk_shape) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            reduce_scatter_primitive::<B>(g, key, chunk_shape)
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

impl<B: Backend> RetroForward for GatherRetro<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard: FloatTensor<B> = states.get_state(&self.shard);
        states.save(
            out_node,
            gather_primitive::<B>(shard, self.key, Phase::Backward),
        );
    }
}

impl<B: Backend, C: CheckpointStrategy> Zero3Ops for Autodiff<B, C> {
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
                let whole = gather_primitive::<B>(shard.primitive().clone(), key, Phase::Forward);
                prep.finish((key, chunk_shape), whole)
            }
            OpsKind::UnTracked(prep) => prep.finish(gather_primitive::<B>(
                shard.into_primitive(),
                key,
                Phase::Forward,
            )),
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
