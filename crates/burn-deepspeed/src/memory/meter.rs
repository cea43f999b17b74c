//! Model-state accounting, **measured** where the bytes live: the parameters from the tensors
//! the module stores (at ZeRO stage 3 its chunks), the gradient and optimizer buffers from
//! their allocations, Burn's optimizer state from the tensors it holds, and the transient
//! buffers of a step (gradient tensors from backward, reduction buckets, stage 3's gathered
//! copies) when they are allocated. The formulas these figures are checked against live in
//! [`super::estimate`]. Burn's optimizer keeps its state out of reach; its bytes per element
//! are measured on a probe ([`burn_state_bytes_per_elem`]) and counted for the elements that
//! have state.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};
use serde::Serialize;

/// Bytes of model state one rank holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ModelStateBytes {
    /// Parameters, as the module stores them.
    pub params: u64,
    /// Gradient buffers held between steps.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Bytes of state kept in swap files instead of memory (ZeRO-Infinity), not counted in
    /// [`total`](Self::total).
    pub offloaded: u64,
}

impl ModelStateBytes {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// The largest model state (held plus transient) a rank had at once, observed at the points
/// where a step allocates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryMeter {
    peak: u64,
}

impl MemoryMeter {
    /// Records a moment when `held` was held and `transient` more bytes were alive.
    pub fn observe(&mut self, held: ModelStateBytes, transient: u64) {
        self.peak = self.peak.max(held.total() + transient);
    }

    /// The largest total observed.
    pub fn peak(&self) -> u64 {
        self.peak
    }
}

/// Bytes of the float parameters `module` stores (their stored shapes and dtypes: at ZeRO
/// stage 3 the chunks, not the gathered tensors). Reads no values.
pub fn param_bytes<M: Module>(module: &M) -> u64 {
    struct V(u64);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += tensor_bytes(&param.base());
        }
    }
    let mut v = V(0);
    module.visit(&mut v);
    v.0
}

/// Bytes of one tensor's storage: its elements times its dtype's size.
pub fn tensor_bytes<const D: usize>(t: &Tensor<D>) -> u64 {
    (t.shape().num_elements() * t.dtype().size()) as u64
}

/// Bytes of a host buffer's allocation.
pub fn vec_bytes<T>(buffer: &Vec<T>) -> u64 {
    (buffer.capacity() * size_of::<T>()) as u64
}

/// Bytes of state an optimizer like `fresh` (one that has stepped nothing) keeps per f32
/// parameter element, measured on a copy: one step on a probe parameter of
/// [`PROBE_ELEMS`] elements, then the byte lengths of the state tensors in its record. Burn's
/// optimizers keep their state in tensors shaped like the parameter (Adam, AdamW and LAMB: m
/// and v), so the engine multiplies this by the elements that have state instead of
/// serializing the real state, which would copy it twice.
pub fn burn_state_bytes_per_elem(fresh: &ModuleOptimizer) -> f64 {
    // On Flex whatever the model's device: Burn's default device is a GPU whenever one is
    // compiled in, and a build with `cuda` may train on the CPU of a machine without one.
    let device = Device::flex();
    let mut optim = fresh.clone();
    let param = Param::from_tensor(Tensor::<1>::ones([PROBE_ELEMS], &device.clone().autodiff()));
    let mut grads = burn::optim::GradientsParams::new();
    grads.register::<1>(param.id, Tensor::<1>::ones([PROBE_ELEMS], &device));
    let _ = optim.step(1e-3, param, grads);
    let Ok(bytes) = optim.into_bytes() else {
        return 0.0;
    };
    let state: u64 = burn_pack::Reader::from_bytes(bytes)
        .and_then(|r| r.into_tensors())
        .map(|tensors| tensors.iter().map(|t| t.byte_len() as u64).sum())
        .unwrap_or(0);
    state as f64 / PROBE_ELEMS as f64
}

/// Elements of the probe parameter [`burn_state_bytes_per_elem`] steps.
pub const PROBE_ELEMS: usize = 64;

/// Bytes of the gradient tensors `grads` holds for `module`'s parameters.
pub fn grads_bytes<M: Module>(module: &M, grads: &burn::optim::GradientsParams) -> u64 {
    struct V<'a> {
        grads: &'a burn::optim::GradientsParams,
        bytes: u64,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                self.bytes += tensor_bytes(&g);
            }
        }
    }
    let mut v = V { grads, bytes: 0 };
    module.visit(&mut v);
    v.bytes
}
