//! [`ShardedSync`]: ZeRO stage 3 (arXiv 1910.02054 §5.3), written once over a [`GradStore`]
//! and its place: host memory ([`HostShards`]) or the model's device ([`DeviceShards`]).
//!
//! Parameters are stored as per-rank chunks ([`crate::zero3`]); forward and backward gather
//! them through a [`GatherGroup`], and the backward of each gather reduce-scatters the
//! tensor's gradient, so after a micro-batch's backward a rank holds only the gradients of
//! its chunks. At the accumulation boundary the persistent (whole) tensors' gradients are
//! all-reduced, the rank's gradients are averaged and clipped by the global norm, the
//! [`FlatOptimizer`] steps the rank's pieces (its fp32 masters under fp16/bf16), and the new
//! chunks are written back into the module. Only the persistent tensors are all-gathered
//! after the step. How the module is read and rewritten lives in `shards.rs` beside this file.
//!
//! On the host, ZeRO-Infinity moves the optimizer state to a swap file
//! ([`offload_optimizer`](ShardedSync::offload_optimizer)) and the pieces to a parameter
//! store ([`shard_offloaded`](ShardedSync::shard_offloaded), `offload_param`).

use std::borrow::Cow;
use std::slice;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace, Place};
use burn_deepspeed_strategies::zero::{PartitionState, PartitionedKind, ShardPlan};

use super::buffer::merge_presence;
use super::grads::{GradStore, reduce_and_clip, step_part};
use super::scale::Scaling;
use super::{
    DeviceFlatOptimizer, DeviceShards, FlatOptimizer, GradElem, GradSync, HostFlatOptimizer,
    HostShards, ModelParallelNorm, ModelPlace, ParamSink, Reduced, SavedState, ShardCut,
    StagedLoad, SyncOptions, caller_optimizer_keeps_no_masters,
};
use crate::checkpoint::{Loaded, gather_state, no_state_to_restore};
use crate::flat::{ParamLayout, set_param_ids};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::precision::cast_module;
use crate::zero3::{
    GatherGroup, GatherStats, Hierarchy, ParamStore, ParamStoreSummary, shard_module,
};
use crate::{DeepSpeedError, Result, agreed};

/// A rank's stage-3 state: the gather group, its gradient in the store `S` (host buffers of
/// f32 or f16, or device tensors) and the optimizer of its pieces.
pub struct ShardedSync<S: GradStore = HostShards<f32>> {
    pub(super) place: S::Place,
    pub(super) grads: S,
    pub(super) layout: ParamLayout,
    pub(super) group: Arc<GatherGroup>,
    pub(super) cut: ShardCut,
    /// ZeRO-Infinity's `offload_param`: the store of the partitioned tensors' pieces (the
    /// module holds empty placeholders for them).
    pub(super) store: Option<Arc<ParamStore>>,
    pub(super) present: Vec<u8>,
    pub(super) micro_steps: u64,
    pub(super) options: SyncOptions,
    /// `None` when the caller steps the pieces with its own optimizer
    /// ([`for_learner`](ShardedSync::for_learner)).
    pub(super) optim: Option<<S::Place as ModelPlace>::Optim>,
    pub(super) meter: MemoryMeter,
    /// Mixed precision: the fp32 masters of this rank's pieces (buffer order), which the
    /// optimizer steps; the module's chunks hold them rounded to its 16-bit dtype.
    pub(super) master: Option<<S::Place as Place>::Buf>,
    /// Tensor slicing: the norm's groups.
    pub(super) slices: Option<ModelParallelNorm>,
    /// A failure of the store during a micro-batch, reported by the next step.
    pub(super) deferred: Option<DeepSpeedError>,
}

/// DeepSpeed's stage-3 cut of the tensors of `layout` over `world` ranks under the
/// persistence thresholds of `options`.
pub fn shard_plan(layout: &ParamLayout, options: &SyncOptions, world: usize) -> ShardPlan {
    let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
    ShardPlan::new(
        &sizes,
        world,
        options.param_persistence,
        options.model_persistence,
    )
}

/// The stage-3 gather group of a model of `layout` on `comm`: DeepSpeed's cut
/// ([`shard_plan`]) and the prefetch, live-parameter, pre-division, fetch and qwZ options.
fn gather_group(
    layout: &ParamLayout,
    comm: Arc<dyn Communicator>,
    options: &SyncOptions,
) -> Arc<GatherGroup> {
    let plan = shard_plan(layout, options, comm.world_size());
    let group = GatherGroup::new(
        comm,
        plan,
        layout.slots.iter().map(|s| s.shape.clone()).collect(),
        options.prefetch_bucket,
        options.max_live,
        options.pre_factor(),
        options.fetch_by_all_reduce,
    );
    group.set_quantized_weights(options.quantized_weights);
    group
}

impl<G: GradElem> ShardedSync<HostShards<G>> {
    /// The stage-3 state for a model of `layout` (whole shapes) on `comm` in host memory,
    /// stepped by the [`PartitionedOptimizer`](burn_deepspeed_strategies::zero::PartitionedOptimizer)
    /// of `kind`.
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        kind: PartitionedKind,
    ) -> Self {
        let mut sync = Self::for_learner(layout, comm.clone(), options);
        let (segments, own_len) = (sync.cut.segments.clone(), sync.cut.own_len);
        let tensors = sync.layout.slots.len();
        let optim = HostFlatOptimizer::over_segments(kind, segments, own_len, tensors, comm);
        sync.optim = Some(optim);
        sync
    }

    /// The stage-3 state with no optimizer of its own: the caller steps this rank's chunks
    /// and the persistent tensors ([`GradSync::reduced_gradients`]) with any element-wise
    /// optimizer, e.g. the `Learner`'s, then calls [`GradSync::finish_external_step`].
    pub fn for_learner(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
    ) -> Self {
        let group = gather_group(&layout, comm.clone(), options);
        let cut = ShardCut::of(group.plan(), comm.rank());
        let grads = HostShards::new(group.clone(), cut.clone());
        let place = HostPlace::new(comm);
        Self::with(place, grads, layout, group, cut, options, None)
    }
}

impl ShardedSync<DeviceShards> {
    /// Stage 3 of a model of `layout` with every buffer in `place` (the model's device):
    /// the gathers and reduce-scatters move the device's buffers through its collectives,
    /// and `kind` steps the pieces (the fused Adam/AdamW kernel or LAMB by device ops).
    pub fn on_device(
        place: DevicePlace,
        layout: ParamLayout,
        options: &SyncOptions,
        kind: PartitionedKind,
    ) -> Self {
        let group = gather_group(&layout, place.communicator().clone(), options);
        group.set_device_collectives(place.collectives().clone());
        let cut = ShardCut::of(group.plan(), place.rank());
        let (pieces, tensors) = (cut.pieces(), layout.slots.len());
        let optim =
            DeviceFlatOptimizer::over_pieces(kind, &place, pieces, cut.own_len, tensors, true);
        let grads = DeviceShards::new(&place, group.clone(), cut.clone(), options.grad_dtype);
        Self::with(place, grads, layout, group, cut, options, Some(optim))
    }
}

impl<S: GradStore> ShardedSync<S> {
    fn with(
        place: S::Place,
        grads: S,
        layout: ParamLayout,
        group: Arc<GatherGroup>,
        cut: ShardCut,
        options: &SyncOptions,
        optim: Option<<S::Place as ModelPlace>::Optim>,
    ) -> Self {
        Self {
            present: vec![0; layout.slots.len()],
            place,
            grads,
            layout,
            group,
            cut,
            store: None,
            micro_steps: 0,
            options: *options,
            optim,
            meter: MemoryMeter::default(),
            master: None,
            slices: None,
            deferred: None,
        }
    }

    /// ZeRO++'s hpZ with nodes of `size` consecutive ranks: the gather group keeps secondary
    /// slices inside the node and serves the backward's gathers from them. Collective (it
    /// splits the world into nodes); a world that `size` does not divide is refused by name.
    pub fn secondary_partition(&self, size: usize) -> Result<()> {
        let comm = self.place.comm();
        if size <= 1 {
            return Ok(());
        }
        if !comm.world_size().is_multiple_of(size) {
            return Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.zero_hpz_partition_size".into(),
                reason: format!(
                    "{size} ranks per node do not divide the world of {}; give the number of \
                     ranks on each node",
                    comm.world_size()
                ),
            });
        }
        let node = comm.split(comm.rank() / size)?;
        self.group.set_secondary(node);
        Ok(())
    }

    /// ZeRO++'s qgZ with nodes of `per_node` consecutive ranks: the gradients are reduced by
    /// quantized all-to-alls inside and across nodes. With one node there is no slow link to
    /// spare, and the reduce-scatter stays, as in DeepSpeed. Collective (it splits the world).
    pub fn quantized_gradients(&self, per_node: usize) -> Result<()> {
        let comm = self.place.comm();
        let world = comm.world_size();
        if per_node == 0 || !world.is_multiple_of(per_node) {
            return Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.zero_quantized_gradients".into(),
                reason: format!(
                    "nodes of {per_node} ranks do not divide the world of {world}; start the \
                     same number of ranks on every node"
                ),
            });
        }
        if per_node == world {
            tracing::warn!(
                "zero_quantized_gradients: all {world} ranks share one node, so gradients are \
                 reduce-scattered as without it"
            );
            return Ok(());
        }
        let hierarchy = Hierarchy::new(comm, per_node)?;
        self.group.set_quantized_gradients(hierarchy);
        Ok(())
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

    /// Whether tensor `t`'s piece lives in the parameter store.
    pub(super) fn held_in_store(&self, t: usize) -> bool {
        self.store.as_ref().is_some_and(|s| s.holds(t))
    }

    /// Whether the optimizer state lives in a swap file.
    pub(super) fn offloaded(&self) -> bool {
        self.optim.as_ref().is_some_and(|o| o.is_offloaded())
    }

    /// This rank's fp32 pieces as the optimizer steps them: the masters (mixed precision, or
    /// an offloaded optimizer's swap file) or the module's values (with the parameter store's);
    /// a read the ranks agree on where it can fail on one rank.
    fn agreed_pieces<M: Module>(&self, model: &M) -> Result<Cow<'_, <S::Place as Place>::Buf>> {
        if let Some(m) = &self.master {
            return Ok(Cow::Borrowed(m));
        }
        if let Some(optim) = self.optim.as_ref().filter(|o| o.is_offloaded()) {
            let read = optim.masters();
            if let Some(masters) = agreed(self.place.comm(), "read masters", read)? {
                return Ok(Cow::Owned(self.place.write(masters)));
            }
        }
        self.read_pieces_agreed(model).map(Cow::Owned)
    }

    pub(super) fn clear(&mut self) {
        // hpZ's slices hold the parameters of the micro-batches just ended.
        self.group.forget_secondary();
        self.grads.reset();
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }
}

impl<M: Module, S: GradStore> GradSync<M> for ShardedSync<S> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Adds one micro-batch's gradients (chunk gradients from the gathers' backward, whole
    /// gradients of persistent tensors) into this rank's store.
    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
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

    /// Ends the accumulation: reports a failed gather, all-reduces the persistent tensors'
    /// gradients, averages over ranks and micro-batches, and clips by the global norm.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let gathers = match (self.deferred.take(), self.group.take_error()) {
            (Some(e), _) => Err(e),
            (None, e) => e.map_or(Ok(()), |e| Err(e.into())),
        };
        if let Err(e) = agreed(self.place.comm(), "ZeRO-3 gathers", gathers) {
            self.clear();
            return Err(e);
        }
        let refuse = (!self.options.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(self.place.comm(), &mut self.present, refuse) {
            self.clear();
            return Err(e);
        }
        let world = self.place.world_size();
        let scaling =
            Scaling::mean(self.options.predivide, world, self.micro_steps).unscaled(loss_scale);
        let (slices, clip) = (self.slices.as_ref(), self.options.clip);
        let norm = reduce_and_clip(&mut self.grads, &self.place, scaling, true, slices, clip)?;
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

    /// Steps this rank's pieces, all-gathers the persistent tensors, and writes the new
    /// chunks into `model`.
    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        if let Some(store) = self.store.clone() {
            return self.step_into_store(model, lr, &store);
        }
        let mixed = self.master.is_some();
        let mut params = match self.master.take() {
            Some(master) => master,
            // The swapped optimizer hands out its masters.
            None if self.offloaded() => self.place.zeros(self.cut.own_len),
            None => self.read_pieces(&model)?,
        };
        let (optim, present) = (self.optim.as_mut(), &self.present);
        let stepped = step_part(optim, &self.place, &self.grads, &mut params, present, lr);
        let whole = match stepped.and_then(|widened| {
            // A 16-bit buffer is stepped through a transient fp32 copy.
            let held = GradSync::<M>::held(self, &model);
            self.meter.observe(held, widened);
            self.gather_persistent(&params)
        }) {
            Ok(whole) => whole,
            Err(e) => {
                if mixed {
                    self.master = Some(params);
                }
                return Err(e);
            }
        };
        // The new chunks are assembled while the old ones are alive.
        let held = GradSync::<M>::held(self, &model);
        let new = 4 * (self.cut.own_len + self.cut.persistent_len) as u64;
        self.meter.observe(held, new + held.params);
        let model = self.write_back(model, &params, &whole);
        if mixed {
            self.master = Some(params);
        }
        self.clear();
        Ok(model)
    }

    fn discard(&mut self) {
        self.clear();
    }

    fn reduced_gradients(&mut self, model: &M) -> Result<GradientsParams> {
        let out = self.chunk_gradients(model)?;
        self.clear();
        Ok(out)
    }

    fn finish_external_step(&mut self, model: &M) -> Result<Option<M>> {
        self.track_shards(model);
        Ok(None)
    }

    /// Its chunks and the persistent tensors (and the parameter store), the gradients it
    /// holds, and its pieces' optimizer state and masters.
    fn held(&self, model: &M) -> ModelStateBytes {
        let masters = self.master.as_ref().map_or(0, |m| self.place.len(m));
        let store = self.store.as_deref();
        // hpZ's secondary slices are parameters held too.
        let secondary = 4 * self.group.secondary_elems() as u64;
        ModelStateBytes {
            params: param_bytes(model) + store.map_or(0, ParamStore::host_bytes) + secondary,
            grads: self.grads.bytes(),
            optimizer: self.optim.as_ref().map_or(0, |o| o.state_bytes()) + 4 * masters as u64,
            offloaded: self.optim.as_ref().map_or(0, |o| o.disk_bytes())
                + store.map_or(0, ParamStore::disk_bytes),
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        if self.optim.is_none() {
            return Err(caller_optimizer_keeps_no_masters(dtype));
        }
        // An offloaded optimizer keeps the masters in its swap file already.
        if !self.offloaded() {
            self.master = Some(self.read_pieces_agreed(&model)?);
        }
        let model = cast_module(model, dtype);
        // The gathers read the 16-bit chunks from now on, and send them as they are.
        GradSync::<M>::track_working_copy(self, &model, dtype);
        Ok(model)
    }

    fn track_working_copy(&mut self, working: &M, dtype: FloatDType) {
        self.track_shards(working);
        self.group.set_wire(Some(dtype));
    }

    fn swap(&self) -> Option<burn_deepspeed_strategies::swap::SwapSummary> {
        self.optim.as_ref().and_then(|o| o.swap_summary())
    }

    fn param_store(&self) -> Option<ParamStoreSummary> {
        self.store.as_ref().map(|s| s.summary())
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    /// A collective; with masters, the fp32 values, not the rounded chunks.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        let pieces = self.agreed_pieces(model)?;
        let flat = self.full_from_pieces(pieces.as_ref())?;
        Ok(wanted.then(|| self.place.read(&flat)))
    }

    /// Tensor by tensor: the writer never holds the whole model.
    fn stream_params(&self, model: &M, mut sink: Option<ParamSink>) -> Result<()> {
        let pieces = self.agreed_pieces(model)?;
        self.each_whole_tensor(pieces.as_ref(), |tensor| {
            if let Some(sink) = sink.as_mut() {
                sink(&self.place.read(&tensor));
            }
        })
    }

    fn whole_model(&self, model: &M) -> Result<M> {
        let whole = model.clone().materialize();
        match self.group.take_error() {
            Some(e) => Err(e.into()),
            None => Ok(whole),
        }
    }

    fn release_whole(&self, model: M) -> Result<M> {
        let pieces = self.agreed_pieces(&model)?;
        let flat = self.full_from_pieces(pieces.as_ref())?;
        Ok(self.unshard(model, &flat))
    }

    fn save(&self, _root: bool) -> Result<SavedState<'_>> {
        let optim = self.optim.as_ref().ok_or_else(no_state_to_restore)?;
        Ok(SavedState::Slice(optim.export_file(&self.place)?))
    }

    /// Everything fallible (cutting the state, restoring the optimizer) happens before the
    /// shards are replaced, so a failed load leaves this rank as it was.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad> {
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        let ranges: Vec<_> = self.cut.segments.iter().map(|s| s.global.clone()).collect();
        let state = loaded.slice_state(&sizes, &ranges)?;
        let pieces = loaded.params_in(&ranges)?;
        let persistent = (self.layout.slots.iter().enumerate())
            .map(|(t, s)| match self.cut.persistent_at[t] {
                Some(_) => loaded
                    .params_in(slice::from_ref(&(s.offset..s.offset + s.numel)))
                    .map(Some),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let optim = self.optim.as_ref().ok_or_else(no_state_to_restore)?;
        let masters = self.offloaded().then_some(pieces.as_slice());
        optim.check_restore(&state, masters)?;
        Ok(StagedLoad::Sharded {
            state,
            pieces,
            persistent,
        })
    }

    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M> {
        let StagedLoad::Sharded {
            state,
            pieces,
            persistent,
        } = staged
        else {
            return Err(StagedLoad::mismatch("ZeRO stage 3"));
        };
        let layout = self.layout.with_ids(&loaded.meta.param_ids);
        let offloaded = self.offloaded();
        let optim = self.optim.as_mut().ok_or_else(no_state_to_restore)?;
        optim.restore(&self.place, state, offloaded.then_some(pieces.as_slice()))?;
        let model = self.load_pieces(model, &pieces, persistent)?;
        let model = set_param_ids(model, &loaded.meta.param_ids);
        if self.master.is_some() {
            self.master = Some(self.place.write(pieces));
        }
        self.layout = layout;
        self.clear();
        Ok(model)
    }

    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        let Some(optim) = &self.optim else {
            return Ok(None);
        };
        let state = optim.export(&self.place)?;
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        gather_state(self.place.comm(), &state, &sizes, 3).map(Some)
    }

    fn gather_stats(&self) -> Option<GatherStats> {
        Some(self.group.stats())
    }

    fn settle(&self) {
        self.group.set_overlapping(false);
    }

    fn forward_scope(&self, running: bool) {
        self.group.set_overlapping(running);
    }
}
