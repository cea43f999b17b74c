//! [`ShardedSync`]: ZeRO stage 3 (arXiv 1910.02054 §5.3). Parameters are stored as per-rank
//! chunks ([`crate::zero3`]); forward and backward gather them through a [`GatherGroup`], and
//! the backward of each gather reduce-scatters the tensor's gradient, so after a micro-batch's
//! backward a rank holds only the gradients of its chunks. At the accumulation boundary the
//! persistent (whole) tensors' gradients are all-reduced, the rank's gradients are averaged
//! and clipped by the global norm, the rank steps its pieces with the
//! [`PartitionedOptimizer`], and writes the new chunks back into the module. Only the
//! persistent tensors are all-gathered after the step. The module rewriting lives in
//! `shards.rs` beside this file.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::zero::{
    PartitionState, PartitionedKind, PartitionedOptimizer, Segment, ShardPlan,
};

use super::ModelParallelNorm;
use super::buffer::merge_presence;
use super::elem::{GradElem, add_into};
use super::scale::{Scaling, clip_across, clip_to, squared_sum, sum_across};
use super::{
    GradSync, NvmeOffload, PieceReader, PieceWriter, Reduced, SavedState, SyncOptions,
    caller_optimizer_keeps_no_masters,
};
use crate::checkpoint::{Loaded, gather_moments, no_state_to_restore, save_slice};
use crate::flat::{ParamLayout, for_each_grad, set_param_ids};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes, vec_bytes};
use crate::precision::cast_module;
use crate::zero3::{
    GatherGroup, GatherStats, ParamStore, ParamStoreSummary, shard_module, shard_module_to_store,
};
use crate::{DeepSpeedError, Result, agreed};

/// A rank's stage-3 state: the gather group, its gradient pieces (of `G`: f32, or f16 under
/// fp16) and its optimizer.
pub struct ShardedSync<G: GradElem = f32> {
    pub(super) comm: Arc<dyn Communicator>,
    pub(super) layout: ParamLayout,
    pub(super) group: Arc<GatherGroup>,
    /// This rank's pieces, back to back (the optimizer's buffer order).
    pub(super) segments: Vec<Segment>,
    /// Where tensor `t`'s piece starts in the rank's buffers, if it has one.
    pub(super) local_start: Vec<Option<usize>>,
    /// Model parallelism: the norm's groups, and the ranges of this rank's pieces it leaves
    /// out.
    pub(super) slices: Option<(ModelParallelNorm, Vec<std::ops::Range<usize>>)>,
    /// Accumulated gradient of this rank's pieces. Under `offload_param` the group sums the
    /// chunk gradients, and this holds them only from the reduction to the end of the step.
    pub(super) grads: Vec<G>,
    /// Elements of this rank's pieces (the length of its buffers).
    pub(super) own_len: usize,
    /// ZeRO-Infinity's `offload_param`: the store of the partitioned tensors' pieces (the
    /// module holds empty placeholders for them).
    pub(super) store: Option<Arc<ParamStore>>,
    /// Accumulated whole gradients of the persistent tensors, back to back.
    pub(super) persistent: Vec<G>,
    /// Where tensor `t` starts in `persistent`, if it is persistent.
    pub(super) persistent_at: Vec<Option<usize>>,
    pub(super) present: Vec<u8>,
    /// The device the gradients came on (for [`GradSync::reduced_gradients`]).
    pub(super) grad_device: Option<Device>,
    micro_steps: u64,
    options: SyncOptions,
    /// `None` when the caller steps the pieces with its own optimizer
    /// ([`for_learner`](Self::for_learner)).
    optim: Option<PartitionedOptimizer>,
    meter: MemoryMeter,
    /// Mixed precision: the fp32 masters of this rank's pieces (buffer order), which the
    /// optimizer steps; the module's chunks hold them rounded to its 16-bit dtype.
    master: Option<Vec<f32>>,
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
/// ([`shard_plan`]) and the prefetch, live-parameter, pre-division and fetch options.
pub(super) fn gather_group(
    layout: &ParamLayout,
    comm: Arc<dyn Communicator>,
    options: &SyncOptions,
) -> Arc<GatherGroup> {
    let plan = shard_plan(layout, options, comm.world_size());
    GatherGroup::new(
        comm,
        plan,
        layout.slots.iter().map(|s| s.shape.clone()).collect(),
        options.prefetch_bucket,
        options.max_live,
        options.pre_factor(),
        options.fetch_by_all_reduce,
    )
}

impl<G: GradElem> ShardedSync<G> {
    /// The stage-3 state for a model of `layout` (whole shapes) on `comm`, stepped by the
    /// [`PartitionedOptimizer`] of `kind`.
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        kind: PartitionedKind,
    ) -> Self {
        let mut sync = Self::for_learner(layout, comm, options);
        sync.optim = Some(PartitionedOptimizer::over_segments(
            kind,
            sync.segments.clone(),
            0..sync.own_len,
            sync.layout.slots.len(),
        ));
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
        let plan = group.plan();
        let tensors = plan.tensors().len();
        let segments = plan.segments(comm.rank());
        let own_len = plan.own_len(comm.rank());
        let mut local_start = vec![None; tensors];
        for s in &segments {
            local_start[s.tensor] = Some(s.local.start);
        }
        let mut persistent_at = vec![None; tensors];
        let mut at = 0;
        for (t, s) in plan.tensors().iter().enumerate() {
            if s.persistent {
                persistent_at[t] = Some(at);
                at += s.numel;
            }
        }
        Self {
            comm,
            group,
            segments,
            local_start,
            slices: None,
            grads: vec![G::default(); own_len],
            own_len,
            store: None,
            persistent: vec![G::default(); at],
            persistent_at,
            present: vec![0; tensors],
            grad_device: None,
            micro_steps: 0,
            options: *options,
            optim: None,
            meter: MemoryMeter::default(),
            master: None,
            layout,
        }
    }

    /// Moves the optimizer state of this rank's pieces, with their fp32 masters read from the
    /// sharded `model` (still in f32), to its swap file (ZeRO-Infinity). Collective: the
    /// ranks agree on every rank's outcome, so that a full disk on one fails them all.
    /// Under `offload_param` the masters are read from the parameter store tile by tile, so
    /// that the slice is never whole in memory.
    pub fn offload_optimizer<M: Module>(&mut self, model: &M, nvme: &NvmeOffload) -> Result<()> {
        let rank = self.comm.rank();
        let kept = self.persistent_pieces(model);
        let masters = match &self.store {
            Some(_) => Vec::new(),
            None => {
                let mut masters = vec![0.0f32; self.own_len];
                self.read_own(model, &mut masters)?;
                masters
            }
        };
        let (segments, params) = (&self.segments, &self.store);
        let local = match self.optim.as_mut() {
            Some(optim) => nvme
                .store(rank, self.own_len)
                .and_then(|swap| match params {
                    Some(params) => {
                        let mut reader = PieceReader::new(segments);
                        optim
                            .offload_with(swap, |r, out| {
                                reader.fill(r, out, |t| piece_of(params, &kept, t))
                            })
                            .map_err(DeepSpeedError::from)
                    }
                    None => optim.offload(swap, &masters).map_err(DeepSpeedError::from),
                }),
            None => Err(DeepSpeedError::Data(
                "this stage-3 state has no optimizer to offload".into(),
            )),
        };
        agreed(self.comm.as_ref(), "optimizer offload", local)
    }

    /// The length of each tensor's piece on this rank for a parameter store (`None` for the
    /// persistent tensors, which the module keeps whole).
    pub fn piece_lens(&self) -> Vec<Option<usize>> {
        let (plan, rank) = (self.plan(), self.comm.rank());
        (0..plan.tensors().len())
            .map(|t| (!plan.tensors()[t].persistent).then(|| plan.own(rank, t).len()))
            .collect()
    }

    /// Shards a whole `model` (as [`shard`](Self::shard)) into the parameter store `store`
    /// (ZeRO-Infinity's `offload_param`): this rank's pieces go to it one tensor at a time,
    /// and the module keeps empty placeholders. Collective: the ranks agree on creating the
    /// store and on writing it.
    pub fn shard_offloaded<M: Module>(&mut self, model: M, store: Result<ParamStore>) -> Result<M> {
        let store = Arc::new(agreed(self.comm.as_ref(), "parameter offload", store)?);
        let (model, written) = shard_module_to_store(model, &self.group, &store);
        let written = written.map_err(DeepSpeedError::from);
        agreed(self.comm.as_ref(), "parameter offload", written)?;
        self.group.offload_to(store.clone());
        self.store = Some(store);
        Ok(model)
    }

    /// Whether tensor `t`'s piece lives in the parameter store.
    pub(super) fn held_in_store(&self, t: usize) -> bool {
        self.store.as_ref().is_some_and(|s| s.holds(t))
    }

    /// Whether the optimizer state lives in a swap file.
    fn offloaded(&self) -> bool {
        self.optim.as_ref().is_some_and(|o| o.is_offloaded())
    }

    /// The fp32 masters of this rank's pieces where they are kept apart from the model
    /// (mixed precision, or an offloaded optimizer's swap file); a rank-local read that the
    /// ranks agree on, so that a failed read fails them all before the gather that follows.
    fn agreed_masters<M: Module>(&self, model: &M) -> Result<Option<Cow<'_, [f32]>>> {
        let local = match (&self.master, &self.optim) {
            (Some(m), _) => Ok(Some(Cow::Borrowed(&m[..]))),
            (None, Some(o)) if o.is_offloaded() => o
                .masters()
                .map(|m| m.map(Cow::Owned))
                .map_err(DeepSpeedError::from),
            // The parameter store holds the f32 values the optimizer stepped.
            (None, _) if self.store.is_some() => {
                let mut pieces = vec![0.0f32; self.own_len];
                return self
                    .read_own_agreed(model, &mut pieces)
                    .map(|()| Some(Cow::Owned(pieces)));
            }
            _ => Ok(None),
        };
        if self.master.is_some() || !self.offloaded() {
            return local;
        }
        agreed(self.comm.as_ref(), "read masters", local)
    }

    /// The step under `offload_param`: the stepped pieces go to the store (from an offloaded
    /// optimizer, tile by tile as they are stepped, so that no buffer of the whole slice is
    /// made), and only the persistent tensors are gathered into the module.
    fn step_into_store<M: Module>(&mut self, model: M, lr: f64, store: &ParamStore) -> Result<M> {
        let comm = self.comm.clone();
        store.forget_read_ahead();
        let mixed = self.master.is_some();
        // Without an offloaded optimizer, the step needs the slice's values in memory.
        let mut params = match (self.master.take(), self.offloaded()) {
            (Some(master), _) => Some(master),
            (None, true) => None,
            (None, false) => {
                let mut params = vec![0.0f32; self.own_len];
                self.read_own_agreed(&model, &mut params)?;
                Some(params)
            }
        };
        let mut kept: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut done = |t: usize, piece: &[f32]| match store.holds(t) {
            true => store.write(t, piece),
            false => {
                kept.insert(t, piece.to_vec());
                Ok(())
            }
        };
        let stepped = {
            let _span = tracing::debug_span!("optimizer_step", rank = comm.rank()).entered();
            let grads = G::widen_all(&self.grads);
            let mut writer = PieceWriter::new(&self.segments);
            match (self.optim.as_mut(), params.as_mut()) {
                (Some(optim), None) => optim
                    .step_tiles(&grads, &self.present, lr, |r, p| {
                        writer.push(r, p, &mut done)
                    })
                    .map_err(DeepSpeedError::from),
                (Some(optim), Some(params)) => optim
                    .step(comm.as_ref(), params, &grads, &self.present, lr)
                    .and_then(|()| writer.push(0..params.len(), params, &mut done))
                    .map_err(DeepSpeedError::from),
                (None, _) => Err(DeepSpeedError::Data(
                    "this stage-3 state steps with the caller's optimizer".into(),
                )),
            }
        };
        if mixed {
            self.master = params;
        }
        // A swap file can fail on one rank: all agree before the gather.
        agreed(comm.as_ref(), "offloaded parameter step", stepped)?;
        let input = self.persistent_input(|t| kept.get(&t).map_or(&[][..], |p| &p[..]));
        let whole = self.gather_persistent_input(input)?;
        let model = self.replace(
            model,
            |t, _| {
                let at = self.persistent_at[t].expect("only persistent tensors are replaced");
                whole[at..at + self.layout.slots[t].numel].to_vec()
            },
            false,
        );
        self.clear();
        Ok(model)
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

    pub(super) fn reset(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = G::default());
        self.persistent.iter_mut().for_each(|g| *g = G::default());
        self.micro_steps = 0;
        if self.store.is_some() {
            // The zeroed buffer goes back to the group, which sums the next chunk gradients.
            match self.grads.is_empty() {
                true => self.group.zero_offloaded_grads(),
                false => {
                    let grads = G::into_f32_vec(std::mem::take(&mut self.grads));
                    self.group.exchange_offloaded_grads(grads);
                }
            }
        }
    }

    fn clear(&mut self) {
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
    }
}

impl<M: Module, G: GradElem> GradSync<M> for ShardedSync<G> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Adds one micro-batch's gradients (chunk gradients from the gathers' backward, whole
    /// gradients of persistent tensors) into this rank's buffers.
    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        self.micro_steps += 1;
        let rank = self.comm.rank();
        let (plan, layout) = (self.group.plan(), &self.layout);
        let (persistent_at, local_start) = (&self.persistent_at, &self.local_start);
        let (persistent, own_grads, present) =
            (&mut self.persistent, &mut self.grads, &mut self.present);
        let group = &self.group;
        let store = self.store.as_deref();
        let tensors = for_each_grad(model, layout, grads, &mut self.grad_device, |t, values| {
            let Some(values) = values else {
                return;
            };
            present[t] = 1;
            // Under `offload_param` the group summed the chunk gradient already.
            if store.is_some_and(|s| s.holds(t)) {
                return;
            }
            // A 16-bit module's chunk gradients, unrounded.
            let values = match persistent_at[t] {
                None => group.take_chunk_grad(t).unwrap_or(values),
                Some(_) => values,
            };
            if let Some(at) = persistent_at[t] {
                add_into(&mut persistent[at..at + values.len()], &values);
            } else if let Some(at) = local_start[t] {
                let own = plan.own(rank, t);
                add_into(&mut own_grads[at..at + own.len()], &values);
            }
        });
        // Alive during the micro-batch beyond the held state: its chunk gradients, and what
        // the gathers allocated at once (gathered weights and the prefetch cache).
        let gathered = 4 * self.group.stats().peak_live_elems as u64;
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, tensors + gathered);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// Ends the accumulation: reports a failed gather, all-reduces the persistent tensors'
    /// gradients, averages over ranks and micro-batches, and clips by the global norm.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let comm = self.comm.clone();
        if self.store.is_some() {
            let summed = self.group.exchange_offloaded_grads(Vec::new());
            self.grads = G::from_f32_vec(summed);
        }
        let gathers = self.group.take_error().map_or(Ok(()), |e| Err(e.into()));
        if let Err(e) = agreed(comm.as_ref(), "ZeRO-3 gathers", gathers) {
            self.reset();
            return Err(e);
        }
        let rank = comm.rank();
        let refuse = (!self.options.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(comm.as_ref(), &mut self.present, refuse) {
            self.reset();
            return Err(e);
        }
        let scaling = Scaling::mean(self.options.predivide, comm.world_size(), self.micro_steps)
            .unscaled(loss_scale);
        if !self.persistent.is_empty() {
            scaling.apply_pre(&mut self.persistent);
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
        scaling.apply_post(&mut self.grads);
        let norm = match &self.slices {
            Some((mp, skipped)) => {
                let skipped: f64 = skipped
                    .iter()
                    .map(|r| squared_sum(&self.grads[r.clone()]))
                    .sum();
                let local = (squared_sum(&self.grads) - skipped).max(0.0);
                let norm = mp.across(sum_across(comm.as_ref(), local)?)?.sqrt();
                clip_to(&mut self.grads, norm, self.options.clip);
                norm
            }
            None => clip_across(comm.as_ref(), &mut self.grads, self.options.clip)?,
        };
        Ok(Reduced::global(norm))
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        let windows = self
            .segments
            .iter()
            .map(|s| (s.local.start, s.global.clone()));
        let skipped = norm.skipped_local(windows);
        self.slices = Some((norm, skipped));
        Ok(())
    }

    /// Steps this rank's pieces, writes the new chunks into `model`, and all-gathers the
    /// persistent tensors.
    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        if let Some(store) = self.store.clone() {
            return self.step_into_store(model, lr, &store);
        }
        let comm = self.comm.clone();
        let mixed = self.master.is_some();
        let offloaded = self.offloaded();
        let mut params = match self.master.take() {
            Some(master) => master,
            // The swapped optimizer hands out its masters.
            None if offloaded => vec![0.0f32; self.own_len],
            None => {
                let mut params = vec![0.0f32; self.own_len];
                self.read_own(&model, &mut params)?;
                params
            }
        };
        let stepped = {
            let _span = tracing::debug_span!("optimizer_step", rank = comm.rank()).entered();
            // A 16-bit buffer is stepped through a transient fp32 copy.
            let grads = G::widen_all(&self.grads);
            if let Cow::Owned(widened) = &grads {
                let held = GradSync::<M>::held(self, &model);
                self.meter.observe(held, vec_bytes(widened));
            }
            match self.optim.as_mut() {
                Some(optim) => optim
                    .step(comm.as_ref(), &mut params, &grads, &self.present, lr)
                    .map_err(DeepSpeedError::from),
                None => Err(DeepSpeedError::Data(
                    "this stage-3 state steps with the caller's optimizer".into(),
                )),
            }
        };
        // A swap file can fail on one rank: all agree before the gather.
        let stepped = match offloaded {
            true => agreed(comm.as_ref(), "offloaded optimizer step", stepped),
            false => stepped,
        };
        let whole = match stepped.and_then(|()| self.gather_persistent(&params)) {
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
        self.meter
            .observe(held, vec_bytes(&params) + vec_bytes(&whole) + held.params);
        let model = self.write_back(model, &params, whole);
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

    /// Its chunks and the persistent tensors, the gradients of its pieces and of the
    /// persistent tensors, and its pieces' optimizer state.
    fn held(&self, model: &M) -> ModelStateBytes {
        let masters = self.master.as_ref().map_or(0, vec_bytes);
        let store = self.store.as_deref();
        ModelStateBytes {
            params: param_bytes(model) + store.map_or(0, ParamStore::host_bytes),
            grads: vec_bytes(&self.grads)
                + vec_bytes(&self.persistent)
                + self.group.offloaded_grad_bytes(),
            optimizer: self.optim.as_ref().map_or(0, |o| o.state_bytes()) + masters,
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
            let mut master = vec![0.0f32; self.own_len];
            self.read_own_agreed(&model, &mut master)?;
            self.master = Some(master);
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
    fn whole_params(&self, model: &M, _wanted: bool) -> Result<Option<Vec<f32>>> {
        match self.agreed_masters(model)? {
            Some(master) => self.full_from_pieces(&master).map(Some),
            None => self.full_params(model).map(Some),
        }
    }

    fn whole_model(&self, model: &M) -> Result<M> {
        gathered_copy(model, &self.group)
    }

    fn release_whole(&self, model: M) -> Result<M> {
        let flat = match self.agreed_masters(&model)? {
            Some(master) => self.full_from_pieces(&master)?,
            None => self.full_params(&model)?,
        };
        Ok(self.unshard(model, &flat))
    }

    fn save(&self, _root: bool) -> Result<SavedState> {
        save_slice(self.optim.as_ref())
    }

    /// Everything fallible (cutting the state, restoring the optimizer) happens before the
    /// shards are replaced, so a failed load leaves this rank as it was.
    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let layout = self.layout.with_ids(&loaded.meta.param_ids);
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let ranges: Vec<_> = self.segments.iter().map(|s| s.global.clone()).collect();
        let state = loaded.slice_state(&sizes, &ranges)?;
        // `restore` checks the state before it replaces anything.
        let offloaded = self.optim.as_ref().is_some_and(|o| o.is_offloaded());
        let masters = offloaded.then(|| self.pieces_of(&loaded.params));
        let optim = self.optim.as_mut().ok_or_else(no_state_to_restore)?;
        optim.restore(state, masters.as_deref())?;
        let model = self.load_flat(model, &loaded.params)?;
        let model = set_param_ids(model, &loaded.meta.param_ids);
        if self.master.is_some() {
            self.master = Some(self.pieces_of(&loaded.params));
        }
        self.layout = layout;
        self.clear();
        Ok(model)
    }

    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        gather_moments(self.comm.as_ref(), self.optim.as_ref(), &sizes, 3)
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

/// A copy of the sharded `model` with every parameter gathered whole through `group` (a
/// collective: every rank gathers the same tensors in the same order), or the gathers' error.
pub(super) fn gathered_copy<M: Module>(model: &M, group: &GatherGroup) -> Result<M> {
    let whole = model.clone().materialize();
    match group.take_error() {
        Some(e) => Err(e.into()),
        None => Ok(whole),
    }
}

/// Tensor `t`'s piece on this rank: from the parameter store, or (a persistent tensor) from
/// the pieces read from the module.
pub(super) fn piece_of(
    store: &ParamStore,
    kept: &HashMap<usize, Vec<f32>>,
    t: usize,
) -> burn_deepspeed_strategies::Result<Vec<f32>> {
    match store.holds(t) {
        true => store.read(t),
        false => Ok(kept.get(&t).cloned().unwrap_or_default()),
    }
}
