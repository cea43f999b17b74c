//! [`GatherGroup`]: one rank's ZeRO stage-3 parameter fetcher (arXiv 1910.02054 §5.3).
//!
//! The [`zero3_gather`](super::zero3_gather) op finds its group through a process-wide
//! registry by the key stored in each sharded parameter's [`ShardGather`](super::ShardGather)
//! reparameterization. The group owns the collectives:
//!
//! - **Forward**: an all-gather of the tensor's equal chunks. The order in which the first
//!   forward asks for tensors is recorded (DeepSpeed's trace); from then on a miss fetches the
//!   requested tensor together with the ones the trace says come next, up to
//!   `stage3_prefetch_bucket_size` elements, in one all-gather, and keeps them until asked
//!   for. `stage3_max_live_parameters` caps the elements held that way plus the tensor being
//!   fetched.
//! - **Backward**: the gradient checkpointing of the op re-gathers the weight when its
//!   consumer's backward needs it, and the op's backward reduce-scatters the whole gradient
//!   into this rank's chunk (a sum over ranks; the engine scales it).
//!
//! - **Overlap** (`overlap_comm`, on by default at stage 3 as in DeepSpeed): inside the
//!   engine's forward ([`GatherGroup::set_overlapping`]), once a tensor is fetched the group
//!   hands the all-gather of the next bundle the trace names to the rank's communication
//!   thread ([`CommWorker`]), so that it runs while this tensor's layer computes; one bundle
//!   is in flight at a time, and the group waits for it before any collective of its own.
//!
//! Every rank asks in the same order, because every rank runs the same model and Burn's
//! backward visits the same graph in the same order. A failed collective is kept and
//! reported by the engine's next step; the calls after it return zeros without
//! communicating, so a dead peer costs one timeout, not one per tensor.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock, Weak};

use burn::tensor::{FloatDType, Tensor, bf16, f16};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{
    CommElement, CommWorker, Communicator, CommunicatorExt, Pending, ReduceOp,
};
use burn_deepspeed_strategies::device::DeviceCollectives;
use burn_deepspeed_strategies::zero::ShardPlan;

use super::store::ParamStore;
use crate::transfer;

/// Why a tensor is fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// For a forward pass (traced, prefetched).
    Forward,
    /// Re-gathered for a backward pass (no prefetch).
    Backward,
}

/// Counters of one group's traffic, since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GatherStats {
    /// Tensors gathered for forward passes.
    pub forward_gathers: u64,
    /// Tensors gathered again for backward passes.
    pub backward_gathers: u64,
    /// Gradients reduce-scattered.
    pub reduce_scatters: u64,
    /// All-gather collectives issued (a prefetch bucket is one).
    pub all_gathers: u64,
    /// Of the all-gathers, those run on the communication thread while the forward computed
    /// (`overlap_comm`).
    pub gathered_ahead: u64,
    /// Of the all-gathers and reduce-scatters, those that moved the device's buffers through
    /// its device collectives ([`GatherGroup::gather_on_device`]) rather than host copies.
    pub on_device: u64,
    /// Bytes this rank's transport sent for the parameter fetches (measured around each
    /// collective; half as many for a 16-bit model as for an f32 one).
    pub gather_bytes_sent: u64,
    /// Most elements held by the prefetch cache at once.
    pub peak_prefetched: usize,
    /// Most elements one gather or reduce-scatter had allocated at once, the prefetch cache
    /// included: gathered weights (and prefetched ones), or a whole gradient padded for its
    /// reduce-scatter and the chunk it leaves. Counted where they are allocated.
    pub peak_live_elems: usize,
}

struct State {
    /// The module's current shards (flat, `chunk` elements, no autodiff), for prefetching.
    shards: Vec<Option<Tensor<1>>>,
    trace: Vec<usize>,
    /// Recording the first forward's order.
    recording: bool,
    cache: HashMap<usize, Vec<f32>>,
    /// The prefetched tensors of gathers on the device ([`GatherGroup::gather_on_device`]).
    device_cache: HashMap<usize, Tensor<1>>,
    cache_elems: usize,
    error: Option<CommError>,
    stats: GatherStats,
    /// The dtype the chunks travel in: the module's working dtype, so that a 16-bit model's
    /// gathers move 2 bytes per element (its values are 16-bit already, so nothing rounds).
    wire: Option<FloatDType>,
    /// With a 16-bit module: the f32 sums the reduce-scatters produced since the last
    /// [`take_chunk_grad`](GatherGroup::take_chunk_grad), per tensor. The op's gradient has the
    /// parameter's dtype and would round them; the sync reads these instead.
    chunk_grads: HashMap<usize, Vec<f32>>,
    /// Whether `chunk_grads` are kept (a regime that reads the op's gradients, rounded to the
    /// parameter's dtype, turns them off).
    keep_chunk_grads: bool,
    /// Under `offload_param`: where the partitioned tensors' pieces live (the module holds
    /// empty placeholders), and the rank's accumulated chunk gradients in its buffer order.
    offload: Option<Offload>,
    /// The order of the first backward's re-gathers, for reading ahead (recorded while
    /// `brecording`).
    btrace: Vec<usize>,
    brecording: bool,
    /// The phase of the last gather (a change ends the pass's read-ahead).
    last_phase: Option<Phase>,
    /// A failed read of this rank's parameter store: unlike `error`, the collectives go on
    /// (with zeros), so that no peer waits on this rank before the step agrees on it.
    read_error: Option<CommError>,
    /// Whether a fetch hands the next bundle's all-gather to the communication thread (set
    /// for the engine's forward passes, with a worker).
    overlapping: bool,
    /// The bundle being all-gathered on the communication thread.
    inflight: Option<Inflight>,
}

/// A prefetch bundle all-gathered on the communication thread.
struct Inflight {
    bundle: Vec<usize>,
    /// Every rank's chunks of the bundle (rank order), and the bytes the transport sent.
    pending: Pending<(Vec<f32>, u64)>,
}

/// The parameter pieces of an `offload_param` rank and the gradients of its pieces.
struct Offload {
    store: Arc<ParamStore>,
    /// Where tensor `t`'s piece starts in the rank's buffer.
    local_start: Vec<Option<usize>>,
    /// The sum of the chunk gradients since the last exchange, this rank's pieces back to
    /// back: the reduce-scatters add into it, so that no per-tensor gradient outlives its
    /// backward step.
    grads: Vec<f32>,
}

/// One rank's stage-3 fetcher: the plan, the communicator and the prefetch state.
pub struct GatherGroup {
    id: u64,
    comm: Arc<dyn Communicator>,
    plan: ShardPlan,
    shapes: Vec<Vec<usize>>,
    prefetch: usize,
    max_live: usize,
    /// Factor applied to gradients before the reduce-scatter (`gradient_predivide_factor`).
    pre: f32,
    /// Fetch with an all-reduce of a zero-padded buffer instead of an all-gather
    /// (`stage3_use_all_reduce_for_fetch_params`): the same values, twice the traffic.
    fetch_by_all_reduce: bool,
    /// The collectives on the device's buffers, when the regime gathers there
    /// ([`set_device_collectives`](Self::set_device_collectives)).
    device: OnceLock<Arc<dyn DeviceCollectives>>,
    /// The communication thread that all-gathers bundles ahead (`overlap_comm`).
    worker: OnceLock<CommWorker>,
    state: Mutex<State>,
}

impl std::fmt::Debug for GatherGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherGroup")
            .field("id", &self.id)
            .field("rank", &self.comm.rank())
            .field("tensors", &self.shapes.len())
            .finish()
    }
}

enum Entry {
    Live(Weak<GatherGroup>),
    /// The parameters were gathered back whole ([`GatherGroup::release`]): the op passes the
    /// stored value through.
    Whole,
    /// Keys handed out by [`prepared_id`] for a model sharded ahead of its ranks (the Learner
    /// strategy); each rank's thread answers them through [`GatherGroup::answer_on_this_thread`].
    Prepared,
}

thread_local! {
    /// Prepared ids this thread resolves to one of its own groups.
    static ALIASES: RefCell<HashMap<u64, Weak<GatherGroup>>> = RefCell::new(HashMap::new());
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, HashMap<u64, Entry>> {
    static REGISTRY: LazyLock<Mutex<HashMap<u64, Entry>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The key of tensor `tensor` of group `group`, as stored in [`ShardGather`](super::ShardGather).
pub fn key_of(group: u64, tensor: usize) -> u64 {
    (group << 32) | tensor as u64
}

/// What a key resolves to.
pub enum Resolved {
    /// A live group and the tensor's index in it.
    Group(Arc<GatherGroup>, usize),
    /// The group's parameters are whole again.
    Whole,
}

/// Finds the group of `key`.
///
/// # Panics
/// When the engine that sharded the parameter is gone: a sharded parameter cannot be used
/// without its group.
pub fn resolve(key: u64) -> Resolved {
    let group = key >> 32;
    let tensor = (key & 0xffff_ffff) as usize;
    let aliased = ALIASES.with(|a| a.borrow().get(&group).and_then(Weak::upgrade));
    if let Some(g) = aliased {
        return Resolved::Group(g, tensor);
    }
    match registry().get(&group) {
        Some(Entry::Whole) => Resolved::Whole,
        Some(Entry::Live(weak)) => match weak.upgrade() {
            Some(g) => Resolved::Group(g, tensor),
            None => panic!("ZeRO-3: the gather group {group} of a sharded parameter is gone"),
        },
        Some(Entry::Prepared) => panic!(
            "ZeRO-3: this model was prepared by DeepSpeedStrategy::prepare_model (group \
             {group}); it runs only inside the SupervisedTraining that uses that strategy, \
             which returns it whole"
        ),
        None => panic!(
            "ZeRO-3: the engine that sharded this parameter (group {group}) was dropped; \
             take the whole model with DeepSpeedEngine::into_model before dropping it"
        ),
    }
}

/// A new id for a model sharded before its ranks exist: its keys resolve, on each rank's
/// thread, to the group that rank registers with [`GatherGroup::answer_on_this_thread`].
pub fn prepared_id() -> u64 {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    registry().insert(id, Entry::Prepared);
    id
}

impl GatherGroup {
    /// A registered group for `plan` (tensors of `shapes`, in layout order) on `comm`.
    pub fn new(
        comm: Arc<dyn Communicator>,
        plan: ShardPlan,
        shapes: Vec<Vec<usize>>,
        prefetch: usize,
        max_live: usize,
        pre: f32,
        fetch_by_all_reduce: bool,
    ) -> Arc<Self> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let n = shapes.len();
        let group = Arc::new(Self {
            id,
            comm,
            plan,
            shapes,
            prefetch,
            max_live,
            pre,
            fetch_by_all_reduce,
            device: OnceLock::new(),
            worker: OnceLock::new(),
            state: Mutex::new(State {
                shards: vec![None; n],
                trace: Vec::new(),
                recording: true,
                cache: HashMap::new(),
                device_cache: HashMap::new(),
                cache_elems: 0,
                wire: None,
                chunk_grads: HashMap::new(),
                keep_chunk_grads: true,
                offload: None,
                btrace: Vec::new(),
                brecording: true,
                last_phase: None,
                read_error: None,
                overlapping: false,
                inflight: None,
                error: None,
                stats: GatherStats::default(),
            }),
        });
        registry().insert(id, Entry::Live(Arc::downgrade(&group)));
        group
    }

    /// The group's id (the upper half of its keys).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The plan.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The whole shape of tensor `t`.
    pub fn shape(&self, t: usize) -> &[usize] {
        &self.shapes[t]
    }

    /// The whole shapes, in layout order.
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records tensor `t`'s current shard (flat, `chunk` elements) for prefetching. Call it
    /// whenever the module's shards change (the engine does, after each step).
    pub fn set_shard(&self, t: usize, shard: Tensor<1>) {
        self.state().shards[t] = Some(shard);
    }

    /// From now on the partitioned tensors' pieces are read from `store` (the module holds
    /// empty placeholders), and their chunk gradients are summed into this rank's buffer
    /// (see [`exchange_offloaded_grads`](Self::exchange_offloaded_grads)) instead of being
    /// returned to autodiff.
    pub fn offload_to(&self, store: Arc<ParamStore>) {
        let rank = self.comm.rank();
        let mut local_start = vec![None; self.plan.tensors().len()];
        for s in self.plan.segments(rank) {
            local_start[s.tensor] = Some(s.local.start);
        }
        let own = self.plan.own_len(rank);
        self.state().offload = Some(Offload {
            store,
            local_start,
            grads: vec![0.0; own],
        });
    }

    /// Under `offload_param`: the parameter store.
    pub fn store(&self) -> Option<Arc<ParamStore>> {
        self.state().offload.as_ref().map(|o| o.store.clone())
    }

    /// Under `offload_param`: swaps the buffer of summed chunk gradients with `grads` (the
    /// same length, or empty to take it), and returns the old one.
    pub fn exchange_offloaded_grads(&self, grads: Vec<f32>) -> Vec<f32> {
        match self.state().offload.as_mut() {
            Some(o) => std::mem::replace(&mut o.grads, grads),
            None => grads,
        }
    }

    /// Under `offload_param`: zeroes the summed chunk gradients.
    pub fn zero_offloaded_grads(&self) {
        if let Some(o) = self.state().offload.as_mut() {
            o.grads.iter_mut().for_each(|g| *g = 0.0);
        }
    }

    /// Under `offload_param`: bytes of the summed chunk gradients held by the group.
    pub fn offloaded_grad_bytes(&self) -> u64 {
        self.state()
            .offload
            .as_ref()
            .map_or(0, |o| 4 * o.grads.len() as u64)
    }

    /// Marks this group's parameters whole again: from now on the op passes stored values
    /// through unchanged. Called once the module's shards were replaced by whole tensors.
    pub fn release(&self) {
        registry().insert(self.id, Entry::Whole);
    }

    /// Makes the keys of the prepared id `prepared` (see [`prepared_id`]) resolve to this
    /// group on the calling thread, until [`forget_on_this_thread`](Self::forget_on_this_thread).
    /// The gather and its backward run on the thread that calls the model (Burn's autodiff runs
    /// a backward on the caller's thread), so ranks that are threads of one process each answer
    /// the same keys with their own group.
    pub fn answer_on_this_thread(self: &Arc<Self>, prepared: u64) {
        ALIASES.with(|a| a.borrow_mut().insert(prepared, Arc::downgrade(self)));
    }

    /// Ends [`answer_on_this_thread`](Self::answer_on_this_thread).
    pub fn forget_on_this_thread(prepared: u64) {
        ALIASES.with(|a| a.borrow_mut().remove(&prepared));
    }

    /// Takes the first collective failure (or failed read of the parameter store) since the
    /// last call, if any.
    pub fn take_error(&self) -> Option<CommError> {
        let mut st = self.state();
        let read = st.read_error.take();
        st.error.take().or(read)
    }

    /// Traffic counters.
    pub fn stats(&self) -> GatherStats {
        self.state().stats
    }

    /// Drops prefetched tensors and ends the trace recording (the backward has begun).
    fn end_forward(&self, st: &mut State) {
        self.settle_inflight(st, false);
        st.cache.clear();
        st.device_cache.clear();
        st.cache_elems = 0;
        if st.recording && !st.trace.is_empty() {
            st.recording = false;
        }
    }

    /// The bookkeeping of a gather of tensor `t` for `phase`: the end of the last pass's
    /// read-ahead, the traces and the counters.
    fn note_gather(&self, st: &mut State, t: usize, phase: Phase) {
        if st.last_phase != Some(phase) {
            st.last_phase = Some(phase);
            if let Some(o) = &st.offload {
                o.store.forget_read_ahead();
            }
            if phase == Phase::Forward && !st.btrace.is_empty() {
                st.brecording = false;
            }
        }
        match phase {
            Phase::Forward => {
                st.stats.forward_gathers += 1;
                if st.recording {
                    st.trace.push(t);
                }
            }
            Phase::Backward => {
                self.end_forward(st);
                st.stats.backward_gathers += 1;
                if st.brecording {
                    st.btrace.push(t);
                }
            }
        }
    }

    /// Tensor `t` whole (`numel` values), from this rank's `shard` (`chunk` values).
    pub fn gather(&self, t: usize, shard: Vec<f32>, phase: Phase) -> Vec<f32> {
        let mut st = self.state();
        let numel = self.plan.tensors()[t].numel;
        self.note_gather(&mut st, t, phase);
        if phase == Phase::Forward {
            let coming = st.inflight.as_ref().is_some_and(|f| f.bundle.contains(&t));
            if coming {
                self.settle_inflight(&mut st, true);
            }
            if let Some(values) = st.cache.remove(&t) {
                st.cache_elems -= values.len();
                self.read_ahead(&st, t, phase);
                self.gather_ahead(&mut st, t);
                return values;
            }
        }
        // This rank's own collective comes next: the one in flight ends first (its tensors
        // are kept for this forward).
        self.settle_inflight(&mut st, phase == Phase::Forward);
        // Under `offload_param` the module's shard is an empty placeholder.
        let shard = match st.offload.is_some() {
            true => self.read_piece(&mut st, t),
            false => shard,
        };
        let mut bundle = vec![t];
        if phase == Phase::Forward && !st.recording {
            self.plan_prefetch(&st, t, &mut bundle);
        }
        // A traced tensor without a registered shard (the same on every rank) is not
        // prefetched; it is gathered when read.
        let mut shards: Vec<Vec<f32>> = Vec::with_capacity(bundle.len());
        shards.push(shard);
        let mut fetched = vec![t];
        for &j in &bundle[1..] {
            let values = match st.offload.is_some() {
                true => Some(self.read_piece(&mut st, j)),
                false => st
                    .shards
                    .get(j)
                    .cloned()
                    .flatten()
                    .map(crate::transfer::read_f32),
            };
            if let Some(values) = values {
                fetched.push(j);
                shards.push(values);
            }
        }
        let bundle = fetched;
        let mut wholes = self.all_gather(&mut st, &bundle, &shards);
        let first = wholes.remove(0);
        for (&j, values) in bundle[1..].iter().zip(wholes) {
            st.cache_elems += values.len();
            st.cache.insert(j, values);
        }
        st.stats.peak_prefetched = st.stats.peak_prefetched.max(st.cache_elems);
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(st.cache_elems + first.len());
        debug_assert_eq!(first.len(), numel);
        self.read_ahead(&st, t, phase);
        if phase == Phase::Forward {
            self.gather_ahead(&mut st, t);
        }
        first
    }

    /// Starts a communication thread for `overlap_comm`: from then on, while
    /// [`set_overlapping`](Self::set_overlapping) is on, forward fetches gather the next bundle
    /// ahead on it. Fails when the thread cannot be started (the caller agrees on it with the
    /// other ranks). Not for a group under `offload_param`, whose pieces are read from disk on
    /// the rank's thread.
    pub fn overlap_prefetch(&self) -> Result<(), CommError> {
        if self.worker.get().is_none() {
            // A second call keeps the first worker.
            let _ = self.worker.set(CommWorker::spawn(self.comm.clone())?);
        }
        Ok(())
    }

    /// Whether a worker gathers ahead ([`overlap_prefetch`](Self::overlap_prefetch)).
    pub fn overlaps(&self) -> bool {
        self.worker.get().is_some()
    }

    /// Turns gathering ahead on (the engine, for its forward passes) or off. Off, the bundle in
    /// flight is waited for and dropped, so that the caller may call collectives of the
    /// group's communicator itself: a forward the engine does not run (a user's evaluation)
    /// fetches on the rank's own thread.
    pub fn set_overlapping(&self, on: bool) {
        let mut st = self.state();
        st.overlapping = on && self.worker.get().is_some();
        if !on {
            self.settle_inflight(&mut st, false);
        }
    }

    /// Waits for the bundle in flight, if any: its tensors go to the prefetch cache when
    /// `keep` (the forward that asked for them goes on), and are dropped otherwise. A failed
    /// all-gather is kept as this group's error, and its tensors are zeros.
    fn settle_inflight(&self, st: &mut State, keep: bool) {
        let Some(inflight) = st.inflight.take() else {
            return;
        };
        let tensors = self.plan.tensors();
        let per_rank: usize = inflight.bundle.iter().map(|&j| tensors[j].chunk).sum();
        let out = match inflight.pending.wait() {
            Ok((out, sent)) => {
                st.stats.gather_bytes_sent += sent;
                out
            }
            Err(e) => {
                if st.error.is_none() {
                    self.fail(st, e);
                }
                vec![0.0; per_rank * self.comm.world_size()]
            }
        };
        if !keep {
            return;
        }
        let wholes = self.split_wholes(&inflight.bundle, &out);
        for (&j, values) in inflight.bundle.iter().zip(wholes) {
            st.cache_elems += values.len();
            st.cache.insert(j, values);
        }
        st.stats.peak_prefetched = st.stats.peak_prefetched.max(st.cache_elems);
    }

    /// With overlapping on and nothing in flight: hands the all-gather of the tensors the
    /// forward trace has after `t` (not cached yet, within the prefetch bucket and the live
    /// cap, `t` counted as live) to the communication thread. Below the live cap this is the
    /// bundle the rank's thread would fetch at its next miss, only fetched earlier.
    fn gather_ahead(&self, st: &mut State, t: usize) {
        let Some(worker) = self.worker.get() else {
            return;
        };
        if !st.overlapping
            || st.inflight.is_some()
            || st.recording
            || st.offload.is_some()
            || st.error.is_some()
        {
            return;
        }
        let Some(pos) = st.trace.iter().position(|&x| x == t) else {
            return;
        };
        let numel = self.plan.tensors()[t].numel;
        let mut bundle = Vec::new();
        let live = self.extend_bundle(st, pos, &mut bundle, 0, st.cache_elems + numel);
        if bundle.is_empty() {
            return;
        }
        let mut input = Vec::new();
        for &j in &bundle {
            if let Some(shard) = st.shards[j].clone() {
                input.extend(transfer::read_f32(shard));
            }
        }
        st.stats.all_gathers += 1;
        st.stats.gathered_ahead += 1;
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(live);
        let world = self.comm.world_size();
        let (wire, by_all_reduce) = (st.wire, self.fetch_by_all_reduce);
        let key = label("gather", &bundle);
        let pending = worker.submit(move |comm| {
            let mut out = vec![0.0f32; input.len() * world];
            let _span = tracing::trace_span!("zero3_all_gather", elems = out.len()).entered();
            comm.label_next(key);
            let before = comm.stats().total_sent();
            fetch(comm, wire, by_all_reduce, &input, &mut out)?;
            Ok((out, comm.stats().total_sent() - before))
        });
        st.inflight = Some(Inflight { bundle, pending });
    }

    /// This rank's chunk of tensor `t` from the parameter store. A failed read is this rank's
    /// alone: it is kept for the engine's next step, which the ranks agree on, and the gather
    /// goes on with zeros so that no peer waits in the collective.
    fn read_piece(&self, st: &mut State, t: usize) -> Vec<f32> {
        let chunk = self.plan.tensors()[t].chunk;
        let Some(o) = &st.offload else {
            return vec![0.0; chunk];
        };
        match o.store.read_chunk(t, chunk) {
            Ok(values) => values,
            Err(e) => {
                st.read_error.get_or_insert(e);
                vec![0.0; chunk]
            }
        }
    }

    /// Under `offload_param`: starts reading the pieces the trace of this phase has after `t`
    /// (beyond those already gathered ahead), so that the disk works while `t` is used.
    fn read_ahead(&self, st: &State, t: usize, phase: Phase) {
        let Some(o) = &st.offload else {
            return;
        };
        let trace = match phase {
            Phase::Forward if !st.recording => &st.trace,
            Phase::Backward if !st.brecording => &st.btrace,
            _ => return,
        };
        let Some(pos) = trace.iter().position(|&x| x == t) else {
            return;
        };
        let next: Vec<usize> = trace[pos + 1..]
            .iter()
            .copied()
            .filter(|j| !st.cache.contains_key(j) && !st.device_cache.contains_key(j))
            .collect();
        o.store.read_ahead(&next);
    }

    /// Extends `bundle` (holding `t`) with the tensors the trace has after `t`, within the
    /// prefetch bucket and the live cap.
    fn plan_prefetch(&self, st: &State, t: usize, bundle: &mut Vec<usize>) {
        let Some(pos) = st.trace.iter().position(|&x| x == t) else {
            return;
        };
        let numel = self.plan.tensors()[t].numel;
        self.extend_bundle(st, pos, bundle, numel, st.cache_elems + numel);
    }

    /// Extends `bundle` (of `elems` elements, with `live` elements held in all) with the
    /// tensors the trace has after position `pos` that are at hand and not cached, while the
    /// bundle stays within the prefetch bucket and the live elements within the cap. Returns
    /// the live elements then.
    fn extend_bundle(
        &self,
        st: &State,
        pos: usize,
        bundle: &mut Vec<usize>,
        mut elems: usize,
        mut live: usize,
    ) -> usize {
        let tensors = self.plan.tensors();
        for &j in &st.trace[pos + 1..] {
            // Under `offload_param` only pieces already read ahead join the bundle: the others
            // are still on disk, and the read-ahead brings them in while this one is used.
            let available = match &st.offload {
                Some(o) => o.store.is_at_hand(j),
                None => st.shards[j].is_some(),
            };
            let cached = st.cache.contains_key(&j) || st.device_cache.contains_key(&j);
            if bundle.contains(&j) || cached || !available {
                continue;
            }
            let n = tensors[j].numel;
            if elems + n > self.prefetch || live + n > self.max_live {
                break;
            }
            elems += n;
            live += n;
            bundle.push(j);
        }
        live
    }

    /// One all-gather of the chunks of `bundle` (this rank's in `shards`): every rank's
    /// chunks of all bundled tensors, back to back in rank order.
    fn all_gather(&self, st: &mut State, bundle: &[usize], shards: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let tensors = self.plan.tensors();
        let world = self.comm.world_size();
        let per_rank: usize = bundle.iter().map(|&j| tensors[j].chunk).sum();
        let mut input = Vec::with_capacity(per_rank);
        for (&j, s) in bundle.iter().zip(shards) {
            debug_assert_eq!(s.len(), tensors[j].chunk);
            input.extend_from_slice(s);
        }
        let mut out = vec![0.0f32; per_rank * world];
        if st.error.is_none() {
            st.stats.all_gathers += 1;
            let _span = tracing::trace_span!("zero3_all_gather", elems = out.len()).entered();
            self.comm.label_next(label("gather", bundle));
            let before = self.comm.stats().total_sent();
            let result = fetch(
                self.comm.as_ref(),
                st.wire,
                self.fetch_by_all_reduce,
                &input,
                &mut out,
            );
            st.stats.gather_bytes_sent += self.comm.stats().total_sent() - before;
            if let Err(e) = result {
                self.fail(st, e);
                out.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        self.split_wholes(bundle, &out)
    }

    /// Each tensor of `bundle` whole, from `out`: every rank's chunks of the bundle, back to
    /// back in rank order.
    fn split_wholes(&self, bundle: &[usize], out: &[f32]) -> Vec<Vec<f32>> {
        let tensors = self.plan.tensors();
        let world = self.comm.world_size();
        let per_rank: usize = bundle.iter().map(|&j| tensors[j].chunk).sum();
        let mut wholes: Vec<Vec<f32>> = bundle
            .iter()
            .map(|&j| Vec::with_capacity(tensors[j].chunk * world))
            .collect();
        for r in 0..world {
            let mut at = r * per_rank;
            for (k, &j) in bundle.iter().enumerate() {
                let c = tensors[j].chunk;
                wholes[k].extend_from_slice(&out[at..at + c]);
                at += c;
            }
        }
        for (w, &j) in wholes.iter_mut().zip(bundle) {
            w.truncate(tensors[j].numel);
        }
        wholes
    }

    /// From now on the op gathers and reduce-scatters the tensors of a Cube device (wgpu,
    /// CUDA) through `coll` on their own buffers ([`gather_on_device`](Self::gather_on_device)):
    /// NCCL moves them without leaving the GPU, the host collectives stage them as they must.
    /// Set once, by the device-resident regime.
    pub fn set_device_collectives(&self, coll: Arc<dyn DeviceCollectives>) {
        // A second call keeps the first collectives: a group has one transport.
        let _ = self.device.set(coll);
    }

    /// The device collectives, when the regime gathers on the device.
    pub fn device_collectives(&self) -> Option<&Arc<dyn DeviceCollectives>> {
        self.device.get()
    }

    /// [`gather`](Self::gather) on the device: tensor `t` whole (rank-1, `numel` elements)
    /// from this rank's `shard` (`chunk` elements), in the shard's dtype, through the device
    /// collectives. The same trace, prefetch bundles (one all-gather, the rest cached on the
    /// device) and counters as on the host.
    pub fn gather_on_device(&self, t: usize, shard: Tensor<1>, phase: Phase) -> Tensor<1> {
        let mut st = self.state();
        self.note_gather(&mut st, t, phase);
        if phase == Phase::Forward
            && let Some(values) = st.device_cache.remove(&t)
        {
            st.cache_elems -= values.dims()[0];
            return values;
        }
        let mut bundle = vec![t];
        if phase == Phase::Forward && !st.recording {
            self.plan_prefetch(&st, t, &mut bundle);
        }
        let dtype = shard.dtype();
        let mut shards = vec![shard];
        let mut fetched = vec![t];
        for &j in &bundle[1..] {
            if let Some(s) = st.shards.get(j).cloned().flatten() {
                fetched.push(j);
                shards.push(s.cast(dtype));
            }
        }
        let mut wholes = self.all_gather_on_device(&mut st, &fetched, shards);
        let first = wholes.remove(0);
        for (&j, values) in fetched[1..].iter().zip(wholes) {
            st.cache_elems += values.dims()[0];
            st.device_cache.insert(j, values);
        }
        let live = st.cache_elems + first.dims()[0];
        st.stats.peak_prefetched = st.stats.peak_prefetched.max(st.cache_elems);
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(live);
        first
    }

    /// One device all-gather of the chunks of `bundle` (`shards`, this rank's): each tensor
    /// whole, joined from every rank's chunk. A failed collective is kept (the world is
    /// aborted) and zeros come back.
    fn all_gather_on_device(
        &self,
        st: &mut State,
        bundle: &[usize],
        shards: Vec<Tensor<1>>,
    ) -> Vec<Tensor<1>> {
        let coll = self
            .device
            .get()
            .expect("gathers on the device have collectives");
        let tensors = self.plan.tensors();
        let (rank, world) = (coll.rank(), coll.world_size());
        let per_rank: usize = bundle.iter().map(|&j| tensors[j].chunk).sum();
        let (device, dtype) = (shards[0].device(), shards[0].dtype());
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
        let input = Tensor::cat(shards, 0);
        let mut out = None;
        if st.error.is_none() {
            st.stats.all_gathers += 1;
            st.stats.on_device += 1;
            let _span =
                tracing::trace_span!("zero3_all_gather", elems = per_rank * world).entered();
            if coll.kind() == "host" {
                self.comm.label_next(label("gather", bundle));
            }
            let before = self.comm.stats().total_sent();
            let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
                match self.fetch_by_all_reduce {
                    true => {
                        let padded = zeros(per_rank * world)
                            .slice_assign(rank * per_rank..(rank + 1) * per_rank, input);
                        c.all_reduce(padded, ReduceOp::Sum)
                    }
                    false => c.all_gather(input, &vec![per_rank; world]),
                }
            });
            st.stats.gather_bytes_sent += self.comm.stats().total_sent() - before;
            match result {
                Ok(o) => out = Some(o),
                Err(e) => self.fail(st, e),
            }
        }
        let out = out.unwrap_or_else(|| zeros(per_rank * world));
        let mut parts: Vec<Vec<Tensor<1>>> = vec![Vec::with_capacity(world); bundle.len()];
        for r in 0..world {
            let mut at = r * per_rank;
            for (k, &j) in bundle.iter().enumerate() {
                let c = tensors[j].chunk;
                parts[k].push(out.clone().slice(at..at + c));
                at += c;
            }
        }
        parts
            .into_iter()
            .zip(bundle)
            .map(|(p, &j)| Tensor::cat(p, 0).slice(0..tensors[j].numel))
            .collect()
    }

    /// [`reduce_scatter`](Self::reduce_scatter) on the device: this rank's chunk of the sum
    /// over ranks of tensor `t`'s whole gradient `grad` (rank-1), in its dtype.
    pub fn reduce_scatter_on_device(&self, t: usize, grad: Tensor<1>) -> Tensor<1> {
        let coll = self
            .device
            .get()
            .expect("gathers on the device have collectives");
        let mut st = self.state();
        self.end_forward(&mut st);
        st.stats.reduce_scatters += 1;
        let s = self.plan.tensors()[t];
        let world = coll.world_size();
        let (device, dtype) = (grad.device(), grad.dtype());
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
        let n = grad.dims()[0];
        let padded = match s.chunk * world > n {
            true => Tensor::cat(vec![grad, zeros(s.chunk * world - n)], 0),
            false => grad,
        };
        let padded = match self.pre {
            1.0 => padded,
            pre => padded.mul_scalar(pre),
        };
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(s.chunk * (world + 1));
        if st.error.is_some() {
            return zeros(s.chunk);
        }
        st.stats.on_device += 1;
        let _span = tracing::trace_span!("zero3_reduce_scatter", elems = s.chunk * world).entered();
        if coll.kind() == "host" {
            self.comm.label_next(label("reduce", &[t]));
        }
        let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
            c.reduce_scatter(padded, &vec![s.chunk; world])
        });
        match result {
            Ok(chunk) => chunk,
            Err(e) => {
                self.fail(&mut st, e);
                zeros(s.chunk)
            }
        }
    }

    /// Sends the chunks in `dtype` from now on (`None`: f32).
    pub fn set_wire(&self, dtype: Option<FloatDType>) {
        self.state().wire = dtype;
    }

    /// Records a failed collective, which this rank cannot agree on with its peers (they may
    /// be inside the next one): the world is aborted, so that they fail at once rather than
    /// wait, and [`ShardedSync`](crate::sync::ShardedSync)'s reduce reports the error.
    fn fail(&self, st: &mut State, e: CommError) {
        if !matches!(e, CommError::PeerFailed { .. }) {
            self.comm.abort(&format!("a ZeRO-3 collective failed: {e}"));
        }
        st.error = Some(e);
    }

    /// This rank's chunk of the sum over ranks of tensor `t`'s whole gradient `grad`.
    pub fn reduce_scatter(&self, t: usize, mut grad: Vec<f32>) -> Vec<f32> {
        let mut st = self.state();
        self.end_forward(&mut st);
        st.stats.reduce_scatters += 1;
        let s = self.plan.tensors()[t];
        grad.resize(s.chunk * self.comm.world_size(), 0.0);
        if self.pre != 1.0 {
            grad.iter_mut().for_each(|g| *g *= self.pre);
        }
        let mut out = vec![0.0f32; s.chunk];
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(grad.len() + out.len());
        if st.error.is_none() {
            let _span = tracing::trace_span!("zero3_reduce_scatter", elems = grad.len()).entered();
            self.comm.label_next(label("reduce", &[t]));
            if let Err(e) = self
                .comm
                .reduce_scatter_equal(&grad, &mut out, ReduceOp::Sum)
            {
                self.fail(&mut st, e);
                out.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        if let Some(o) = st.offload.as_mut() {
            // Summed into the rank's buffer; autodiff gets the placeholder's empty gradient.
            if let Some(at) = o.local_start[t] {
                let n = self.plan.own(self.comm.rank(), t).len();
                o.grads[at..at + n]
                    .iter_mut()
                    .zip(&out)
                    .for_each(|(s, g)| *s += g);
            }
            return Vec::new();
        }
        if st.wire.is_some() && st.keep_chunk_grads {
            match st.chunk_grads.get_mut(&t) {
                // A tensor read twice (tied weights) is reduce-scattered once per read.
                Some(sum) => sum.iter_mut().zip(&out).for_each(|(s, g)| *s += g),
                None => {
                    st.chunk_grads.insert(t, out.clone());
                }
            }
        }
        out
    }

    /// Whether a 16-bit module's reduce-scatters keep their f32 sums for
    /// [`take_chunk_grad`](Self::take_chunk_grad) (the default). A regime that reads the op's
    /// gradients in the parameter's dtype turns it off, so that nothing accumulates.
    pub fn keep_chunk_grads(&self, keep: bool) {
        let mut st = self.state();
        st.keep_chunk_grads = keep;
        if !keep {
            st.chunk_grads.clear();
        }
    }

    /// Tensor `t`'s chunk gradient in f32 as the reduce-scatters left it, since the last
    /// call (only for a 16-bit module; `None` otherwise or when it had no gradient).
    pub fn take_chunk_grad(&self, t: usize) -> Option<Vec<f32>> {
        self.state().chunk_grads.remove(&t)
    }
}

/// A label for the collective that moves `tensors` (a hash of their indices), so that ranks
/// pairing different tensors of the same shape fail instead of exchanging the wrong data (see
/// [`Communicator::label_next`]). `DefaultHasher::new` has fixed keys: every rank of one
/// binary computes the same label.
fn label(what: &str, tensors: &[usize]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    (what, tensors).hash(&mut h);
    h.finish() | 1
}

impl Drop for GatherGroup {
    fn drop(&mut self) {
        let mut reg = registry();
        if matches!(reg.get(&self.id), Some(Entry::Live(_))) {
            reg.remove(&self.id);
        }
    }
}

/// Every rank's `input` into `out` (rank order) on `comm`, travelling in `wire` (f32 when
/// `None`): an all-gather, or with `by_all_reduce` an all-reduce of a zero-padded buffer
/// (exact, as each position has one non-zero term).
fn fetch(
    comm: &dyn Communicator,
    wire: Option<FloatDType>,
    by_all_reduce: bool,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match wire {
        Some(FloatDType::F16) => fetch_as::<f16>(comm, by_all_reduce, input, out),
        Some(FloatDType::BF16) => fetch_as::<bf16>(comm, by_all_reduce, input, out),
        _ => fetch_as::<f32>(comm, by_all_reduce, input, out),
    }
}

/// [`fetch`] travelling as `T`.
fn fetch_as<T: Wire>(
    comm: &dyn Communicator,
    by_all_reduce: bool,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let input: Vec<T> = input.iter().map(|&x| T::narrow(x)).collect();
    let mut wire = vec![T::narrow(0.0); out.len()];
    if by_all_reduce {
        let rank = comm.rank();
        wire[rank * input.len()..(rank + 1) * input.len()].copy_from_slice(&input);
        comm.all_reduce(&mut wire, ReduceOp::Sum)?;
    } else {
        comm.all_gather_equal(&input, &mut wire)?;
    }
    out.iter_mut().zip(&wire).for_each(|(o, w)| *o = w.widen());
    Ok(())
}

/// A dtype chunks travel in, from and to the f32 the group computes in.
trait Wire: CommElement {
    fn narrow(x: f32) -> Self;
    fn widen(self) -> f32;
}

impl Wire for f32 {
    fn narrow(x: f32) -> Self {
        x
    }
    fn widen(self) -> f32 {
        self
    }
}

impl Wire for f16 {
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Wire for bf16 {
    fn narrow(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}
