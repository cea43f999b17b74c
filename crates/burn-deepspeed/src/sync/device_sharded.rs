//! [`DeviceShardedSync`]: ZeRO stage 3 (arXiv 1910.02054 §5.3) with every buffer on the
//! model's device.
//!
//! The module stores this rank's chunk of every partitioned tensor (and the persistent
//! tensors whole), as the host regime [`ShardedSync`](super::ShardedSync) does, and the same
//! [`GatherGroup`] gathers them for forward and backward and reduce-scatters their gradients.
//! What changes is where the rank's state lives: the accumulated gradient of its pieces, the
//! persistent tensors' gradients, its fp32 pieces (the masters under fp16/bf16) and the
//! optimizer's moments are rank-1 tensors of the model's device. A micro-batch's chunk gradients are
//! sliced into the buffer by device ops; at the boundary the persistent tensors' gradients are
//! all-reduced through the [`DeviceCollectives`], the buffer is clipped by the global norm
//! (one scalar read), stepped by the fused Adam/AdamW (one launch over the rank's pieces) or
//! LAMB (its per-tensor norms summed over the ranks on the device),
//! the persistent pieces are all-gathered, and the module's chunks are written back as slices
//! of the stepped buffer. Nothing crosses to the host but the norm and what the collectives
//! stage: the gathers and reduce-scatters of the group (host copies on wgpu, the only path
//! between wgpu ranks) and the persistent tensors' all-reduce and all-gather.
//!
//! Under fp16/bf16 the chunk gradients are the op's, in the parameter's dtype (DeepSpeed
//! reduce-scatters 16-bit gradients too); the host regime keeps the reduce-scatters' f32 sums
//! instead, so the two differ by that rounding.

use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;
use burn_deepspeed_strategies::zero::{PartitionState, Segment, ShardPlan};

use super::ModelParallelNorm;
use super::buffer::merge_presence;
use super::device_step::{DeviceOptimizer, StepState, clip_to, device_step, squared_norm, staged};
use super::scale::{Scaling, norm_across, sum_across};
use super::sharded::{gather_group, gathered_copy};
use super::{GradSync, Reduced, SavedState, SyncOptions};
use crate::checkpoint::{Loaded, gather_state, partition_state_bytes};
use crate::flat::{ParamLayout, set_param_ids};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::precision::cast_module;
use crate::primitive::autodiff_like;
use crate::transfer;
use crate::zero3::{GatherGroup, GatherStats, chunk_shape, shard_module};
use crate::{DeepSpeedError, Result, agreed};

/// A rank's ZeRO stage-3 state on the model's device.
pub struct DeviceShardedSync {
    layout: ParamLayout,
    comm: Arc<dyn Communicator>,
    coll: Arc<dyn DeviceCollectives>,
    group: Arc<GatherGroup>,
    /// This rank's pieces, tensor after tensor (its buffers' order).
    segments: Vec<Segment>,
    /// Model parallelism: the norm's groups, and the 0/1 mask of what this rank counts in
    /// its pieces (`None`: everything).
    slices: Option<(ModelParallelNorm, Option<Tensor<1>>)>,
    /// Per tensor: its piece's range in this rank's buffers.
    local: Vec<Option<Range<usize>>>,
    own_len: usize,
    /// Per partitioned tensor with a piece here: its range in the chunk-gradient buffer
    /// (the partitioned pieces back to back).
    chunk_at: Vec<Option<Range<usize>>>,
    chunk_len: usize,
    /// Per persistent tensor: its range in the persistent gradient buffer (whole tensors
    /// back to back).
    persistent_at: Vec<Option<Range<usize>>>,
    persistent_len: usize,
    /// The all-gather of the persistent pieces: every rank's count, and per persistent
    /// tensor the ranges of its pieces in the gathered buffer, in rank order.
    persistent_counts: Vec<usize>,
    persistent_parts: Vec<Vec<Range<usize>>>,
    options: SyncOptions,
    optimizer: DeviceOptimizer,
    device: Device,
    /// The accumulated chunk gradients of the partitioned pieces, and the persistent
    /// tensors' whole gradients (f32), from a step's first micro-batch to its reduction.
    chunk_grads: Option<Tensor<1>>,
    persistent: Option<Tensor<1>>,
    /// The reduced, clipped gradient of this rank's pieces (buffer order), for the step.
    reduced: Option<Tensor<1>>,
    micro_steps: u64,
    present: Vec<u8>,
    /// This rank's pieces in fp32 (the masters under mixed precision), m and v.
    params: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    steps: Vec<u32>,
    mixed: bool,
    meter: MemoryMeter,
}

impl DeviceShardedSync {
    /// Stage 3 of a model of `layout` on `device` over `coll`, stepping `optimizer`
    /// (its `lr` is replaced by each step's). The model is cut by [`shard`](Self::shard).
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        coll: Arc<dyn DeviceCollectives>,
        options: &SyncOptions,
        optimizer: DeviceOptimizer,
        device: Device,
    ) -> Self {
        let rank = coll.rank();
        let group = gather_group(&layout, comm.clone(), options);
        let plan = group.plan();
        let tensors = plan.tensors().len();
        let segments = plan.segments(rank);
        let own_len = plan.own_len(rank);
        let mut local = vec![None; tensors];
        let mut chunk_at = vec![None; tensors];
        let mut chunk_len = 0;
        for s in &segments {
            local[s.tensor] = Some(s.local.clone());
            if !plan.tensors()[s.tensor].persistent {
                chunk_at[s.tensor] = Some(chunk_len..chunk_len + s.local.len());
                chunk_len += s.local.len();
            }
        }
        let mut persistent_at = vec![None; tensors];
        let mut persistent_len = 0;
        for (t, s) in plan.tensors().iter().enumerate() {
            if s.persistent {
                persistent_at[t] = Some(persistent_len..persistent_len + s.numel);
                persistent_len += s.numel;
            }
        }
        let (persistent_counts, persistent_parts) = persistent_gather(plan);
        // The gathers and reduce-scatters move the device's buffers through the same
        // collectives as the rest of the regime.
        group.set_device_collectives(coll.clone());
        let inner = device.inner();
        Self {
            present: vec![0; layout.slots.len()],
            steps: vec![0; layout.slots.len()],
            layout,
            comm,
            coll,
            group,
            segments,
            slices: None,
            local,
            own_len,
            chunk_at,
            chunk_len,
            persistent_at,
            persistent_len,
            persistent_counts,
            persistent_parts,
            options: *options,
            optimizer,
            chunk_grads: None,
            persistent: None,
            reduced: None,
            micro_steps: 0,
            params: Tensor::zeros([0], &inner),
            m: Tensor::zeros([own_len], &inner),
            v: Tensor::zeros([own_len], &inner),
            mixed: false,
            meter: MemoryMeter::default(),
            device: inner,
        }
    }

    /// Cuts a whole `model` (the same on every rank, in f32) into this rank's chunks, and
    /// takes its pieces as the fp32 parameters the optimizer steps.
    pub fn shard<M: Module>(&mut self, model: M) -> M {
        let model = shard_module(model, &self.group);
        self.params = self.read_pieces(&model);
        model
    }

    /// The gather group.
    pub fn group(&self) -> &Arc<GatherGroup> {
        &self.group
    }

    fn plan(&self) -> &ShardPlan {
        self.group.plan()
    }

    fn rank(&self) -> usize {
        self.coll.rank()
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

    /// This rank's pieces of the module's stored values, in buffer order, in f32.
    fn read_pieces<M: Module>(&self, model: &M) -> Tensor<1> {
        struct V<'a> {
            sync: &'a DeviceShardedSync,
            parts: Vec<Option<Tensor<1>>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.local[t].is_none() {
                    return;
                }
                let own = s.plan().own(s.rank(), t);
                let base = param.base().inner();
                let n = base.shape().num_elements();
                let flat = base.reshape([n]).cast(DType::F32);
                self.parts[t] = Some(match s.persistent_at[t] {
                    Some(_) => flat.slice(own),
                    None => flat.slice(0..own.len()),
                });
            }
        }
        let mut v = V {
            sync: self,
            parts: vec![None; self.layout.slots.len()],
        };
        model.visit(&mut v);
        let parts = self
            .segments
            .iter()
            .map(|s| {
                v.parts[s.tensor]
                    .take()
                    .unwrap_or_else(|| self.zeros(s.local.len()))
            })
            .collect();
        self.join(parts)
    }

    /// The persistent tensors whole (per tensor), from every rank's pieces of them in its
    /// `params` (one all-gather); `None` for the partitioned tensors.
    fn gather_persistent(&self, params: &Tensor<1>) -> Result<Vec<Option<Tensor<1>>>> {
        let mut whole = vec![None; self.layout.slots.len()];
        if self.persistent_len == 0 {
            return Ok(whole);
        }
        let input = (0..whole.len())
            .filter(|&t| self.persistent_at[t].is_some())
            .filter_map(|t| self.local[t].clone().map(|r| params.clone().slice(r)))
            .collect();
        let input = self.join(input);
        let out = staged(self.coll.as_ref(), &self.device, |c| {
            c.all_gather(input, &self.persistent_counts)
        })?;
        let persistent = (0..whole.len()).filter(|&t| self.persistent_at[t].is_some());
        for (t, ranges) in persistent.zip(&self.persistent_parts) {
            let parts = ranges
                .iter()
                .map(|r| out.clone().slice(r.clone()))
                .collect();
            whole[t] = Some(self.join(parts));
        }
        Ok(whole)
    }

    /// Tensor `t`'s padded chunk from this rank's pieces `params`.
    fn chunk_of(&self, params: &Tensor<1>, t: usize) -> Tensor<1> {
        let chunk = self.plan().tensors()[t].chunk;
        match &self.local[t] {
            None => self.zeros(chunk),
            Some(r) if r.len() == chunk => params.clone().slice(r.clone()),
            Some(r) => Tensor::cat(
                vec![params.clone().slice(r.clone()), self.zeros(chunk - r.len())],
                0,
            ),
        }
    }

    /// The whole parameters, flat in layout order, from every rank's fp32 pieces (a
    /// collective: the persistent pieces in one all-gather, then one per partitioned tensor).
    fn whole_flat(&self) -> Result<Tensor<1>> {
        let mut whole = self.gather_persistent(&self.params)?;
        let world = self.coll.world_size();
        let mut parts = Vec::with_capacity(whole.len());
        for (t, persistent) in whole.iter_mut().enumerate() {
            let part = match persistent.take() {
                Some(p) => p,
                None => {
                    let s = self.plan().tensors()[t];
                    let chunk = self.chunk_of(&self.params, t);
                    let all = staged(self.coll.as_ref(), &self.device, |c| {
                        c.all_gather(chunk, &vec![s.chunk; world])
                    })?;
                    all.slice(0..s.numel)
                }
            };
            parts.push(part);
        }
        Ok(self.join(parts))
    }

    /// Replaces the module's stored values: the chunks by this rank's `params` padded, the
    /// persistent tensors by `whole`, or, when `flat` is given, every tensor by its whole
    /// values from it (the module is whole again). Records the new chunks for prefetching.
    fn write_back<M: Module>(
        &self,
        model: M,
        params: &Tensor<1>,
        whole: &[Option<Tensor<1>>],
        flat: Option<&Tensor<1>>,
    ) -> M {
        struct Mapper<'a> {
            sync: &'a DeviceShardedSync,
            params: &'a Tensor<1>,
            whole: &'a [Option<Tensor<1>>],
            flat: Option<&'a Tensor<1>>,
        }
        impl ModuleMapper for Mapper<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return param;
                };
                let (id, tensor, mapper) = param.consume();
                let dtype = tensor.dtype();
                let slot = &s.layout.slots[t];
                let (values, shape) = match (self.flat, &self.whole[t]) {
                    (Some(flat), _) => (
                        flat.clone().slice(slot.offset..slot.offset + slot.numel),
                        slot.shape.clone(),
                    ),
                    (None, Some(whole)) => (whole.clone(), slot.shape.clone()),
                    (None, None) => {
                        let chunk = s.chunk_of(self.params, t).cast(dtype);
                        s.group.set_shard(t, chunk.clone());
                        let n = s.plan().tensors()[t].chunk;
                        (chunk, chunk_shape(n, D))
                    }
                };
                let shape: [usize; D] = shape.try_into().expect("the parameter's rank");
                let new = values.cast(dtype).reshape(shape);
                let new = autodiff_like(new, &tensor);
                let new = new.set_require_grad(tensor.is_require_grad());
                Param::from_mapped_value(id, new, mapper)
            }
        }
        model.map(&mut Mapper {
            sync: self,
            params,
            whole,
            flat,
        })
    }

    /// Records `model`'s current chunks for prefetching (after a cast).
    fn track_shards<M: Module>(&self, model: &M) {
        struct V<'a>(&'a DeviceShardedSync);
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.0;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.persistent_at[t].is_none() {
                    let chunk = s.plan().tensors()[t].chunk;
                    s.group.set_shard(t, param.base().inner().reshape([chunk]));
                }
            }
        }
        model.visit(&mut V(self));
    }

    fn own_state(&self) -> PartitionState {
        PartitionState {
            steps: self.steps.clone(),
            m: transfer::read_f32(self.m.clone()),
            v: transfer::read_f32(self.v.clone()),
        }
    }

    fn clear(&mut self) {
        self.chunk_grads = None;
        self.persistent = None;
        self.reduced = None;
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    fn grad_bytes(&self) -> u64 {
        [&self.chunk_grads, &self.persistent, &self.reduced]
            .into_iter()
            .flatten()
            .map(|g| 4 * g.dims()[0] as u64)
            .sum()
    }
}

/// The all-gather of the persistent tensors' pieces under `plan`: every rank's count (its
/// pieces back to back, tensor after tensor) and, per persistent tensor, where each rank's
/// piece lands in the gathered buffer (rank order, empty pieces left out).
fn persistent_gather(plan: &ShardPlan) -> (Vec<usize>, Vec<Vec<Range<usize>>>) {
    let persistent: Vec<usize> = (0..plan.tensors().len())
        .filter(|&t| plan.tensors()[t].persistent)
        .collect();
    let mut parts = vec![Vec::new(); persistent.len()];
    let mut counts = Vec::with_capacity(plan.world());
    let mut at = 0;
    for r in 0..plan.world() {
        let start = at;
        for (k, &t) in persistent.iter().enumerate() {
            let n = plan.own(r, t).len();
            if n > 0 {
                parts[k].push(at..at + n);
            }
            at += n;
        }
        counts.push(at - start);
    }
    (counts, parts)
}

impl<M: Module> GradSync<M> for DeviceShardedSync {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Adds one micro-batch's gradients: each chunk gradient's real elements (the op's
    /// backward reduce-scattered it already) and the persistent tensors' whole gradients.
    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        struct V<'a> {
            sync: &'a DeviceShardedSync,
            grads: &'a GradientsParams,
            present: &'a mut [u8],
            chunks: Vec<Option<Tensor<1>>>,
            persistent: Vec<Option<Tensor<1>>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                let Some(g) = self.grads.get::<D>(param.id) else {
                    return;
                };
                self.present[t] = 1;
                let n = g.shape().num_elements();
                let flat = g.cast(DType::F32).reshape([n]);
                if s.persistent_at[t].is_some() {
                    self.persistent[t] = Some(flat);
                } else if let Some(r) = &s.chunk_at[t] {
                    self.chunks[t] = Some(flat.slice(0..r.len()));
                }
            }
        }
        let tensors = self.layout.slots.len();
        let mut present = std::mem::take(&mut self.present);
        let mut v = V {
            sync: self,
            grads,
            present: &mut present,
            chunks: vec![None; tensors],
            persistent: vec![None; tensors],
        };
        model.visit(&mut v);
        let (mut chunks, mut persistent) = (v.chunks, v.persistent);
        self.present = present;
        let chunk_parts = (0..tensors)
            .filter_map(|t| {
                let r = self.chunk_at[t].as_ref()?;
                Some(chunks[t].take().unwrap_or_else(|| self.zeros(r.len())))
            })
            .collect();
        let chunk_flat = self.join(chunk_parts);
        let persistent_parts = (0..tensors)
            .filter_map(|t| {
                let r = self.persistent_at[t].as_ref()?;
                Some(persistent[t].take().unwrap_or_else(|| self.zeros(r.len())))
            })
            .collect();
        let persistent_flat = self.join(persistent_parts);
        self.chunk_grads = Some(match self.chunk_grads.take() {
            Some(acc) => acc + chunk_flat,
            None => chunk_flat,
        });
        self.persistent = Some(match self.persistent.take() {
            Some(acc) => acc + persistent_flat,
            None => persistent_flat,
        });
        self.micro_steps += 1;
        // Alive during the micro-batch beyond the held state: what the gathers allocated.
        let gathered = 4 * self.group.stats().peak_live_elems as u64;
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, gathered);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// Reports a failed gather, all-reduces the persistent tensors' gradients, averages over
    /// ranks and micro-batches, and clips by the global norm.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let comm = self.comm.clone();
        let gathers = self.group.take_error().map_or(Ok(()), |e| Err(e.into()));
        if let Err(e) = agreed(comm.as_ref(), "ZeRO-3 gathers", gathers) {
            self.clear();
            return Err(e);
        }
        let refuse = (!self.options.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(comm.as_ref(), &mut self.present, refuse) {
            self.clear();
            return Err(e);
        }
        let scaling = Scaling::mean(self.options.predivide, comm.world_size(), self.micro_steps)
            .unscaled(loss_scale);
        let chunks = self
            .chunk_grads
            .take()
            .unwrap_or_else(|| self.zeros(self.chunk_len));
        let mut persistent = self
            .persistent
            .take()
            .unwrap_or_else(|| self.zeros(self.persistent_len));
        if self.persistent_len > 0 {
            if scaling.pre != 1.0 {
                persistent = persistent.mul_scalar(scaling.pre);
            }
            let _span = tracing::debug_span!("zero3_persistent_all_reduce").entered();
            persistent = staged(self.coll.as_ref(), &self.device, |c| {
                c.all_reduce(persistent, ReduceOp::Sum)
            })?;
        }
        let rank = self.rank();
        let parts = self
            .segments
            .iter()
            .map(|s| {
                let t = s.tensor;
                match (&self.persistent_at[t], &self.chunk_at[t]) {
                    (Some(at), _) => {
                        let own = self.plan().own(rank, t);
                        persistent
                            .clone()
                            .slice(at.start + own.start..at.start + own.end)
                    }
                    (None, Some(r)) => chunks.clone().slice(r.clone()),
                    (None, None) => self.zeros(s.local.len()),
                }
            })
            .collect();
        let grads = self.join(parts);
        let grads = match scaling.post {
            1.0 => grads,
            post => grads.mul_scalar(post),
        };
        // The norm's square is the one value the host reads (summed over the ranks' pieces,
        // in f64, over the host communicator).
        let norm = match &self.slices {
            Some((mp, mask)) => {
                let local = match mask {
                    Some(mask) => squared_norm(&(grads.clone() * mask.clone())),
                    None => squared_norm(&grads),
                };
                mp.across(sum_across(comm.as_ref(), local)?)?.sqrt()
            }
            None => norm_across(comm.as_ref(), squared_norm(&grads))?,
        };
        let grads = clip_to(grads, norm, self.options.clip);
        self.reduced = Some(grads);
        Ok(Reduced::global(norm))
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        let windows = self
            .segments
            .iter()
            .map(|s| (s.local.start, s.global.clone()));
        let mask = norm.mask_windows(self.own_len, windows, &self.device);
        self.slices = Some((norm, mask));
        Ok(())
    }

    /// Steps this rank's pieces, all-gathers the persistent tensors, and writes the new
    /// chunks into `model`.
    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let span = tracing::debug_span!("optimizer_step").entered();
        let grads = self
            .reduced
            .take()
            .ok_or_else(|| DeepSpeedError::Regime("step before reduce".into()))?;
        let pieces: Vec<(usize, Range<usize>)> = self
            .segments
            .iter()
            .map(|s| (s.tensor, s.local.clone()))
            .collect();
        self.params = device_step(
            &self.optimizer,
            lr,
            self.params.clone(),
            &grads,
            StepState {
                m: &mut self.m,
                v: &mut self.v,
                steps: &mut self.steps,
                present: &self.present,
            },
            &pieces,
            Some(self.coll.as_ref()),
            &self.device,
        )?;
        drop((grads, span));
        let whole = self.gather_persistent(&self.params)?;
        let model = self.write_back(model, &self.params, &whole, None);
        self.clear();
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, 0);
        Ok(model)
    }

    fn discard(&mut self) {
        self.clear();
    }

    fn reduced_gradients(&mut self, _model: &M) -> Result<GradientsParams> {
        Err(super::steps_its_own_fused_optimizer(3))
    }

    /// Its chunks and persistent tensors, the gradients it holds, m and v of its pieces,
    /// and their fp32 masters when the module is their 16-bit copy.
    fn held(&self, model: &M) -> ModelStateBytes {
        let masters = if self.mixed { 4 } else { 0 };
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.grad_bytes(),
            optimizer: (8 + masters) * self.own_len as u64,
            offloaded: 0,
        }
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    /// The fp32 pieces are the masters already; the module becomes their 16-bit copy, and
    /// the gathers send it as it is.
    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        self.mixed = true;
        let model = cast_module(model, dtype);
        self.track_shards(&model);
        self.group.set_wire(Some(dtype));
        self.group.keep_chunk_grads(false);
        Ok(model)
    }

    /// A collective; the fp32 values (the masters under mixed precision).
    fn whole_params(&self, _model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        let flat = self.whole_flat()?;
        Ok(wanted.then(|| transfer::read_f32(flat)))
    }

    fn whole_model(&self, model: &M) -> Result<M> {
        gathered_copy(model, &self.group)
    }

    fn release_whole(&self, model: M) -> Result<M> {
        let flat = self.whole_flat()?;
        let whole = vec![None; self.layout.slots.len()];
        let model = self.write_back(model, &self.params, &whole, Some(&flat));
        self.group.release();
        Ok(model)
    }

    /// Every rank its pieces' state, in the host regime's format.
    fn save(&self, _root: bool) -> Result<SavedState> {
        Ok(SavedState::Slice(partition_state_bytes(&self.own_state())))
    }

    /// Everything fallible (reading and cutting the optimizer state) happens before the
    /// chunks are replaced.
    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let layout = self.layout.with_ids(&loaded.meta.param_ids);
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let ranges: Vec<_> = self.segments.iter().map(|s| s.global.clone()).collect();
        let state = loaded.slice_state(&sizes, &ranges)?;
        if state.m.len() != self.own_len || state.steps.len() != self.steps.len() {
            return Err(DeepSpeedError::Checkpoint(format!(
                "the optimizer state holds {} elements in {} tensors; this rank's pieces are {} \
                 elements of {} tensors",
                state.m.len(),
                state.steps.len(),
                self.own_len,
                self.steps.len()
            )));
        }
        let to_device = |values: Vec<f32>| {
            let len = values.len();
            transfer::write::<1>(TensorData::new(values, [len]), &self.device, DType::F32)
        };
        let pieces = self
            .segments
            .iter()
            .flat_map(|s| loaded.params[s.global.clone()].iter().copied())
            .collect();
        let whole: Vec<Option<Tensor<1>>> = (0..self.layout.slots.len())
            .map(|t| {
                self.persistent_at[t].as_ref().map(|_| {
                    let slot = &self.layout.slots[t];
                    to_device(loaded.params[slot.offset..slot.offset + slot.numel].to_vec())
                })
            })
            .collect();
        // The checkpoint's fp32 values, not the model's (rounded under mixed precision).
        self.params = to_device(pieces);
        self.m = to_device(state.m);
        self.v = to_device(state.v);
        self.steps = state.steps;
        let model = self.write_back(model, &self.params, &whole, None);
        let model = set_param_ids(model, &loaded.meta.param_ids);
        self.layout = layout;
        self.clear();
        Ok(model)
    }

    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        let comm = &self.comm;
        gather_state(comm.as_ref(), &self.own_state(), &sizes, 3).map(Some)
    }

    fn gather_stats(&self) -> Option<GatherStats> {
        Some(self.group.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn persistent_pieces_land_in_rank_order() {
        // Tensors of 5 (persistent), 8 (partitioned) and 3 (persistent) elements over 2
        // ranks: chunks of 3, 4 and 2.
        let plan = ShardPlan::new(&[5, 8, 3], 2, 5, usize::MAX);
        let (counts, parts) = persistent_gather(&plan);
        // Rank 0 holds 0..3 of the first and 0..2 of the last; rank 1 3..5 and 2..3.
        assert_eq!(counts, vec![5, 3]);
        assert_eq!(parts, vec![vec![0..3, 5..7], vec![3..5, 7..8]]);
    }
}
