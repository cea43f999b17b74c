//! The two autodiff ops behind [`checkpoint`](super::checkpoint): a Burn backend extension
//! with a hand-written backward.
//!
//! `checkpoint_attach(chain, param, key, i)` is the identity on `chain`; it makes parameter
//! `i` of a checkpointed module a parent of the chain, so that the backward pass reaches it.
//! `checkpoint_output(chain, output, key)` returns the `output` that the closure computed
//! without a graph; its backward runs the recompute registered under `key` (the closure again,
//! this time with a graph of its own), hands the input's gradient to the chain and leaves each
//! parameter's gradient for its attach op. The output op is deeper in the graph than every
//! attach op of its checkpoint, so Burn runs its backward first.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor};

use crate::primitive::FlatPrimitive;

/// A gradient passed between the ops and the recompute: flat, on its device (no copy to the
/// host), with its shape.
pub(crate) struct FlatGrad {
    /// The values, flat, on the device (no autodiff).
    pub values: Tensor<1>,
    /// The gradient's shape.
    pub shape: Shape,
}

impl FlatGrad {
    /// `grad` (a gradient: no autodiff) flattened.
    pub fn of<const D: usize>(grad: Tensor<D>) -> Self {
        let shape = grad.shape();
        let n = shape.num_elements();
        Self {
            values: grad.reshape([n]),
            shape,
        }
    }

    fn from_primitive<B: FlatPrimitive>(t: FloatTensor<B>) -> Self {
        let shape = t.shape();
        Self {
            values: B::into_flat(t),
            shape,
        }
    }

    fn into_primitive<B: FlatPrimitive>(self) -> FloatTensor<B> {
        B::from_flat(self.values, self.shape)
    }
}

/// What a recompute hands back: the gradient of the checkpoint's input (`None` when the
/// input is not tracked) and of each parameter, in the module's visiting order (`None` for a
/// frozen parameter or one the closure did not use).
pub(crate) struct Recomputed {
    pub input: Option<FlatGrad>,
    pub params: Vec<Option<FlatGrad>>,
}

/// The closure again, with a graph, given the output's gradient.
pub(crate) type Recompute = Box<dyn FnOnce(FlatGrad) -> Recomputed + Send>;

/// Parameter gradients from the output op's backward, waiting for their attach ops.
type Stash = Arc<Mutex<Vec<Option<FlatGrad>>>>;

struct Pending {
    recompute: Recompute,
    stash: Stash,
}

static PENDING: LazyLock<Mutex<HashMap<u64, Pending>>> = LazyLock::new(Default::default);
static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

fn pending() -> std::sync::MutexGuard<'static, HashMap<u64, Pending>> {
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Registers the recompute of one checkpoint of a module with `params` parameters; the key
/// names it to the ops that follow.
pub(crate) fn register(recompute: Recompute, params: usize) -> u64 {
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    let stash = Arc::new(Mutex::new((0..params).map(|_| None).collect::<Vec<_>>()));
    pending().insert(key, Pending { recompute, stash });
    key
}

fn stash_of(key: u64) -> Stash {
    pending()
        .get(&key)
        .map(|p| p.stash.clone())
        .unwrap_or_default()
}

/// Backends that run activation checkpoints.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait CheckpointOps: Backend {
    /// `chain`, with parameter `index` of checkpoint `key` as a second parent.
    fn checkpoint_attach(
        chain: FloatTensor<Self>,
        param: FloatTensor<Self>,
        key: u64,
        index: u64,
    ) -> FloatTensor<Self>;

    /// `output` (computed without a graph) as the result of checkpoint `key` of `chain`.
    fn checkpoint_output(
        chain: FloatTensor<Self>,
        output: FloatTensor<Self>,
        key: u64,
    ) -> FloatTensor<Self>;
}

/// The arm of a backend without autodiff: there is no backward to recompute for.
macro_rules! plain_checkpoint_ops {
    ($backend:ty) => {
        impl CheckpointOps for $backend {
            fn checkpoint_attach(
                chain: FloatTensor<Self>,
                _: FloatTensor<Self>,
                _: u64,
                _: u64,
            ) -> FloatTensor<Self> {
                chain
            }

            fn checkpoint_output(
                _: FloatTensor<Self>,
                output: FloatTensor<Self>,
                key: u64,
            ) -> FloatTensor<Self> {
                pending().remove(&key);
                output
            }
        }
    };
}

plain_checkpoint_ops!(Flex);
#[cfg(feature = "cube")]
plain_checkpoint_ops!(burn::backend::Cube);

#[derive(Debug)]
struct AttachBackward;

impl<B: FlatPrimitive> Backward<B, 2> for AttachBackward {
    /// The checkpoint's stash and this parameter's index in it.
    type State = (Shared<Stash>, usize);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [chain, param] = ops.parents;
        let (Shared(stash), index) = ops.state;
        if let Some(node) = param {
            let data = stash
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(index)
                .and_then(Option::take);
            if let Some(g) = data {
                grads.register::<B>(node.id, g.into_primitive::<B>());
            }
        }
        if let Some(node) = chain {
            grads.register::<B>(node.id, grad);
        }
    }
}

#[derive(Debug)]
struct OutputBackward;

/// The output op's state: the recompute (taken once) and where parameter gradients go, with
/// the input's shape and dtype (for a zero gradient when the input is not tracked).
#[derive(Clone, Debug)]
struct OutputState {
    recompute: Shared<Arc<Mutex<Option<Recompute>>>>,
    stash: Shared<Stash>,
    shape: Shape,
    dtype: DType,
}

/// Makes a state `Debug` without printing it.
#[derive(Clone)]
struct Shared<T>(T);

impl<T> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("..")
    }
}

impl<B: FlatPrimitive> Backward<B, 1> for OutputBackward {
    type State = OutputState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [chain] = ops.parents;
        let state = ops.state;
        let device = grad.device();
        let recompute = state
            .recompute
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(recompute) = recompute else {
            return;
        };
        let out = recompute(FlatGrad::from_primitive::<B>(grad));
        *state.stash.0.lock().unwrap_or_else(PoisonError::into_inner) = out.params;
        if let Some(node) = chain {
            // The attach ops between the input and this op each consume a gradient.
            let grad_in = match out.input {
                Some(g) => g.into_primitive::<B>(),
                None => B::float_zeros(state.shape, &device, state.dtype.into()),
            };
            grads.register::<B>(node.id, grad_in);
        }
    }
}

impl<B: FlatPrimitive, C: CheckpointStrategy> CheckpointOps for Autodiff<B, C> {
    fn checkpoint_attach(
        chain: FloatTensor<Self>,
        param: FloatTensor<Self>,
        key: u64,
        index: u64,
    ) -> FloatTensor<Self> {
        match AttachBackward
            .prepare::<C>([chain.node(), param.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (Shared(stash_of(key)), index as usize),
                chain.into_primitive(),
            ),
            OpsKind::UnTracked(prep) => prep.finish(chain.into_primitive()),
        }
    }

    fn checkpoint_output(
        chain: FloatTensor<Self>,
        output: FloatTensor<Self>,
        key: u64,
    ) -> FloatTensor<Self> {
        let Some(Pending { recompute, stash }) = pending().remove(&key) else {
            panic!("activation checkpoint {key} was not registered");
        };
        let state = OutputState {
            recompute: Shared(Arc::new(Mutex::new(Some(recompute)))),
            stash: Shared(stash),
            shape: chain.shape(),
            dtype: chain.dtype(),
        };
        match OutputBackward
            .prepare::<C>([chain.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(output.into_primitive()),
        }
    }
}

/// `chain` with parameter `index` of checkpoint `key` attached (see the module docs).
pub(crate) fn attach<const D: usize, const P: usize>(
    chain: Tensor<D>,
    param: Tensor<P>,
    key: u64,
    index: usize,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CheckpointOps>::checkpoint_attach(
        chain.into_dispatch(),
        param.into_dispatch(),
        key,
        index as u64,
    ))
}

/// `output` as the result of checkpoint `key` of `chain` (see the module docs).
pub(crate) fn output<const D: usize, const O: usize>(
    chain: Tensor<D>,
    output: Tensor<O>,
    key: u64,
) -> Tensor<O> {
    Tensor::from_dispatch(<Dispatch as CheckpointOps>::checkpoint_output(
        chain.into_dispatch(),
        output.into_dispatch(),
        key,
    ))
}
