//! [`PartitionedSync`]: ZeRO stages 0-2 (arXiv 1910.02054 §5) stepping a flat optimizer,
//! written once over a [`GradStore`] and its place: host memory ([`HostGrads`]) or the model's
//! device ([`DeviceGrads`]).
//!
//! Per step: each micro-batch's gradients are accumulated by the store (stage 2 reduces them
//! to this rank's slice as they come), the reduction leaves this rank's part of the mean
//! gradient (the whole at stage 0, its slice at stages 1-2), the part is clipped by the
//! global norm (the slices' squared sums added over the ranks, and over the model-parallel
//! groups under tensor slicing or pipelining), the [`FlatOptimizer`] steps this rank's slice
//! of the fp32 parameters (m and v of the slice only), and every rank's stepped slice is
//! all-gathered (in buckets of `allgather_bucket_size` elements on the host) and written back
//! into the model.
//!
//! In mixed precision ([`GradSync::keep_masters`]) the rank keeps fp32 masters of its slice,
//! which the optimizer steps; the model becomes their 16-bit working copy and receives them
//! rounded. Under ZeRO-Infinity's optimizer offload (host, [`offload_optimizer`]) the masters,
//! m and v of the slice live in a swap file instead.
//!
//! [`offload_optimizer`]: PartitionedSync::offload_optimizer

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace, Place};
use burn_deepspeed_strategies::zero::{FlatPartition, PartitionState, PartitionedKind};

use super::buffer::merge_presence;
use super::grads::{Cut, GradStore, Part, reduce_and_clip, step_part};
use super::scale::Scaling;
use super::{
    DeviceFlatOptimizer, DeviceGrads, FlatOptimizer, GradElem, GradSync, HostFlatOptimizer,
    HostGrads, ModelParallelNorm, ModelPlace, NvmeOffload, Reduced, SavedState, StagedLoad,
    SyncOptions, caller_optimizer_keeps_no_masters,
};
use crate::checkpoint::{
    Loaded, cut_state, gather_state, no_state_to_restore, partition_state_bytes,
    partition_state_from_bytes,
};
use crate::flat::{ParamLayout, grads_from_flat, params_from_flat, restore_params};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::precision::cast_module;
use crate::{DeepSpeedError, Result, agreed};

/// A rank's gradient reduction and optimizer step at ZeRO stages 0-2, its gradient in the
/// store `S` (host buffers of f32 or f16, or a device tensor).
pub struct PartitionedSync<S: GradStore = HostGrads<f32>> {
    place: S::Place,
    grads: S,
    cut: Cut,
    layout: ParamLayout,
    partition: FlatPartition,
    own: Range<usize>,
    options: SyncOptions,
    /// The slice's optimizer; `None` when the caller steps whole tensors itself
    /// ([`for_whole_tensors`](PartitionedSync::for_whole_tensors)).
    optim: Option<<S::Place as ModelPlace>::Optim>,
    present: Vec<u8>,
    micro_steps: u64,
    /// A collective that failed during a micro-batch (stage 2), reported by the next step.
    deferred: Option<DeepSpeedError>,
    meter: MemoryMeter,
    /// Mixed precision: the fp32 masters of this rank's slice, which the optimizer steps
    /// (the model holds them rounded to its 16-bit dtype).
    master: Option<<S::Place as Place>::Buf>,
    /// Tensor slicing: the norm's group.
    slices: Option<ModelParallelNorm>,
}

impl<G: GradElem> PartitionedSync<HostGrads<G>> {
    /// Stage 0, 1 or 2 (`cut`) of `layout` on `comm` in host memory: a balanced flat partition
    /// (everything at stage 0) stepped by the
    /// [`PartitionedOptimizer`](burn_deepspeed_strategies::zero::PartitionedOptimizer) of `kind`.
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        cut: Cut,
        kind: PartitionedKind,
    ) -> Result<Self> {
        let part = Part::balanced(cut, layout.numel, comm.world_size(), comm.rank());
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        // Stage 0: every rank steps whole tensors, whose LAMB norms add over no other rank.
        let (rank, norms) = match cut {
            Cut::Nothing => (0, crate::grid::alone()?),
            _ => (comm.rank(), comm.clone()),
        };
        let optim = HostFlatOptimizer::new(kind, &part.partition, rank, &sizes, norms);
        Ok(Self::host(layout, comm, options, part, Some(optim)))
    }

    /// Stage 1 or 2 (`cut`) with a partition at tensor boundaries and no optimizer of its own:
    /// the caller steps this rank's whole tensors ([`GradSync::reduced_gradients`]) with any
    /// optimizer, e.g. the Learner's, then [`GradSync::finish_external_step`] all-gathers.
    pub fn for_whole_tensors(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        cut: Cut,
    ) -> Self {
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let part = Part::tensor_aligned(cut, &sizes, comm.world_size(), comm.rank());
        Self::host(layout, comm, options, part, None)
    }

    fn host(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        part: Part,
        optim: Option<HostFlatOptimizer>,
    ) -> Self {
        let grads = HostGrads::new(comm.clone(), &part, options);
        Self::with(HostPlace::new(comm), grads, layout, part, options, optim)
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
        self.grads.overlap_comm()
    }

    /// Moves the optimizer state of this rank's slice, with its fp32 masters read from
    /// `model` (still in f32), to its swap file (ZeRO-Infinity). Collective: the ranks agree
    /// on every rank's outcome, so that a full disk on one fails them all.
    pub fn offload_optimizer<M: Module>(&mut self, model: &M, nvme: &NvmeOffload) -> Result<()> {
        let comm = self.place.communicator().clone();
        let local = (|| {
            let optim = self.optim.as_mut().ok_or_else(|| {
                DeepSpeedError::Data("this ZeRO sync has no optimizer to offload".into())
            })?;
            let masters = self
                .place
                .params_range(model, &self.layout, self.own.clone());
            let store = nvme.store(comm.rank(), self.own.len())?;
            optim.inner.offload(store, &masters)?;
            Ok(())
        })();
        agreed(comm.as_ref(), "optimizer offload", local)
    }
}

impl PartitionedSync<DeviceGrads> {
    /// Stages 0-2 (`cut`) of `layout` with every buffer in `place` (the model's device),
    /// stepping `kind` (the fused Adam/AdamW kernel or LAMB by device ops).
    pub fn on_device(
        place: DevicePlace,
        layout: ParamLayout,
        options: &SyncOptions,
        cut: Cut,
        kind: PartitionedKind,
    ) -> Self {
        let part = Part::balanced(cut, layout.numel, place.world_size(), place.rank());
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let across = cut != Cut::Nothing;
        let optim = DeviceFlatOptimizer::new(kind, &place, part.own.clone(), &sizes, across);
        let grads = DeviceGrads::new(&place, &part, options.pre_factor(), options.grad_dtype);
        Self::with(place, grads, layout, part, options, Some(optim))
    }
}

impl<S: GradStore> PartitionedSync<S> {
    fn with(
        place: S::Place,
        grads: S,
        layout: ParamLayout,
        part: Part,
        options: &SyncOptions,
        optim: Option<<S::Place as ModelPlace>::Optim>,
    ) -> Self {
        Self {
            present: vec![0; layout.slots.len()],
            place,
            grads,
            cut: part.cut,
            layout,
            partition: part.partition,
            own: part.own,
            options: *options,
            optim,
            micro_steps: 0,
            deferred: None,
            meter: MemoryMeter::default(),
            master: None,
            slices: None,
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

    /// Adds what a communication thread reduced into the gradient; its first failure is
    /// kept for the step.
    fn settle_overlap(&mut self) {
        if let Some(e) = self.grads.settle() {
            self.deferred.get_or_insert(e);
        }
    }

    /// Whether the optimizer state lives in a swap file.
    fn offloaded(&self) -> bool {
        self.optim.as_ref().is_some_and(|o| o.is_offloaded())
    }

    /// The fp32 masters of this rank's slice, where they are kept apart from the model
    /// (mixed precision, or an offloaded optimizer's swap file).
    fn masters(&self) -> Result<Option<Cow<'_, <S::Place as Place>::Buf>>> {
        if let Some(m) = &self.master {
            return Ok(Some(Cow::Borrowed(m)));
        }
        match &self.optim {
            Some(o) if o.is_offloaded() => {
                Ok(o.masters()?.map(|m| Cow::Owned(self.place.write(m))))
            }
            _ => Ok(None),
        }
    }

    /// Every rank's slice `own_params` joined into `model`; clears the gradient for the next
    /// accumulation.
    fn gather<M: Module>(&mut self, model: M, own_params: &<S::Place as Place>::Buf) -> Result<M> {
        let flat = match self.cut {
            Cut::Nothing => own_params.clone(),
            _ => {
                (self.place).all_gather(own_params, &self.partition, self.options.gather_bucket)?
            }
        };
        // The gathered parameters are assembled while the old ones are alive.
        let held = GradSync::<M>::held(self, &model);
        let own = self.place.len(own_params);
        self.meter
            .observe(held, 4 * (self.layout.numel + own) as u64);
        let model = self.place.write_back(model, &self.layout, &flat);
        self.reset();
        Ok(model)
    }

    fn reset(&mut self) {
        self.grads.reset();
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    /// Refuses this rank's part `own` of an optimizer state, or whole parameters `params`
    /// (flat in this regime's layout), that [`restore_own`](Self::restore_own) could not
    /// take.
    fn check_own(&self, own: &PartitionState, params: &[f32]) -> Result<()> {
        let optim = self.optim.as_ref().ok_or_else(no_state_to_restore)?;
        if params.len() != self.layout.numel {
            return Err(DeepSpeedError::Checkpoint(format!(
                "{} parameters for a regime of {}",
                params.len(),
                self.layout.numel
            )));
        }
        let masters = optim.is_offloaded().then(|| &params[self.own.clone()]);
        optim.check_restore(own, masters)
    }

    /// This rank's part of the optimizer state `own` and of the whole parameters `params`
    /// restored, as [`check_own`](Self::check_own) passed them; the gradient cleared.
    fn restore_own(&mut self, own: PartitionState, params: &[f32]) -> Result<()> {
        let optim = self.optim.as_mut().ok_or_else(no_state_to_restore)?;
        let masters = optim.is_offloaded().then(|| &params[self.own.clone()]);
        optim.restore(&self.place, own, masters)?;
        if self.master.is_some() {
            self.master = Some(self.place.write(params[self.own.clone()].to_vec()));
        }
        self.reset();
        Ok(())
    }

    /// Checks the whole parameters `params` and optimizer `state` of this regime's tensors
    /// (flat in its layout) and cuts this rank's part of the state, changing nothing: a
    /// regime over part of a model (expert parallelism's) stages a load this way.
    pub fn stage_whole(&self, params: &[f32], state: &PartitionState) -> Result<StagedLoad> {
        check_whole(&self.layout, params, state)?;
        let own = cut_state(state, std::slice::from_ref(&self.own));
        self.check_own(&own, params)?;
        Ok(StagedLoad::Flat(own))
    }

    /// Puts a load [`stage_whole`](Self::stage_whole) prepared in place: `params` into
    /// `model` and this rank's slice, keeping the parameters' ids.
    pub fn commit_whole<M: Module>(
        &mut self,
        model: M,
        params: &[f32],
        staged: StagedLoad,
    ) -> Result<M> {
        let StagedLoad::Flat(own) = staged else {
            return Err(StagedLoad::mismatch("a partitioned regime"));
        };
        self.restore_own(own, params)?;
        Ok(params_from_flat(model, &self.layout, params))
    }

    /// The optimizer state a checkpoint of this regime holds for this rank: stage 0 reads the
    /// whole flat state (`optim.bin`), stages 1-2 cut this rank's slice again from the saved
    /// slices (any world size).
    fn loaded_state(&self, loaded: &Loaded) -> Result<PartitionState> {
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        if self.cut != Cut::Nothing {
            return loaded.slice_state(&sizes, std::slice::from_ref(&self.own));
        }
        let n = self.layout.numel;
        partition_state_from_bytes(&loaded.replicated_state()?, "optim.bin")
            .ok()
            .filter(|s| s.m.len() == n && s.v.len() == n && s.steps.len() == sizes.len())
            .ok_or_else(|| {
                DeepSpeedError::Checkpoint(format!(
                    "optim.bin is not the flat Adam state of this model's {n} elements in {} \
                     tensors, which stage 0 resumes from in 16-bit or on a device (a stage-0 \
                     fp32 run on the host, Flex, saves Burn's optimizer record instead: resume \
                     such a checkpoint in fp32 on the host)",
                    sizes.len()
                ))
            })
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

impl<M: Module, S: GradStore> GradSync<M> for PartitionedSync<S> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        // The previous micro-batch's buckets were reduced during this one's forward and
        // backward (`overlap_comm`).
        self.settle_overlap();
        self.micro_steps += 1;
        let (place, layout) = (&self.place, &self.layout);
        let (present, deferred) = (&mut self.present, &mut self.deferred);
        let transient = (self.grads).accumulate(place, model, layout, grads, present, deferred);
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, transient);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    fn settle(&self) {
        self.grads.quiesce();
    }

    /// Ends the accumulation: reduces what stage 2 did not already, leaves this rank's part of
    /// the mean gradient, and clips it by the global norm.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        self.settle_overlap();
        if let Some(e) = self.deferred.take() {
            self.reset();
            return Err(e);
        }
        let comm = self.place.comm();
        let refuse =
            (self.cut != Cut::Nothing && !self.options.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(comm, &mut self.present, refuse) {
            self.reset();
            return Err(e);
        }
        let world = self.place.world_size();
        let scaling =
            Scaling::mean(self.options.predivide, world, self.micro_steps).unscaled(loss_scale);
        // The parts' squares add over the ranks; at stage 0 every rank holds the whole.
        let parted = self.cut != Cut::Nothing;
        let (slices, clip) = (self.slices.as_ref(), self.options.clip);
        let norm = reduce_and_clip(&mut self.grads, &self.place, scaling, parted, slices, clip)?;
        Ok(Reduced::global(norm))
    }

    fn scale_reduced(&mut self, factor: f32) -> Result<()> {
        self.grads.scale_own(&self.place, factor);
        Ok(())
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        self.grads.model_parallel(&self.place, &norm);
        self.slices = Some(norm);
        Ok(())
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let keep = self.master.is_some();
        let offloaded = self.offloaded();
        let mut params = match self.master.take() {
            Some(master) => master,
            // The swapped optimizer hands out its masters.
            None if offloaded => self.place.zeros(self.own.len()),
            None => (self.place).params_range(&model, &self.layout, self.own.clone()),
        };
        let (optim, present) = (self.optim.as_mut(), &self.present);
        match step_part(optim, &self.place, &self.grads, &mut params, present, lr) {
            Ok(widened) => {
                // A 16-bit slice is stepped through a transient fp32 copy.
                let held = GradSync::<M>::held(self, &model);
                self.meter.observe(held, widened);
            }
            Err(e) => {
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

    fn discard(&mut self) {
        self.settle_overlap();
        self.reset();
    }

    /// The gradients of this rank's tensors (those that had one on any rank), with a
    /// [tensor-aligned](PartitionedSync::for_whole_tensors) partition.
    fn reduced_gradients(&mut self, model: &M) -> Result<GradientsParams> {
        let grads = self.grads.own()?;
        let values = self.place.host_view(&grads);
        let device = self.grads.device().unwrap_or_default();
        let start = self.own.start;
        let grads = grads_from_flat(model, &self.layout, &values, start, &self.present, &device);
        Ok(grads)
    }

    fn finish_external_step(&mut self, model: &M) -> Result<Option<M>> {
        let own = (self.place).params_range(model, &self.layout, self.own.clone());
        self.gather(model.clone(), &own).map(Some)
    }

    /// All parameters, the gradient (whole at stages 0-1 until reduced, a slice at stage 2)
    /// and the slice's optimizer state.
    fn held(&self, model: &M) -> ModelStateBytes {
        let masters = self
            .master
            .as_ref()
            .map_or(0, |m| 4 * self.place.len(m) as u64);
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.grads.bytes(),
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
            let own = self.own.clone();
            self.master = Some(self.place.params_range(&model, &self.layout, own));
        }
        Ok(cast_module(model, dtype))
    }

    /// With masters, every rank gathers them (a collective), so that checkpoints hold fp32
    /// values, not the rounded working copy.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        GradSync::<M>::settle(self);
        if self.master.is_none() && !self.offloaded() {
            let read = || {
                self.place
                    .read(&self.place.flat_params(model, &self.layout))
            };
            return Ok(wanted.then(read));
        }
        // Reading a swap file can fail on one rank: all agree before the gather.
        let master = match self.master.is_some() {
            true => self.masters()?,
            false => agreed(self.place.comm(), "read masters", self.masters())?,
        };
        let master = master.ok_or_else(|| DeepSpeedError::Data("no masters".into()))?;
        let whole = match self.cut {
            Cut::Nothing => master.into_owned(),
            _ => self.place.all_gather(&master, &self.partition, 0)?,
        };
        Ok(wanted.then(|| self.place.read(&whole)))
    }

    fn swap(&self) -> Option<burn_deepspeed_strategies::swap::SwapSummary> {
        self.optim.as_ref().and_then(|o| o.swap_summary())
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    /// Stage 0: rank 0 writes the whole state; stages 1-2: every rank its slice.
    fn save(&self, root: bool) -> Result<SavedState<'_>> {
        let optim = self.optim.as_ref().ok_or_else(no_state_to_restore)?;
        if self.cut == Cut::Nothing {
            let bytes = match root {
                true => Some(partition_state_bytes(&optim.export(&self.place)?)),
                false => None,
            };
            return Ok(SavedState::Replicated(bytes));
        }
        Ok(SavedState::Slice(optim.export_file(&self.place)?))
    }

    /// Everything fallible (reading and restoring the optimizer state) happens before the
    /// parameters are replaced.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad> {
        let state = self.loaded_state(loaded)?;
        self.check_own(&state, loaded.params()?)?;
        Ok(StagedLoad::Flat(state))
    }

    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M> {
        let StagedLoad::Flat(state) = staged else {
            return Err(StagedLoad::mismatch("a partitioned regime"));
        };
        // Buckets still being reduced belong to the gradient the load replaces.
        self.settle_overlap();
        // Read by `stage_load`: kept in `loaded`.
        let params = loaded.params()?;
        self.restore_own(state, params)?;
        let model = restore_params(model, &self.layout, &loaded.meta.param_ids, params);
        self.layout = ParamLayout::of(&model);
        Ok(model)
    }

    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        GradSync::<M>::settle(self);
        let Some(optim) = &self.optim else {
            return Ok(None);
        };
        let state = optim.export(&self.place)?;
        if self.cut == Cut::Nothing {
            return Ok(Some(state));
        }
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        gather_state(self.place.comm(), &state, &sizes, 1).map(Some)
    }
}
