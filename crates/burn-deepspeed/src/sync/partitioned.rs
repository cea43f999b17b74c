//! [`PartitionedSync`]: ZeRO stages 1 and 2 (arXiv 1910.02054 §5): the optimizer state, and
//! at stage 2 the gradients, are cut across the data-parallel ranks.
//!
//! - **Stage 1** accumulates whole gradients in a flat buffer, as stage 0 does. At the
//!   accumulation boundary the buffer is reduce-scattered in buckets of `reduce_bucket_size`
//!   elements; each rank keeps the mean gradient of its own slice (in place in the buffer).
//! - **Stage 2** keeps only its slice: after each micro-batch's backward the gradients are
//!   streamed into a bucket of `reduce_bucket_size` elements and every full bucket is
//!   reduce-scattered straight away ([`super::bucket`]).
//!
//! Then both clip by the global norm (one all-reduce of the slices' squared sums), step the
//! slice with the [`PartitionedOptimizer`] (m and v of the slice only), and all-gather the
//! updated slices in buckets of `allgather_bucket_size` elements into every rank's model.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType};
use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::zero::{
    FlatPartition, PartitionState, PartitionedKind, PartitionedOptimizer,
};

use super::ModelParallelNorm;
use super::bucket::{Bucket, Overlap};
use super::buffer::merge_presence;
use super::elem::{GradElem, add_into};
use super::scale::{Scaling, clip_across, clip_to, scale, sum_across};
use super::{
    GradSync, NvmeOffload, Reduced, SavedState, SyncOptions, caller_optimizer_keeps_no_masters,
};
use crate::checkpoint::{Loaded, cut_state, save_slice};
use crate::config::ZeroStage;
use crate::flat::{
    ParamLayout, for_each_grad, grads_from_flat, params_from_flat, params_range, params_to_flat,
    restore_params,
};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes, vec_bytes};
use crate::precision::cast_module;
use crate::{DeepSpeedError, Result, agreed};

/// A rank's gradient reduction and optimizer step at ZeRO stage 1 or 2, with gradient buffers
/// of `G` (f32, or f16 under fp16).
pub struct PartitionedSync<G: GradElem = f32> {
    /// Stage 2: gradients are reduce-scattered after every micro-batch.
    streams: bool,
    comm: Arc<dyn Communicator>,
    layout: ParamLayout,
    partition: FlatPartition,
    own: Range<usize>,
    /// Stage 1: the whole accumulated gradient; stage 2: empty.
    full: Vec<G>,
    /// Stage 2: this rank's accumulated slice; stage 1: empty (the slice lives in `full`).
    slice: Vec<G>,
    present: Vec<u8>,
    device: Option<Device>,
    micro_steps: u64,
    options: SyncOptions,
    /// The slice's optimizer; `None` when the caller steps whole tensors itself
    /// ([`for_whole_tensors`](Self::for_whole_tensors)).
    optim: Option<PartitionedOptimizer>,
    /// A collective that failed during a micro-batch (stage 2), reported by the next step.
    deferred: Option<DeepSpeedError>,
    meter: MemoryMeter,
    /// Mixed precision: the fp32 masters of this rank's slice, which the optimizer steps
    /// (the model holds them rounded to its 16-bit dtype).
    master: Option<Vec<f32>>,
    /// Tensor slicing: the norm's group.
    slices: Option<ModelParallelNorm>,
    /// Stage 2 under `overlap_comm`: the communication thread that reduces the buckets.
    overlap: Option<Overlap<G>>,
}

impl<G: GradElem> PartitionedSync<G> {
    /// The stage-1/2 state for `layout` on `comm`: a balanced flat partition stepped by the
    /// [`PartitionedOptimizer`] of `kind`.
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        kind: PartitionedKind,
    ) -> Self {
        let partition = FlatPartition::new(layout.numel, comm.world_size());
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let optim = PartitionedOptimizer::new(kind, &partition, comm.rank(), &sizes);
        Self::with_partition(layout, comm, options, partition, Some(optim))
    }

    /// The stage-1/2 state with a partition at tensor boundaries and no optimizer of its own:
    /// the caller steps this rank's whole tensors ([`GradSync::reduced_gradients`]) with any
    /// optimizer, e.g. the Learner's, then [`GradSync::finish_external_step`] all-gathers.
    pub fn for_whole_tensors(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
    ) -> Self {
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let partition = FlatPartition::tensor_aligned(&sizes, comm.world_size());
        Self::with_partition(layout, comm, options, partition, None)
    }

    fn with_partition(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        partition: FlatPartition,
        optim: Option<PartitionedOptimizer>,
    ) -> Self {
        let streams = options.stage == ZeroStage::Gradients;
        let own = partition.range(comm.rank());
        Self {
            full: if streams {
                Vec::new()
            } else {
                vec![G::default(); layout.numel]
            },
            slice: if streams {
                vec![G::default(); own.len()]
            } else {
                Vec::new()
            },
            present: vec![0; layout.slots.len()],
            streams,
            comm,
            layout,
            partition,
            own,
            device: None,
            micro_steps: 0,
            options: *options,
            optim,
            deferred: None,
            meter: MemoryMeter::default(),
            master: None,
            slices: None,
            overlap: None,
        }
    }

    /// DeepSpeed's `overlap_comm` at stage 2: from now on each full bucket is reduced on a
    /// communication thread of this rank while the rank goes on (with the rest of the
    /// micro-batch's gradients, then the next micro-batch's forward and backward); the reduced
    /// parts join the slice, in the same order as without it, when the next micro-batch
    /// accumulates or the step reduces. The rank holds one micro-batch's buckets until then
    /// (up to the whole gradient, where stage 2 alone holds one bucket).
    ///
    /// The caller must call no collective of this communicator between
    /// [`accumulate`](GradSync::accumulate) and [`reduce`](GradSync::reduce) other than
    /// through [`settle`](GradSync::settle) first. Stage 1 reduces once, at the boundary, and
    /// has nothing to overlap: it refuses.
    pub fn overlap_comm(&mut self) -> Result<()> {
        if !self.streams {
            return Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.overlap_comm".into(),
                reason: "stage 1 reduces the gradient once, at the accumulation boundary; \
                         overlap_comm applies to stage 2"
                    .into(),
            });
        }
        if self.overlap.is_none() {
            self.overlap = Some(Overlap::spawn(self.comm.clone())?);
        }
        Ok(())
    }

    /// Adds every bucket the communication thread reduced into the slice; its first failure
    /// is kept for the step.
    fn settle_overlap(&mut self) {
        if let Some(overlap) = &mut self.overlap
            && let Some(e) = overlap.settle(&mut self.slice, self.own.start)
        {
            self.deferred.get_or_insert(e);
        }
    }

    /// Moves the optimizer state of this rank's slice, with its fp32 masters read from
    /// `model` (still in f32), to its swap file (ZeRO-Infinity). Collective: the ranks agree
    /// on every rank's outcome, so that a full disk on one fails them all.
    pub fn offload_optimizer<M: Module>(&mut self, model: &M, nvme: &NvmeOffload) -> Result<()> {
        let local = (|| {
            let optim = self.optim.as_mut().ok_or_else(|| {
                DeepSpeedError::Data("this ZeRO sync has no optimizer to offload".into())
            })?;
            let masters = params_range(model, &self.layout, self.own.clone());
            optim.offload(nvme.store(self.comm.rank(), self.own.len())?, &masters)?;
            Ok(())
        })();
        agreed(self.comm.as_ref(), "optimizer offload", local)
    }

    /// Whether the optimizer state lives in a swap file.
    fn offloaded(&self) -> bool {
        self.optim.as_ref().is_some_and(|o| o.is_offloaded())
    }

    /// The fp32 masters of this rank's slice, where they are kept apart from the model
    /// (mixed precision, or an offloaded optimizer's swap file).
    fn masters(&self) -> Result<Option<Cow<'_, [f32]>>> {
        if let Some(m) = &self.master {
            return Ok(Some(Cow::Borrowed(m)));
        }
        match &self.optim {
            Some(o) if o.is_offloaded() => Ok(o.masters()?.map(Cow::Owned)),
            _ => Ok(None),
        }
    }

    /// This rank's slice of the flat parameters.
    pub fn own(&self) -> Range<usize> {
        self.own.clone()
    }

    /// The partition of the flat parameters.
    pub fn partition(&self) -> &FlatPartition {
        &self.partition
    }

    /// This rank's part of the reduced gradient.
    fn own_grads(&mut self) -> &mut [G] {
        if self.streams {
            &mut self.slice
        } else {
            &mut self.full[self.own.clone()]
        }
    }

    /// Stage 1's reduce-scatter of the whole buffer, bucket by bucket.
    fn reduce_scatter_full(&mut self, scaling: Scaling) -> Result<()> {
        let comm = self.comm.clone();
        let mut tmp = Vec::new();
        for range in bucket_ranges(self.layout.numel, self.options.reduce_bucket) {
            scaling.apply_pre(&mut self.full[range.clone()]);
            let mine = self.partition.own_in(comm.rank(), &range);
            tmp.resize(mine.len(), G::default());
            let counts = self.partition.counts_in(&range);
            let _span =
                tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
            if self.options.reduce_scatter {
                comm.reduce_scatter(&self.full[range], &mut tmp, &counts, ReduceOp::Sum)?;
                self.full[mine].copy_from_slice(&tmp);
            } else {
                comm.all_reduce(&mut self.full[range], ReduceOp::Sum)?;
            }
        }
        Ok(())
    }

    /// All-gathers every rank's updated slice (`own_params`, this rank's part) in buckets of
    /// `allgather_bucket_size` elements into `model`, and clears the gradient buffers for the
    /// next accumulation.
    fn gather<M: Module>(&mut self, model: M, own_params: &[f32]) -> Result<M> {
        let comm = self.comm.clone();
        let own = self.own.clone();
        let mut flat = vec![0.0f32; self.layout.numel];
        for range in bucket_ranges(self.layout.numel, self.options.gather_bucket) {
            let mine = self.partition.own_in(comm.rank(), &range);
            let counts = self.partition.counts_in(&range);
            let input = &own_params[mine.start - own.start..mine.end - own.start];
            let _span = tracing::debug_span!("all_gather_bucket", elems = range.len()).entered();
            comm.all_gather(input, &mut flat[range], &counts)?;
        }
        // The gathered parameters are assembled while the old ones are alive.
        let held = GradSync::<M>::held(self, &model);
        self.meter
            .observe(held, vec_bytes(&flat) + 4 * own_params.len() as u64);
        let model = params_from_flat(model, &self.layout, &flat);
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
        Ok(model)
    }

    fn reset(&mut self) {
        self.full.iter_mut().for_each(|g| *g = G::default());
        self.slice.iter_mut().for_each(|g| *g = G::default());
        self.micro_steps = 0;
    }
}

impl<G: GradElem> PartitionedSync<G> {
    /// This rank's part of the optimizer state `own` and of the whole parameters `params`
    /// (flat in this regime's layout) restored; the gradient buffers cleared.
    fn restore_own(&mut self, own: PartitionState, params: &[f32]) -> Result<()> {
        match &mut self.optim {
            Some(o) => {
                let masters = o.is_offloaded().then(|| &params[self.own.clone()]);
                o.restore(own, masters)?
            }
            None => return Err(crate::checkpoint::no_state_to_restore()),
        }
        if self.master.is_some() {
            self.master = Some(params[self.own.clone()].to_vec());
        }
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
        Ok(())
    }

    /// Restores the whole parameters `params` and optimizer `state` of this regime's tensors
    /// (flat in its layout) into `model` and this rank's slice, keeping the parameters' ids:
    /// a regime over part of a model (expert parallelism's) loads a checkpoint this way.
    pub fn restore_whole<M: Module>(
        &mut self,
        model: M,
        params: &[f32],
        state: &PartitionState,
    ) -> Result<M> {
        check_whole(&self.layout, params, state)?;
        self.restore_own(cut_state(state, std::slice::from_ref(&self.own)), params)?;
        Ok(params_from_flat(model, &self.layout, params))
    }
}

/// Refuses whole parameters or state that do not fit `layout`.
pub(crate) fn check_whole(
    layout: &ParamLayout,
    params: &[f32],
    state: &PartitionState,
) -> Result<()> {
    let (n, t) = (layout.numel, layout.slots.len());
    if params.len() != n || state.m.len() != n || state.v.len() != n || state.steps.len() != t {
        return Err(DeepSpeedError::Checkpoint(format!(
            "a regime of {t} tensors and {n} elements got {} parameters and a state of {} \
             tensors and {} elements",
            params.len(),
            state.steps.len(),
            state.m.len()
        )));
    }
    Ok(())
}

impl<M: Module, G: GradElem> GradSync<M> for PartitionedSync<G> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Adds one micro-batch's gradients: into the whole buffer at stage 1; at stage 2
    /// reduce-scattered bucket by bucket into this rank's slice (a collective).
    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        // The previous micro-batch's buckets were reduced during this one's forward and
        // backward (`overlap_comm`).
        self.settle_overlap();
        self.micro_steps += 1;
        let present = &mut self.present;
        let transient = if !self.streams {
            let (full, layout) = (&mut self.full, &self.layout);
            for_each_grad(model, layout, grads, &mut self.device, |i, values| {
                if let Some(values) = values {
                    let s = &layout.slots[i];
                    add_into(&mut full[s.offset..s.offset + s.numel], &values);
                    present[i] = 1;
                }
            })
        } else {
            let cap = match self.options.reduce_bucket {
                0 => self.layout.numel,
                b => b.min(self.layout.numel),
            };
            let mut bucket = Bucket {
                comm: self.comm.as_ref(),
                partition: &self.partition,
                own_start: self.own.start,
                slice: &mut self.slice,
                buf: Vec::with_capacity(cap),
                reduce_scatter: self.options.reduce_scatter,
                cap,
                start: 0,
                pre: self.options.pre_factor(),
                error: self.deferred.take(),
                peak_elems: 0,
                overlap: self.overlap.as_mut(),
            };
            let layout = &self.layout;
            let tensors =
                for_each_grad(
                    model,
                    layout,
                    grads,
                    &mut self.device,
                    |i, values| match values {
                        Some(values) => {
                            present[i] = 1;
                            bucket.push(&values);
                        }
                        None => bucket.push_zeros(layout.slots[i].numel),
                    },
                );
            bucket.flush();
            self.deferred = bucket.error;
            tensors + (size_of::<G>() * bucket.peak_elems) as u64
        };
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, transient);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    fn settle(&self) {
        if let Some(overlap) = &self.overlap {
            overlap.quiesce();
        }
    }

    /// Ends the accumulation: reduce-scatters (stage 1; stage 2 did it per micro-batch),
    /// leaves this rank's slice of the mean gradient, and clips it by the global norm.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        self.settle_overlap();
        if let Some(e) = self.deferred.take() {
            self.reset();
            return Err(e);
        }
        let refuse = (!self.options.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(self.comm.as_ref(), &mut self.present, refuse) {
            self.reset();
            return Err(e);
        }
        let scaling = Scaling::mean(
            self.options.predivide,
            self.comm.world_size(),
            self.micro_steps,
        )
        .unscaled(loss_scale);
        if !self.streams {
            self.reduce_scatter_full(scaling)?;
        }
        let (comm, clip) = (self.comm.clone(), self.options.clip);
        let (slices, start) = (self.slices.clone(), self.own.start);
        let grads = self.own_grads();
        scaling.apply_post(grads);
        let norm = match slices {
            Some(slices) => {
                let data = sum_across(comm.as_ref(), slices.host_sq(grads, start))?;
                let norm = slices.across(data)?.sqrt();
                clip_to(grads, norm, clip);
                norm
            }
            None => clip_across(comm.as_ref(), grads, clip)?,
        };
        Ok(Reduced::global(norm))
    }

    fn scale_reduced(&mut self, factor: f32) -> Result<()> {
        scale(self.own_grads(), factor);
        Ok(())
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        self.slices = Some(norm);
        Ok(())
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let comm = self.comm.clone();
        let keep = self.master.is_some();
        let offloaded = self.offloaded();
        let mut params = match self.master.take() {
            Some(master) => master,
            // The swapped optimizer hands out its masters.
            None if offloaded => vec![0.0f32; self.own.len()],
            None => params_range(&model, &self.layout, self.own.clone()),
        };
        {
            let _span = tracing::debug_span!("optimizer_step", rank = comm.rank()).entered();
            let grads: &[G] = if self.streams {
                &self.slice
            } else {
                &self.full[self.own.clone()]
            };
            // A 16-bit slice is stepped through a transient fp32 copy.
            let grads = G::widen_all(grads);
            if let Cow::Owned(widened) = &grads {
                let held = GradSync::<M>::held(self, &model);
                self.meter.observe(held, vec_bytes(widened));
            }
            let stepped: Result<()> = match self.optim.as_mut() {
                Some(optim) => optim
                    .step(comm.as_ref(), &mut params, &grads, &self.present, lr)
                    .map_err(Into::into),
                None => Err(DeepSpeedError::Data(
                    "this ZeRO sync has no optimizer; step its tensors and call \
                     finish_external_step"
                        .into(),
                )),
            };
            // A swap file can fail on one rank: all agree before the gather.
            let stepped = match offloaded {
                true => agreed(comm.as_ref(), "offloaded optimizer step", stepped),
                false => stepped,
            };
            if let Err(e) = stepped {
                if keep {
                    self.master = Some(params);
                }
                return Err(e);
            }
        }
        let model = self.gather(model, &params);
        if keep {
            self.master = Some(params);
        }
        model
    }

    /// The gradients of this rank's tensors (those that had one on any rank), with a
    /// [tensor-aligned](PartitionedSync::for_whole_tensors) partition.
    fn discard(&mut self) {
        self.settle_overlap();
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    fn reduced_gradients(&mut self, model: &M) -> Result<GradientsParams> {
        let grads: &[G] = if self.streams {
            &self.slice
        } else {
            &self.full[self.own.clone()]
        };
        let grads = G::widen_all(grads);
        let device = self.device.clone().unwrap_or_default();
        Ok(grads_from_flat(
            model,
            &self.layout,
            &grads,
            self.own.start,
            &self.present,
            &device,
        ))
    }

    fn finish_external_step(&mut self, model: &M) -> Result<Option<M>> {
        let own = params_range(model, &self.layout, self.own.clone());
        self.gather(model.clone(), &own).map(Some)
    }

    /// All parameters, the gradient buffer (whole at stage 1, a slice at stage 2) and the
    /// slice's optimizer state.
    fn held(&self, model: &M) -> ModelStateBytes {
        let masters = self.master.as_ref().map_or(0, vec_bytes);
        ModelStateBytes {
            params: param_bytes(model),
            grads: vec_bytes(&self.full)
                + vec_bytes(&self.slice)
                + self.overlap.as_ref().map_or(0, Overlap::held_bytes),
            optimizer: self.optim.as_ref().map_or(0, |o| o.state_bytes()) + masters,
            offloaded: self.optim.as_ref().map_or(0, |o| o.disk_bytes()),
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        if self.optim.is_none() {
            return Err(caller_optimizer_keeps_no_masters(dtype));
        }
        // An offloaded optimizer keeps the masters in its swap file already.
        if !self.offloaded() {
            self.master = Some(params_range(&model, &self.layout, self.own.clone()));
        }
        Ok(cast_module(model, dtype))
    }

    /// With masters, every rank gathers them (a collective), so that checkpoints hold fp32
    /// values, not the rounded working copy.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        GradSync::<M>::settle(self);
        if self.master.is_none() && !self.offloaded() {
            return Ok(wanted.then(|| params_to_flat(model, &self.layout)));
        }
        // Reading a swap file can fail on one rank: all agree before the gather.
        let master = match self.master.is_some() {
            true => self.masters()?,
            false => agreed(self.comm.as_ref(), "read masters", self.masters())?,
        };
        let master = master.ok_or_else(|| DeepSpeedError::Data("no masters".into()))?;
        let mut flat = vec![0.0f32; self.layout.numel];
        let counts: Vec<usize> = (0..self.comm.world_size())
            .map(|r| self.partition.range(r).len())
            .collect();
        self.comm.all_gather(&master, &mut flat, &counts)?;
        Ok(wanted.then_some(flat))
    }

    fn swap(&self) -> Option<burn_deepspeed_strategies::swap::SwapSummary> {
        self.optim.as_ref().and_then(|o| o.swap_summary())
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, _root: bool) -> Result<SavedState> {
        save_slice(self.optim.as_ref())
    }

    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        // Buckets still being reduced belong to the gradient the load replaces.
        self.settle_overlap();
        let model = restore_params(model, &self.layout, &loaded.meta.param_ids, &loaded.params);
        let layout = ParamLayout::of(&model);
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let state = loaded.slice_state(&sizes, std::slice::from_ref(&self.own))?;
        self.restore_own(state, &loaded.params)?;
        self.layout = layout;
        Ok(model)
    }

    fn whole_moments(&self) -> Result<Option<burn_deepspeed_strategies::zero::PartitionState>> {
        GradSync::<M>::settle(self);
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        crate::checkpoint::gather_moments(self.comm.as_ref(), self.optim.as_ref(), &sizes, 1)
    }
}
