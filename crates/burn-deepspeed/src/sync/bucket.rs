//! ZeRO stage 2's streaming bucket: gradients in layout order are appended, and every full
//! bucket is reduce-scattered into the owners' slices, so that a rank never holds more than
//! one bucket of other ranks' gradients.

use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::zero::FlatPartition;

use super::elem::GradElem;
use crate::DeepSpeedError;

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
    /// The most elements staged at once (the bucket and the reduced part).
    pub peak_elems: usize,
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

    /// Reduce-scatters what is staged.
    pub fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let range = self.start..self.start + self.buf.len();
        self.start = range.end;
        if self.error.is_none() {
            let rank = self.comm.rank();
            let mine = self.partition.own_in(rank, &range);
            let counts = self.partition.counts_in(&range);
            let mut out = vec![G::default(); mine.len()];
            self.peak_elems = self.peak_elems.max(self.buf.capacity() + out.len());
            let _span =
                tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
            let reduced = if self.reduce_scatter {
                self.comm
                    .reduce_scatter(&self.buf, &mut out, &counts, ReduceOp::Sum)
            } else {
                self.comm
                    .all_reduce(&mut self.buf, ReduceOp::Sum)
                    .map(|()| {
                        if !mine.is_empty() {
                            out.copy_from_slice(
                                &self.buf[mine.start - range.start..mine.end - range.start],
                            )
                        }
                    })
            };
            match reduced {
                Ok(()) => {
                    let dst =
                        &mut self.slice[mine.start - self.own_start..mine.end - self.own_start];
                    dst.iter_mut()
                        .zip(out)
                        .for_each(|(d, v)| *d = G::narrow(d.widen() + v.widen()));
                }
                Err(e) => self.error = Some(e.into()),
            }
        }
        self.buf.clear();
    }
}
