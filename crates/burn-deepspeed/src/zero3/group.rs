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

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn::tensor::{FloatDType, Tensor};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{CommWorker, Communicator, Pending};
use burn_deepspeed_strategies::device::DeviceCollectives;
use burn_deepspeed_strategies::zero::ShardPlan;

use super::chunks::Chunks;
use super::quantized_grads::Hierarchy;
use super::registry::{ALIASES, Entry, NEXT_ID, registry};
use super::secondary::Secondary;
use super::store::ParamStore;

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
    /// its device collectives (`Chunks` of the device) rather than host copies.
    pub on_device: u64,
    /// Bytes this rank's transport sent for the parameter fetches (measured around each
    /// collective; half as many for a 16-bit model as for an f32 one).
    pub gather_bytes_sent: u64,
    /// Backward gathers served from the node's secondary slices (ZeRO++'s hpZ), and the
    /// bytes this rank sent for them (inside its node).
    pub secondary_gathers: u64,
    /// See `secondary_gathers`.
    pub secondary_bytes_sent: u64,
    /// Gradients reduced by ZeRO++'s quantized all-to-alls (qgZ) instead of a reduce-scatter,
    /// and the bytes this rank sent for them inside its node and across nodes.
    pub quantized_reductions: u64,
    /// See `quantized_reductions`.
    pub grad_bytes_in_node: u64,
    /// See `quantized_reductions`.
    pub grad_bytes_across_nodes: u64,
    /// Most elements held by the prefetch cache at once.
    pub peak_prefetched: usize,
    /// Most elements one gather or reduce-scatter had allocated at once, the prefetch cache
    /// included: gathered weights (and prefetched ones), or a whole gradient padded for its
    /// reduce-scatter and the chunk it leaves. Counted where they are allocated.
    pub peak_live_elems: usize,
}

pub(crate) struct State {
    /// The module's current shards (flat, `chunk` elements, no autodiff), for prefetching.
    pub(super) shards: Vec<Option<Tensor<1>>>,
    pub(super) trace: Vec<usize>,
    /// Recording the first forward's order.
    pub(super) recording: bool,
    pub(super) cache: HashMap<usize, Vec<f32>>,
    /// The prefetched tensors of gathers on the device.
    pub(super) device_cache: HashMap<usize, Tensor<1>>,
    pub(super) cache_elems: usize,
    pub(super) error: Option<CommError>,
    pub(super) stats: GatherStats,
    /// The dtype the chunks travel in: the module's working dtype, so that a 16-bit model's
    /// gathers move 2 bytes per element (its values are 16-bit already, so nothing rounds).
    pub(super) wire: Option<FloatDType>,
    /// ZeRO++'s qwZ: the chunks travel as int8 codes with one step per group, whatever
    /// `wire` says.
    pub(super) quantized: bool,
    /// ZeRO++'s hpZ: the slices kept for the backward's gathers inside the node.
    pub(super) secondary: Option<Secondary>,
    /// ZeRO++'s qgZ: the node and cross-node communicators the gradients' quantized
    /// all-to-alls run on, replacing the reduce-scatter.
    pub(super) hierarchy: Option<Hierarchy>,
    /// With a 16-bit module: the f32 sums the reduce-scatters produced since the last
    /// [`take_chunk_grad`](GatherGroup::take_chunk_grad), per tensor. The op's gradient has the
    /// parameter's dtype and would round them; the sync reads these instead.
    pub(super) chunk_grads: HashMap<usize, Vec<f32>>,
    /// Whether `chunk_grads` are kept (a regime that reads the op's gradients, rounded to the
    /// parameter's dtype, turns them off).
    pub(super) keep_chunk_grads: bool,
    /// Under `offload_param`: where the partitioned tensors' pieces live (the module holds
    /// empty placeholders), and the rank's accumulated chunk gradients in its buffer order.
    pub(super) offload: Option<Offload>,
    /// The order of the first backward's re-gathers, for reading ahead (recorded while
    /// `brecording`).
    pub(super) btrace: Vec<usize>,
    pub(super) brecording: bool,
    /// The phase of the last gather (a change ends the pass's read-ahead).
    pub(super) last_phase: Option<Phase>,
    /// A failed read of this rank's parameter store: unlike `error`, the collectives go on
    /// (with zeros), so that no peer waits on this rank before the step agrees on it.
    pub(super) read_error: Option<CommError>,
    /// Whether a fetch hands the next bundle's all-gather to the communication thread (set
    /// for the engine's forward passes, with a worker).
    pub(super) overlapping: bool,
    /// The bundle being all-gathered on the communication thread.
    pub(super) inflight: Option<Inflight>,
}

/// A prefetch bundle all-gathered on the communication thread.
pub(super) struct Inflight {
    pub(super) bundle: Vec<usize>,
    /// Every rank's chunks of the bundle (rank order), and the bytes the transport sent.
    pub(super) pending: Pending<(Vec<f32>, u64)>,
}

/// The parameter pieces of an `offload_param` rank and the gradients of its pieces.
pub(super) struct Offload {
    pub(super) store: Arc<ParamStore>,
    /// Where tensor `t`'s piece starts in the rank's buffer.
    pub(super) local_start: Vec<Option<usize>>,
    /// The sum of the chunk gradients since the last exchange, this rank's pieces back to
    /// back: the reduce-scatters add into it, so that no per-tensor gradient outlives its
    /// backward step.
    pub(super) grads: Vec<f32>,
}

/// One rank's stage-3 fetcher: the plan, the communicator and the prefetch state.
pub struct GatherGroup {
    pub(super) id: u64,
    pub(super) comm: Arc<dyn Communicator>,
    pub(super) plan: ShardPlan,
    pub(super) shapes: Vec<Vec<usize>>,
    pub(super) prefetch: usize,
    pub(super) max_live: usize,
    /// Factor applied to gradients before the reduce-scatter (`gradient_predivide_factor`).
    pub(super) pre: f32,
    /// Fetch with an all-reduce of a zero-padded buffer instead of an all-gather
    /// (`stage3_use_all_reduce_for_fetch_params`): the same values, twice the traffic.
    pub(super) fetch_by_all_reduce: bool,
    /// The collectives on the device's buffers, when the regime gathers there
    /// ([`set_device_collectives`](GatherGroup::set_device_collectives)).
    pub(super) device: OnceLock<Arc<dyn DeviceCollectives>>,
    /// The communication thread that all-gathers bundles ahead (`overlap_comm`).
    pub(super) worker: OnceLock<CommWorker>,
    pub(super) state: Mutex<State>,
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
                quantized: false,
                secondary: None,
                hierarchy: None,
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

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
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

    /// From now on the op gathers and reduce-scatters the tensors of a Cube device (wgpu,
    /// CUDA) through `coll` on their own buffers: NCCL moves them without leaving the GPU, the
    /// host collectives stage them as they must. Set once, by the device-resident regime.
    pub fn set_device_collectives(&self, coll: Arc<dyn DeviceCollectives>) {
        // A second call keeps the first collectives: a group has one transport.
        let _ = self.device.set(coll);
    }

    /// The device collectives, when the regime gathers on the device.
    pub fn device_collectives(&self) -> Option<&Arc<dyn DeviceCollectives>> {
        self.device.get()
    }

    /// Marks this group's parameters whole again: from now on the op passes stored values
    /// through unchanged. Called once the module's shards were replaced by whole tensors.
    pub fn release(&self) {
        registry().insert(self.id, Entry::Whole);
    }

    /// Makes the keys of the prepared id `prepared` (see `prepared_id`) resolve to this
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

    /// Tensor `t` whole (rank-1, `numel` elements) from this rank's `shard` (`chunk`
    /// elements), as host values or on the device ([`Chunks`]): from the prefetch cache, or
    /// by one all-gather of the bundle the trace names from `t` on (for a forward), whose
    /// other tensors are cached until asked for.
    pub(crate) fn gather<C: Chunks>(&self, t: usize, shard: C, phase: Phase) -> C {
        let mut st = self.state();
        self.note_gather(&mut st, t, phase);
        if phase == Phase::Backward
            && let Some(whole) = C::from_secondary(self, &mut st, t)
        {
            return whole;
        }
        if phase == Phase::Forward {
            let coming = st.inflight.as_ref().is_some_and(|f| f.bundle.contains(&t));
            if coming {
                self.settle_inflight(&mut st, true);
            }
            if let Some(values) = C::cached(&mut st, t, &shard) {
                st.cache_elems -= values.len();
                C::keep_secondary(self, &mut st, &[t], std::slice::from_ref(&values));
                self.read_ahead(&st, t, phase);
                if C::gathers_ahead(self) {
                    self.gather_ahead(&mut st, t);
                }
                return values;
            }
        }
        // This rank's own collective comes next: the one in flight ends first (its tensors
        // are kept for this forward).
        self.settle_inflight(&mut st, phase == Phase::Forward);
        let shard = C::own(self, &mut st, t, shard);
        let mut bundle = vec![t];
        if phase == Phase::Forward && !st.recording {
            self.plan_prefetch(&st, t, &mut bundle);
        }
        let mut fetched = vec![t];
        let mut shards = vec![shard];
        for &j in &bundle[1..] {
            if let Some(s) = C::bundled(self, &mut st, j, &shards[0]) {
                fetched.push(j);
                shards.push(s);
            }
        }
        let mut wholes = C::all_gather(self, &mut st, &fetched, shards);
        if phase == Phase::Forward {
            C::keep_secondary(self, &mut st, &fetched, &wholes);
        }
        let first = wholes.remove(0);
        for (&j, values) in fetched[1..].iter().zip(wholes) {
            st.cache_elems += values.len();
            C::cache(&mut st).insert(j, values);
        }
        st.stats.peak_prefetched = st.stats.peak_prefetched.max(st.cache_elems);
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(st.cache_elems + first.len());
        debug_assert_eq!(first.len(), self.plan.tensors()[t].numel);
        self.read_ahead(&st, t, phase);
        if phase == Phase::Forward && C::gathers_ahead(self) {
            self.gather_ahead(&mut st, t);
        }
        first
    }

    /// This rank's chunk of tensor `t` from the parameter store. A failed read is this rank's
    /// alone: it is kept for the engine's next step, which the ranks agree on, and the gather
    /// goes on with zeros so that no peer waits in the collective.
    pub(super) fn read_piece(&self, st: &mut State, t: usize) -> Vec<f32> {
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

    /// Each tensor of `bundle` whole, from `out`: every rank's chunks of the bundle, back to
    /// back in rank order.
    pub(super) fn split_wholes(&self, bundle: &[usize], out: &[f32]) -> Vec<Vec<f32>> {
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

    /// Sends the chunks as int8 codes from now on (ZeRO++'s qwZ,
    /// `zero_optimization.zero_quantized_weights`), or as [`set_wire`](Self::set_wire) says.
    /// Host chunks only: the device regime refuses the key.
    pub fn set_quantized_weights(&self, on: bool) {
        self.state().quantized = on;
    }

    /// Keeps secondary slices over `node`, the communicator of this rank's node, from the
    /// next forward on, and serves the backward's gathers from them (ZeRO++'s hpZ,
    /// `zero_optimization.zero_hpz_partition_size`). Host chunks only.
    pub fn set_secondary(&self, node: Arc<dyn Communicator>) {
        self.state().secondary = Some(Secondary::new(node));
    }

    /// Reduces gradients by quantized all-to-alls over `hierarchy` from now on (ZeRO++'s qgZ,
    /// `zero_optimization.zero_quantized_gradients`). Host chunks only.
    pub(crate) fn set_quantized_gradients(&self, hierarchy: Hierarchy) {
        self.state().hierarchy = Some(hierarchy);
    }

    /// Drops the secondary slices (hpZ): the parameters changed.
    pub fn forget_secondary(&self) {
        if let Some(secondary) = self.state().secondary.as_mut() {
            secondary.forget();
        }
    }

    /// Elements this rank holds in secondary slices.
    pub fn secondary_elems(&self) -> usize {
        self.state().secondary.as_ref().map_or(0, Secondary::elems)
    }

    /// Sends the chunks in `dtype` from now on (`None`: f32).
    pub fn set_wire(&self, dtype: Option<FloatDType>) {
        self.state().wire = dtype;
    }

    /// Records a failed collective, which this rank cannot agree on with its peers (they may
    /// be inside the next one): the world is aborted, so that they fail at once rather than
    /// wait, and [`ShardedSync`](crate::sync::ShardedSync)'s reduce reports the error.
    pub(super) fn fail(&self, st: &mut State, e: CommError) {
        if !matches!(e.root_cause(), CommError::PeerFailed { .. }) {
            self.comm.abort(&format!("a ZeRO-3 collective failed: {e}"));
        }
        st.error = Some(e);
    }

    /// This rank's chunk of the sum over ranks of tensor `t`'s whole gradient `grad` (rank-1,
    /// as host values or on the device), times `gradient_predivide_factor`'s factor.
    pub(crate) fn reduce_scatter<C: Chunks>(&self, t: usize, grad: C) -> C {
        let mut st = self.state();
        self.end_forward(&mut st);
        st.stats.reduce_scatters += 1;
        let s = self.plan.tensors()[t];
        let world = self.comm.world_size();
        let padded = grad.padded(s.chunk * world, self.pre);
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(s.chunk * (world + 1));
        let chunk = C::reduce_scatter(self, &mut st, t, padded, s.chunk);
        C::keep(self, &mut st, t, chunk)
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
pub(super) fn label(what: &str, tensors: &[usize]) -> u64 {
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
