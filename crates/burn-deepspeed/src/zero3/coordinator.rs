//! The gather group's trace and prefetch (DeepSpeed's `partitioned_param_coordinator`): the
//! order the first forward asks for tensors, the bundles a miss fetches from it, and the
//! bundle handed to the communication thread under `overlap_comm`.

use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::CommWorker;

use super::group::*;
use super::wire::fetch_as_set;
use crate::transfer;

impl GatherGroup {
    /// Drops prefetched tensors and ends the trace recording (the backward has begun).
    pub(super) fn end_forward(&self, st: &mut State) {
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
    pub(super) fn note_gather(&self, st: &mut State, t: usize, phase: Phase) {
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
    pub(super) fn settle_inflight(&self, st: &mut State, keep: bool) {
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
    pub(super) fn gather_ahead(&self, st: &mut State, t: usize) {
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
                // On a device, the all-gather's staging.
                input.extend(transfer::staging(|| transfer::read_f32(shard)));
            }
        }
        st.stats.all_gathers += 1;
        st.stats.gathered_ahead += 1;
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(live);
        let world = self.comm.world_size();
        // As the rank's own gathers travel: int8 codes under qwZ, else the wire dtype.
        let (quantized, wire, by_all_reduce) = (st.quantized, st.wire, self.fetch_by_all_reduce);
        let key = label("gather", &bundle);
        let pending = worker.submit(move |comm| {
            let mut out = vec![0.0f32; input.len() * world];
            let _span = tracing::trace_span!("zero3_all_gather", elems = out.len()).entered();
            comm.label_next(key);
            let before = comm.stats().total_sent();
            fetch_as_set(comm, quantized, wire, by_all_reduce, &input, &mut out)?;
            Ok((out, comm.stats().total_sent() - before))
        });
        st.inflight = Some(Inflight { bundle, pending });
    }

    /// Under `offload_param`: starts reading the pieces the trace of this phase has after `t`
    /// (beyond those already gathered ahead), so that the disk works while `t` is used.
    pub(super) fn read_ahead(&self, st: &State, t: usize, phase: Phase) {
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
    pub(super) fn plan_prefetch(&self, st: &State, t: usize, bundle: &mut Vec<usize>) {
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
    pub(super) fn extend_bundle(
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
}
