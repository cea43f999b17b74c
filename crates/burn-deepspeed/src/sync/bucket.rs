//! ZeRO stage 2's streaming bucket: gradients in layout order are appended, and every full
//! bucket is reduce-scattered into the owners' slices, so that a rank never holds more than
//! one bucket of other ranks' gradients.
//!
//! Under `overlap_comm` ([`Overlap`]) a full bucket goes to the rank's communication thread
//! instead, and the rank goes on with the next micro-batch while it is reduced; the reduced
//! parts are added into the slice, in the order the buckets were filled, when the rank next
//! touches the slice. The rank then holds one micro-batch's buckets until they are reduced.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use burn_deepspeed_strategies::comm::{
    CommWorker, Communicator, CommunicatorExt, Pending, ReduceOp,
};
use burn_deepspeed_strategies::zero::FlatPartition;

use super::elem::GradElem;
use crate::{DeepSpeedError, Result};

/// `overlap_comm`: a rank's communication thread and the buckets it is reducing.
#[derive(Debug)]
pub(super) struct Overlap<G: GradElem> {
    worker: CommWorker,
    /// Buckets submitted, oldest first, not yet added into the slice.
    inflight: VecDeque<Pending<Reduced<G>>>,
    /// Elements staged in `inflight` (their buckets and reduced parts).
    inflight_elems: usize,
    /// Bucket buffers to fill again.
    spare: Vec<Vec<G>>,
}

/// One bucket reduced on the communication thread.
#[derive(Debug)]
struct Reduced<G> {
    /// The bucket's buffer, to reuse.
    buf: Vec<G>,
    /// This rank's part of the bucket, as flat offsets.
    mine: Range<usize>,
    /// The sums of `mine` over the ranks.
    out: Vec<G>,
}

impl<G: GradElem + Send + 'static> Overlap<G> {
    /// The communication thread of `comm`'s rank.
    pub fn spawn(comm: Arc<dyn Communicator>) -> Result<Self> {
        Ok(Self {
            worker: CommWorker::spawn(comm)?,
            inflight: VecDeque::new(),
            inflight_elems: 0,
            spare: Vec::new(),
        })
    }

    /// Waits for every submitted bucket and adds its reduced part into `slice` (whose first
    /// element is flat offset `own_start`), oldest first. Returns the first failure, after
    /// which the later buckets were not reduced.
    pub fn settle(&mut self, slice: &mut [G], own_start: usize) -> Option<DeepSpeedError> {
        let mut error = None;
        while let Some(pending) = self.inflight.pop_front() {
            match pending.wait() {
                Ok(Reduced { mut buf, mine, out }) => {
                    add_part(slice, own_start, &mine, &out);
                    buf.clear();
                    self.spare.push(buf);
                }
                Err(e) => {
                    error.get_or_insert(e.into());
                }
            }
        }
        self.inflight_elems = 0;
        error
    }

    /// Waits until the communication thread is idle, so that the rank may call collectives of
    /// the same communicator itself. The reduced buckets wait for [`settle`](Self::settle).
    pub fn quiesce(&self) {
        // A failure here is one of the buckets', which `settle` reports.
        let _ = self.worker.quiesce();
    }

    /// Bytes of staged buckets held to reuse or being reduced.
    pub fn held_bytes(&self) -> u64 {
        let spare: usize = self.spare.iter().map(Vec::capacity).sum();
        (size_of::<G>() * (spare + self.inflight_elems)) as u64
    }
}

/// Adds a reduced part `out` of flat range `mine` into `slice`, which starts at `own_start`.
fn add_part<G: GradElem>(slice: &mut [G], own_start: usize, mine: &Range<usize>, out: &[G]) {
    let dst = &mut slice[mine.start - own_start..mine.end - own_start];
    dst.iter_mut()
        .zip(out)
        .for_each(|(d, v)| *d = G::narrow(d.widen() + v.widen()));
}

/// Reduces one bucket (flat range `range`) over the ranks and returns the sums of this rank's
/// part `mine`: a reduce-scatter, or with `reduce_scatter` off an all-reduce of which the own
/// part is kept.
fn reduce_bucket<G: GradElem>(
    comm: &dyn Communicator,
    buf: &mut [G],
    range: &Range<usize>,
    mine: &Range<usize>,
    counts: &[usize],
    reduce_scatter: bool,
) -> burn_deepspeed_strategies::Result<Vec<G>> {
    let mut out = vec![G::default(); mine.len()];
    let _span = tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
    if reduce_scatter {
        comm.reduce_scatter(buf, &mut out, counts, ReduceOp::Sum)?;
    } else {
        comm.all_reduce(buf, ReduceOp::Sum)?;
        if !mine.is_empty() {
            out.copy_from_slice(&buf[mine.start - range.start..mine.end - range.start]);
        }
    }
    Ok(out)
}

/// One micro-batch's stream of gradients into this rank's slice.
pub(super) struct Bucket<'a, G: GradElem> {
    pub comm: &'a dyn Communicator,
    pub partition: &'a FlatPartition,
    /// Flat offset of `slice[0]`.
    pub own_start: usize,
    /// This rank's accumulated slice.
    pub slice: &'a mut [G],
    pub buf: Vec<G>,
    pub cap: usize,
    /// Flat offset of `buf[0]`.
    pub start: usize,
    /// Factor applied before the reduction.
    pub pre: f32,
    /// `reduce_scatter`: false all-reduces each bucket and keeps the own part.
    pub reduce_scatter: bool,
    /// The first collective failure; later buckets are skipped.
    pub error: Option<DeepSpeedError>,
    /// The most elements staged at once (the buckets and the reduced parts).
    pub peak_elems: usize,
    /// `overlap_comm`: full buckets go to the communication thread.
    pub overlap: Option<&'a mut Overlap<G>>,
}

impl<G: GradElem> Bucket<'_, G> {
    /// Appends gradient values.
    pub fn push(&mut self, mut values: &[f32]) {
        while !values.is_empty() {
            let take = (self.cap - self.buf.len()).min(values.len());
            let pre = self.pre;
            self.buf
                .extend(values[..take].iter().map(|&g| G::narrow(g * pre)));
            values = &values[take..];
            if self.buf.len() == self.cap {
                self.flush();
            }
        }
    }

    /// Appends `n` zeros (a tensor without a gradient on this rank).
    pub fn push_zeros(&mut self, mut n: usize) {
        while n > 0 {
            let take = (self.cap - self.buf.len()).min(n);
            self.buf.resize(self.buf.len() + take, G::default());
            n -= take;
            if self.buf.len() == self.cap {
                self.flush();
            }
        }
    }

    /// Reduce-scatters what is staged: here, or under `overlap_comm` on the communication
    /// thread.
    pub fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let range = self.start..self.start + self.buf.len();
        self.start = range.end;
        if self.error.is_some() {
            self.buf.clear();
            return;
        }
        let rank = self.comm.rank();
        let mine = self.partition.own_in(rank, &range);
        let counts = self.partition.counts_in(&range);
        if let Some(overlap) = self.overlap.as_deref_mut() {
            let fresh = overlap
                .spare
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(self.cap));
            let mut buf = std::mem::replace(&mut self.buf, fresh);
            let reduce_scatter = self.reduce_scatter;
            overlap.inflight_elems += buf.capacity() + mine.len();
            self.peak_elems = self
                .peak_elems
                .max(overlap.inflight_elems + self.buf.capacity());
            overlap
                .inflight
                .push_back(overlap.worker.submit(move |comm| {
                    reduce_bucket(comm, &mut buf, &range, &mine, &counts, reduce_scatter)
                        .map(|out| Reduced { buf, mine, out })
                }));
            return;
        }
        self.peak_elems = self.peak_elems.max(self.buf.capacity() + mine.len());
        match reduce_bucket(
            self.comm,
            &mut self.buf,
            &range,
            &mine,
            &counts,
            self.reduce_scatter,
        ) {
            Ok(out) => add_part(self.slice, self.own_start, &mine, &out),
            Err(e) => self.error = Some(e.into()),
        }
        self.buf.clear();
    }
}
