//! [`DeviceShards`]: a stage-3 step's gradient as f32 tensors on the model's device: the
//! chunk gradients of this rank's partitioned pieces (reduce-scattered by the gathers'
//! backward on the device), sliced into a buffer by device ops, and the persistent tensors'
//! whole gradients, all-reduced at the boundary through the device collectives.
//!
//! Under fp16/bf16 the chunk gradients are the op's, in the parameter's dtype (DeepSpeed
//! reduce-scatters 16-bit gradients too); [`HostShards`](super::HostShards) keeps the
//! reduce-scatters' f32 sums instead, so the two differ by that rounding.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::place::{DevicePlace, Place};

use super::device_grads::{buffer_bytes, held, own_part, own_squares, widened};
use super::grads::GradStore;
use super::scale::Scaling;
use super::{ModelParallelNorm, ModelPlace, ShardCut};
use crate::flat::ParamLayout;
use crate::zero3::GatherGroup;
use crate::{DeepSpeedError, Result};

/// A rank's stage-3 gradient on the model's device (see the module docs).
pub struct DeviceShards {
    group: Arc<GatherGroup>,
    cut: ShardCut,
    /// Per partitioned tensor with a piece here: its range in the chunk-gradient buffer (the
    /// partitioned pieces back to back).
    chunk_at: Vec<Option<Range<usize>>>,
    chunk_len: usize,
    /// The accumulated chunk gradients and persistent tensors' gradients, from a step's first
    /// micro-batch to its reduction.
    chunks: Option<Tensor<1>>,
    persistent: Option<Tensor<1>>,
    /// The reduced gradient of this rank's pieces (buffer order).
    reduced: Option<Tensor<1>>,
    /// Tensor slicing: the 0/1 mask of what this rank counts in its pieces (`None`: all).
    mask: Option<Tensor<1>>,
    /// The dtype the accumulated gradients are held in (f16 under fp16).
    dtype: DType,
    device: Device,
}

impl DeviceShards {
    /// The gradient of `cut`'s pieces on `place`'s device, reduce-scattered by `group`, held
    /// in `dtype`.
    pub fn new(place: &DevicePlace, group: Arc<GatherGroup>, cut: ShardCut, dtype: DType) -> Self {
        let mut chunk_at = vec![None; cut.local.len()];
        let mut chunk_len = 0;
        for s in &cut.segments {
            if cut.persistent_at[s.tensor].is_none() {
                chunk_at[s.tensor] = Some(chunk_len..chunk_len + s.local.len());
                chunk_len += s.local.len();
            }
        }
        // The op's gradients are read, in the parameter's dtype: the group keeps no sums.
        group.keep_chunk_grads(false);
        Self {
            group,
            cut,
            chunk_at,
            chunk_len,
            chunks: None,
            persistent: None,
            reduced: None,
            mask: None,
            dtype,
            device: place.device().clone(),
        }
    }

    fn zeros(&self, n: usize) -> Tensor<1> {
        Tensor::zeros([n], &self.device)
    }

    /// The tensors joined end to end (an empty tensor for none).
    fn join(&self, parts: Vec<Tensor<1>>) -> Tensor<1> {
        match parts.is_empty() {
            true => self.zeros(0),
            false => Tensor::cat(parts, 0),
        }
    }
}

impl GradStore for DeviceShards {
    type Place = DevicePlace;

    /// Adds each chunk gradient's real elements and the persistent tensors' whole gradients.
    fn accumulate<M: Module>(
        &mut self,
        _place: &DevicePlace,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
        _deferred: &mut Option<DeepSpeedError>,
    ) -> u64 {
        struct V<'a> {
            store: &'a DeviceShards,
            layout: &'a ParamLayout,
            grads: &'a GradientsParams,
            present: &'a mut [u8],
            chunks: Vec<Option<Tensor<1>>>,
            persistent: Vec<Option<Tensor<1>>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.store;
                let Some(t) = self.layout.slot_of(param.id) else {
                    return;
                };
                let Some(g) = self.grads.get::<D>(param.id) else {
                    return;
                };
                self.present[t] = 1;
                let n = g.shape().num_elements();
                let flat = g.cast(DType::F32).reshape([n]);
                if s.cut.persistent_at[t].is_some() {
                    self.persistent[t] = Some(flat);
                } else if let Some(r) = &s.chunk_at[t] {
                    self.chunks[t] = Some(flat.slice(0..r.len()));
                }
            }
        }
        let tensors = layout.slots.len();
        let mut v = V {
            store: self,
            layout,
            grads,
            present,
            chunks: vec![None; tensors],
            persistent: vec![None; tensors],
        };
        model.visit(&mut v);
        let (mut chunks, mut persistent) = (v.chunks, v.persistent);
        let chunk_parts = (0..tensors)
            .filter_map(|t| {
                let r = self.chunk_at[t].as_ref()?;
                Some(chunks[t].take().unwrap_or_else(|| self.zeros(r.len())))
            })
            .collect();
        let chunk_flat = self.join(chunk_parts);
        let persistent_parts = (0..tensors)
            .filter(|&t| self.cut.persistent_at[t].is_some())
            .map(|t| {
                let n = layout.slots[t].numel;
                persistent[t].take().unwrap_or_else(|| self.zeros(n))
            })
            .collect();
        let persistent_flat = self.join(persistent_parts);
        self.chunks = Some(held(self.chunks.take(), chunk_flat, self.dtype));
        self.persistent = Some(held(self.persistent.take(), persistent_flat, self.dtype));
        // Beyond the store: what the gathers allocated at once.
        4 * self.group.stats().peak_live_elems as u64
    }

    /// All-reduces the persistent tensors' gradients and joins this rank's pieces (buffer
    /// order); the mean that `scaling` describes.
    fn reduce(&mut self, place: &DevicePlace, scaling: Scaling) -> Result<()> {
        let chunks = (self.chunks.take()).map_or_else(|| self.zeros(self.chunk_len), widened);
        let persistent_len = self.cut.persistent_len;
        let mut persistent =
            (self.persistent.take()).map_or_else(|| self.zeros(persistent_len), widened);
        if persistent_len > 0 {
            if scaling.pre != 1.0 {
                persistent = persistent.mul_scalar(scaling.pre);
            }
            let _span = tracing::debug_span!("zero3_persistent_all_reduce").entered();
            let coll = place.collectives();
            persistent = place.staged(|| coll.all_reduce(persistent, ReduceOp::Sum))?;
        }
        let (plan, cut) = (self.group.plan(), &self.cut);
        let parts = (cut.segments.iter())
            .map(|s| {
                let t = s.tensor;
                match (cut.persistent_at[t], &self.chunk_at[t]) {
                    (Some(at), _) => {
                        let own = plan.own(cut.rank, t);
                        (persistent.clone()).slice(at + own.start..at + own.end)
                    }
                    (None, Some(r)) => chunks.clone().slice(r.clone()),
                    (None, None) => self.zeros(s.local.len()),
                }
            })
            .collect();
        let grads = self.join(parts);
        self.reduced = Some(match scaling.post {
            1.0 => grads,
            post => grads.mul_scalar(post),
        });
        Ok(())
    }

    fn model_parallel(&mut self, _place: &DevicePlace, norm: &ModelParallelNorm) {
        self.mask = norm.mask_windows(self.cut.own_len, self.cut.windows(), &self.device);
    }

    fn own_sq(&self, place: &DevicePlace, _slices: Option<&ModelParallelNorm>) -> Result<f64> {
        own_squares(place, &self.reduced, &self.mask)
    }

    fn scale_own(&mut self, place: &DevicePlace, factor: f32) {
        self.reduced = self.reduced.take().map(|g| place.scaled(g, factor));
    }

    fn own(&self) -> Result<Cow<'_, Tensor<1>>> {
        own_part(&self.reduced)
    }

    fn bytes(&self) -> u64 {
        [&self.chunks, &self.persistent, &self.reduced]
            .into_iter()
            .flatten()
            .map(buffer_bytes)
            .sum()
    }

    fn reset(&mut self) {
        self.chunks = None;
        self.persistent = None;
        self.reduced = None;
    }

    fn device(&self) -> Option<Device> {
        Some(self.device.clone())
    }
}
