//! [`Zero3Sync`]: ZeRO stage 3 (arXiv 1910.02054 §5.3) in the engine. Parameters are
//! stored as per-rank chunks ([`crate::zero3`]); forward and backward gather them through a
//! [`GatherGroup`], and the backward of each gather reduce-scatters the tensor's gradient, so
//! after a micro-batch's backward a rank holds only the gradients of its chunks. At the
//! accumulation boundary the persistent (whole) tensors' gradients are all-reduced, the
//! rank's gradients are averaged and clipped by the global norm, the rank steps its pieces
//! with the [`PartitionedOptimizer`], and writes the new chunks back into the module. Only
//! the persistent tensors are all-gathered after the step.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::zero::{PartitionState, PartitionedOptimizer, Segment, ShardPlan};

use super::flat::{ParamLayout, to_f32_vec};
use super::memory::ModelStateBytes;
use super::zero::{clip_partitioned, merge_presence, partitioned_kind, pre_post, restore_state};
use crate::config::DeepSpeedConfig;
use crate::zero3::{GatherGroup, GatherStats, chunk_of, chunk_shape, shard_module};
use crate::{DeepSpeedError, Result};

/// A rank's stage-3 state: the gather group, its gradient pieces and its optimizer.
pub struct Zero3Sync {
    comm: Arc<dyn Communicator>,
    layout: ParamLayout,
    group: Arc<GatherGroup>,
    /// This rank's pieces, back to back (the optimizer's buffer order).
    segments: Vec<Segment>,
    /// Where tensor `t`'s piece starts in the rank's buffers, if it has one.
    local_start: Vec<Option<usize>>,
    /// Accumulated gradient of this rank's pieces.
    grads: Vec<f32>,
    /// Accumulated whole gradients of the persistent tensors, back to back.
    persistent: Vec<f32>,
    /// Where tensor `t` starts in `persistent`, if it is persistent.
    persistent_at: Vec<Option<usize>>,
    present: Vec<u8>,
    /// The device the gradients came on (for [`reduced_gradients`](Self::reduced_gradients)).
    grad_device: Option<Device>,
    micro_steps: u64,
    predivide: Option<f32>,
    clip: f64,
    ignore_unused: bool,
    /// `None` when the caller steps the pieces with its own optimizer
    /// ([`for_learner`](Self::for_learner)).
    optim: Option<PartitionedOptimizer>,
}

/// DeepSpeed's stage-3 cut of the tensors of `layout` over `world` ranks under `config`'s
/// persistence thresholds.
pub fn shard_plan(layout: &ParamLayout, config: &DeepSpeedConfig, world: usize) -> ShardPlan {
    let z = &config.zero_optimization;
    let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
    ShardPlan::new(
        &sizes,
        world,
        z.param_persistence_threshold as usize,
        usize::try_from(z.model_persistence_threshold).unwrap_or(usize::MAX),
    )
}

impl Zero3Sync {
    /// The stage-3 state for a model of `layout` (whole shapes) under `config` on `comm`.
    pub fn new(
        layout: ParamLayout,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let kind = partitioned_kind(config)?;
        let mut sync = Self::for_learner(layout, config, comm);
        sync.optim = Some(PartitionedOptimizer::over_segments(
            kind,
            sync.segments.clone(),
            0..sync.grads.len(),
            sync.layout.slots.len(),
        ));
        Ok(sync)
    }

    /// The stage-3 state with no optimizer of its own: the caller steps this rank's chunks
    /// and the persistent tensors ([`reduced_gradients`](Self::reduced_gradients)) with any
    /// element-wise optimizer, e.g. the `Learner`'s, then calls
    /// [`track_shards`](Self::track_shards).
    pub fn for_learner(
        layout: ParamLayout,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
    ) -> Self {
        let z = &config.zero_optimization;
        let plan = shard_plan(&layout, config, comm.world_size());
        let sizes = plan.tensors().len();
        let predivide = config
            .prescale_gradients
            .then_some(config.gradient_predivide_factor as f32);
        let segments = plan.segments(comm.rank());
        let own_len = plan.own_len(comm.rank());
        let mut local_start = vec![None; sizes];
        for s in &segments {
            local_start[s.tensor] = Some(s.local.start);
        }
        let mut persistent_at = vec![None; sizes];
        let mut at = 0;
        for (t, s) in plan.tensors().iter().enumerate() {
            if s.persistent {
                persistent_at[t] = Some(at);
                at += s.numel;
            }
        }
        let group = GatherGroup::new(
            comm.clone(),
            plan,
            layout.slots.iter().map(|s| s.shape.clone()).collect(),
            z.prefetch_bucket_size as usize,
            z.max_live_parameters as usize,
            predivide.map_or(1.0, |f| 1.0 / f),
            z.stage3_use_all_reduce_for_fetch_params,
        );
        Self {
            comm,
            group,
            segments,
            local_start,
            grads: vec![0.0; own_len],
            persistent: vec![0.0; at],
            persistent_at,
            present: vec![0; sizes],
            grad_device: None,
            micro_steps: 0,
            predivide,
            clip: config.gradient_clipping,
            ignore_unused: z.ignore_unused_parameters,
            optim: None,
            layout,
        }
    }

    /// Shards a model whose parameters are whole (and identical on every rank).
    pub fn shard<M: Module>(&self, model: M) -> M {
        shard_module(model, &self.group)
    }

    /// The gather group.
    pub fn group(&self) -> &Arc<GatherGroup> {
        &self.group
    }

    /// The shard plan.
    pub fn plan(&self) -> &ShardPlan {
        self.group.plan()
    }

    /// Traffic counters of the gathers.
    pub fn gather_stats(&self) -> GatherStats {
        self.group.stats()
    }

    /// Micro-batches accumulated since the last step.
    pub fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// The model state this rank holds between steps: its chunks and the persistent tensors,
    /// the gradients of its pieces and of the persistent tensors, and its pieces' optimizer
    /// state.
    pub fn state_bytes(&self) -> ModelStateBytes {
        ModelStateBytes {
            params: 4 * self.plan().stored_elems() as u64,
            grads: 4 * (self.grads.len() + self.persistent.len()) as u64,
            optimizer: self.optim.as_ref().map_or(0, |o| o.state_bytes()),
        }
    }

    /// Elements alive at once during a step beyond the held state: the largest gathered
    /// tensor and its whole gradient, the prefetched tensors, and one micro-batch's chunk
    /// gradients before they are added up.
    pub fn transient_elems(&self) -> usize {
        let plan = self.plan();
        let largest = plan.tensors().iter().map(|s| s.numel).max().unwrap_or(0);
        2 * largest + self.gather_stats().peak_prefetched + plan.stored_elems()
    }

    /// Adds one micro-batch's gradients (chunk gradients from the gathers' backward, whole
    /// gradients of persistent tensors) into this rank's buffers.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: &GradientsParams) {
        self.micro_steps += 1;
        struct V<'a> {
            sync: &'a mut Zero3Sync,
            grads: &'a GradientsParams,
            rank: usize,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = &mut *self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                let Some(g) = self.grads.get::<D>(param.id) else {
                    return;
                };
                s.present[t] = 1;
                if s.grad_device.is_none() {
                    s.grad_device = Some(g.device());
                }
                let values = to_f32_vec(g);
                if let Some(at) = s.persistent_at[t] {
                    s.persistent[at..at + values.len()]
                        .iter_mut()
                        .zip(&values)
                        .for_each(|(d, v)| *d += v);
                } else if let Some(at) = s.local_start[t] {
                    let own = s.group.plan().own(self.rank, t);
                    s.grads[at..at + own.len()]
                        .iter_mut()
                        .zip(&values)
                        .for_each(|(d, v)| *d += v);
                }
            }
        }
        let rank = self.comm.rank();
        module.visit(&mut V {
            sync: self,
            grads,
            rank,
        });
    }

    /// Ends the accumulation: reports a failed gather, all-reduces the persistent tensors'
    /// gradients, averages over ranks and micro-batches, and clips by the global norm.
    /// Returns the norm before clipping.
    pub fn reduce(&mut self) -> Result<f64> {
        if let Some(e) = self.group.take_error() {
            self.reset();
            return Err(e.into());
        }
        let comm = self.comm.clone();
        let rank = comm.rank();
        if let Err(e) = merge_presence(
            comm.as_ref(),
            &mut self.present,
            self.ignore_unused,
            &self.layout,
        ) {
            self.reset();
            return Err(e);
        }
        let (pre, post) = pre_post(self.predivide, comm.world_size(), self.micro_steps);
        if !self.persistent.is_empty() {
            if pre != 1.0 {
                self.persistent.iter_mut().for_each(|g| *g *= pre);
            }
            if comm.world_size() > 1 {
                let _span = tracing::debug_span!("zero3_persistent_all_reduce").entered();
                comm.all_reduce(&mut self.persistent, ReduceOp::Sum)?;
            }
            for (t, at) in self.persistent_at.iter().enumerate() {
                if let (Some(at), Some(local)) = (at, self.local_start[t]) {
                    let own = self.group.plan().own(rank, t);
                    self.grads[local..local + own.len()]
                        .copy_from_slice(&self.persistent[at + own.start..at + own.end]);
                }
            }
        }
        if post != 1.0 {
            self.grads.iter_mut().for_each(|g| *g *= post);
        }
        clip_partitioned(comm.as_ref(), &mut self.grads, self.clip)
    }

    /// After [`reduce`](Self::reduce): steps this rank's pieces, writes the new chunks into
    /// `model`, and all-gathers the persistent tensors.
    pub fn step_reduced<M: Module>(&mut self, model: M, lr: f64) -> Result<M> {
        let comm = self.comm.clone();
        let rank = comm.rank();
        let mut params = vec![0.0f32; self.grads.len()];
        self.read_own(&model, &mut params);
        {
            let _span = tracing::debug_span!("optimizer_step", rank).entered();
            let optim = self.optim.as_mut().ok_or_else(|| {
                DeepSpeedError::Data("this stage-3 state steps with the caller's optimizer".into())
            })?;
            optim.step(comm.as_ref(), &mut params, &self.grads, &self.present, lr)?;
        }
        let whole = self.gather_persistent(&params)?;
        let model = self.write_back(model, &params, whole);
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
        Ok(model)
    }

    /// After [`reduce`](Self::reduce), for a caller that steps with its own optimizer: the
    /// averaged, clipped gradients as Burn gradients, ready for `ModuleOptimizer::step` on
    /// `model`'s stored values. A partitioned tensor gets its chunk's gradient (chunk shape,
    /// zero over the padding); a persistent tensor gets its whole gradient, the same on every
    /// rank (one all-gather of the persistent pieces). The buffers are then cleared for the
    /// next accumulation.
    pub fn reduced_gradients<M: Module>(&mut self, model: &M) -> Result<GradientsParams> {
        let whole = self.gather_persistent(&self.grads)?;
        struct V<'a> {
            sync: &'a Zero3Sync,
            whole: &'a [f32],
            device: Device,
            rank: usize,
            out: GradientsParams,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.present[t] == 0 {
                    return;
                }
                let data = match s.persistent_at[t] {
                    Some(at) => TensorData::new(
                        self.whole[at..at + s.numel(t)].to_vec(),
                        s.layout.slots[t].shape.clone(),
                    ),
                    None => {
                        let chunk = s.plan().tensors()[t].chunk;
                        let mut values = vec![0.0f32; chunk];
                        if let Some(at) = s.local_start[t] {
                            let n = s.plan().own(self.rank, t).len();
                            values[..n].copy_from_slice(&s.grads[at..at + n]);
                        }
                        TensorData::new(values, chunk_shape(chunk, D))
                    }
                };
                self.out
                    .register::<D>(param.id, Tensor::from_data(data, &self.device));
            }
        }
        let mut v = V {
            sync: self,
            whole: &whole,
            device: self.grad_device.clone().unwrap_or_default(),
            rank: self.comm.rank(),
            out: GradientsParams::new(),
        };
        model.visit(&mut v);
        let out = v.out;
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
        Ok(out)
    }

    /// Records `model`'s current chunks for prefetching, after the caller stepped them.
    pub fn track_shards<M: Module>(&self, model: &M) {
        struct V<'a>(&'a Zero3Sync);
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

    /// This rank's pieces of the model's parameters, in buffer order.
    fn read_own<M: Module>(&self, model: &M, out: &mut [f32]) {
        struct V<'a> {
            sync: &'a Zero3Sync,
            out: &'a mut [f32],
            rank: usize,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                let Some(at) = s.local_start[t] else {
                    return;
                };
                let own = s.group.plan().own(self.rank, t);
                let values = to_f32_vec(param.base());
                let src = if s.persistent_at[t].is_some() {
                    &values[own.clone()]
                } else {
                    &values[..own.len()]
                };
                self.out[at..at + own.len()].copy_from_slice(src);
            }
        }
        model.visit(&mut V {
            sync: self,
            out,
            rank: self.comm.rank(),
        });
    }

    /// The persistent tensors whole, from every rank's updated pieces (one all-gather).
    fn gather_persistent(&self, params: &[f32]) -> Result<Vec<f32>> {
        if self.persistent.is_empty() {
            return Ok(Vec::new());
        }
        let plan = self.plan();
        let world = self.comm.world_size();
        let persistent: Vec<usize> = (0..plan.tensors().len())
            .filter(|&t| self.persistent_at[t].is_some())
            .collect();
        let counts: Vec<usize> = (0..world)
            .map(|r| persistent.iter().map(|&t| plan.own(r, t).len()).sum())
            .collect();
        let rank = self.comm.rank();
        let mut input = Vec::with_capacity(counts[rank]);
        for &t in &persistent {
            if let Some(at) = self.local_start[t] {
                input.extend_from_slice(&params[at..at + plan.own(rank, t).len()]);
            }
        }
        let mut out = vec![0.0f32; counts.iter().sum()];
        self.comm.all_gather(&input, &mut out, &counts)?;
        let mut whole = vec![0.0f32; self.persistent.len()];
        let mut at = 0;
        for r in 0..world {
            for &t in &persistent {
                let own = plan.own(r, t);
                let base = self.persistent_at[t].expect("persistent");
                whole[base + own.start..base + own.end].copy_from_slice(&out[at..at + own.len()]);
                at += own.len();
            }
        }
        Ok(whole)
    }

    /// Replaces the module's chunks by this rank's updated pieces (padding stays zero) and
    /// the persistent tensors by `whole`; records the new chunks for prefetching.
    fn write_back<M: Module>(&self, model: M, params: &[f32], whole: Vec<f32>) -> M {
        let rank = self.comm.rank();
        let values = |t: usize, persistent: bool| match self.persistent_at[t] {
            Some(at) if persistent => whole[at..at + self.numel(t)].to_vec(),
            _ => {
                let own = self.plan().own(rank, t);
                let mut chunk = vec![0.0f32; self.plan().tensors()[t].chunk];
                if let Some(at) = self.local_start[t] {
                    chunk[..own.len()].copy_from_slice(&params[at..at + own.len()]);
                }
                chunk
            }
        };
        self.replace(model, values, false)
    }

    /// The whole parameters, flat in layout order (a collective: one all-gather per
    /// partitioned tensor).
    pub fn full_params<M: Module>(&self, model: &M) -> Result<Vec<f32>> {
        let mut chunks: Vec<Option<Vec<f32>>> = vec![None; self.layout.slots.len()];
        struct V<'a> {
            layout: &'a ParamLayout,
            chunks: &'a mut Vec<Option<Vec<f32>>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(t) = self.layout.slot_of(param.id) {
                    self.chunks[t] = Some(to_f32_vec(param.base()));
                }
            }
        }
        model.visit(&mut V {
            layout: &self.layout,
            chunks: &mut chunks,
        });
        let plan = self.plan();
        let mut flat = Vec::with_capacity(self.layout.numel);
        for (t, chunk) in chunks.into_iter().enumerate() {
            let chunk = chunk.ok_or_else(|| {
                DeepSpeedError::Data(format!("the model has no parameter {t} of the layout"))
            })?;
            let s = plan.tensors()[t];
            if s.persistent {
                flat.extend_from_slice(&chunk);
            } else {
                let mut out = vec![0.0f32; s.chunk * self.comm.world_size()];
                self.comm.all_gather_equal(&chunk, &mut out)?;
                flat.extend_from_slice(&out[..s.numel]);
            }
        }
        Ok(flat)
    }

    /// `model` with whole parameters from `flat` (layout order) in place of its chunks; the
    /// group is released, so `Param::val()` passes them through. Not a collective.
    pub fn unshard<M: Module>(&self, model: M, flat: &[f32]) -> M {
        let whole = |t: usize, _| flat[self.offset(t)..self.offset(t) + self.numel(t)].to_vec();
        let model = self.replace(model, whole, true);
        self.group.release();
        model
    }

    /// `model` (sharded) with its chunks and persistent tensors cut from the whole flat
    /// parameters `flat` (layout order), e.g. from a checkpoint.
    pub fn load_flat<M: Module>(&self, model: M, flat: &[f32]) -> M {
        let rank = self.comm.rank();
        self.replace(
            model,
            |t, persistent| {
                let whole = &flat[self.offset(t)..self.offset(t) + self.numel(t)];
                if persistent {
                    whole.to_vec()
                } else {
                    chunk_of(whole, self.plan().tensors()[t].chunk, rank)
                }
            },
            false,
        )
    }

    fn offset(&self, t: usize) -> usize {
        self.layout.slots[t].offset
    }

    fn numel(&self, t: usize) -> usize {
        self.layout.slots[t].numel
    }

    /// Maps every parameter `t` to `values(t, persistent)`: whole shapes when `whole` (or
    /// persistent), chunk shapes otherwise.
    fn replace<M: Module>(
        &self,
        model: M,
        values: impl Fn(usize, bool) -> Vec<f32>,
        whole: bool,
    ) -> M {
        struct Mapper<'a, F> {
            sync: &'a Zero3Sync,
            values: F,
            whole: bool,
        }
        impl<F: Fn(usize, bool) -> Vec<f32>> ModuleMapper for Mapper<'_, F> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return param;
                };
                let shard = s.plan().tensors()[t];
                let (id, tensor, mapper) = param.consume();
                let device = tensor.device();
                let require_grad = tensor.is_require_grad();
                let values = (self.values)(t, shard.persistent);
                let shape = if self.whole || shard.persistent {
                    s.layout.slots[t].shape.clone()
                } else {
                    let flat = Tensor::<1>::from_data(
                        TensorData::new(values.clone(), [shard.chunk]),
                        &device,
                    );
                    s.group.set_shard(t, flat.inner());
                    chunk_shape(shard.chunk, D)
                };
                let new = Tensor::<D>::from_data(TensorData::new(values, shape), &device)
                    .set_require_grad(require_grad);
                Param::from_mapped_value(id, new, mapper)
            }
        }
        model.map(&mut Mapper {
            sync: self,
            values,
            whole,
        })
    }

    fn reset(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        self.persistent.iter_mut().for_each(|g| *g = 0.0);
        self.micro_steps = 0;
    }

    /// This rank's optimizer state, to save (`None` without an optimizer of its own).
    pub fn export(&self) -> Option<&PartitionState> {
        self.optim.as_ref().map(|o| o.export())
    }

    /// Restores this rank's optimizer state.
    pub fn restore(&mut self, state: PartitionState) -> Result<()> {
        restore_state(&mut self.optim, state)
    }

    /// Replaces the layout (the same tensors, with the parameter ids of a loaded checkpoint).
    pub fn set_layout(&mut self, layout: ParamLayout) {
        self.layout = layout;
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    /// Elements of this rank's pieces.
    pub fn own_len(&self) -> usize {
        self.grads.len()
    }

    /// This rank's pieces (for re-cutting a checkpoint).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }
}
