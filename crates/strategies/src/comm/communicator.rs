//! The [`Communicator`] trait: the collectives every rank of an SPMD program calls.

use std::fmt::Debug;
use std::sync::Arc;

use super::{Buf, BufMut, CommElement, CommStats, CommsLog, even_split};
use crate::Result;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size.
    Mean,
    /// Element-wise maximum.
    Max,
}

/// One rank's handle on a world of ranks (SPMD, as DeepSpeed's `torch.distributed` groups).
///
/// Every rank runs the same program and calls the same collectives in the same order; a rank
/// that diverges, panics or stalls makes the others return an error rather than hang (the thread
/// world within its timeout; MPI by aborting the job).
///
/// The methods take dtype-tagged buffers so that the trait stays object-safe
/// (`Arc<dyn Communicator>`); [`CommunicatorExt`] adds the typed, generic forms, which are the
/// ones to call.
pub trait Communicator: Send + Sync + Debug {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Short name of the implementation (`"threads"`, `"mpi"`).
    fn backend(&self) -> &'static str;

    /// Reduces `buf` across ranks in place; every rank gets the result.
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Reduces `input` (the full length, `counts.iter().sum()`, on every rank) and leaves
    /// chunk `rank` (of `counts[rank]` elements, contiguous in rank order) in `output`.
    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    /// Concatenates every rank's `input` (of `counts[rank]` elements) in rank order into
    /// `output` (of `counts.iter().sum()` elements) on every rank.
    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()>;
    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Splits `input` into `world_size` equal chunks; chunk `j` goes to rank `j`, and `output`
    /// receives chunk `rank` of every rank, in rank order.
    fn all_to_all_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()>;
    /// Sends `buf` to rank `dst` with a tag; it returns once the message is buffered or delivered.
    fn send_buf(&self, buf: Buf<'_>, dst: usize, tag: u16) -> Result<()>;
    /// Receives the next message with `tag` from rank `src` into `buf` (lengths must match).
    fn recv_buf(&self, buf: BufMut<'_>, src: usize, tag: u16) -> Result<()>;
    /// Waits until every rank has reached the barrier.
    fn barrier(&self) -> Result<()>;
    /// This rank's counters since the communicator was created.
    fn stats(&self) -> CommStats;
    /// Gives up on behalf of this rank, which cannot go on and cannot tell its peers through
    /// an agreed collective (see [`agree`](super::agree)): every peer waiting in, or later
    /// calling, an operation of this communicator, of the world it was split from, or of any
    /// group split from either, fails at once with [`CommError::PeerFailed`](crate::CommError)
    /// naming this rank and `reason`. Under MPI the job is aborted (`MPI_Abort`, after
    /// printing the rank and `reason` to stderr), and the call does not return.
    fn abort(&self, reason: &str);
    /// Labels this rank's next collective with `key` (for example a hash of the tensors it
    /// moves). Ranks whose next collectives carry different labels fail with
    /// [`CommError::Mismatch`](crate::CommError) naming both calls, instead of silently
    /// pairing different data of the same shape. The thread world always checks; MPI checks
    /// in debug builds (where every collective carries a sequence number, its kind and its
    /// length), and release builds ignore the label.
    fn label_next(&self, key: u64) {
        let _ = key;
    }
    /// Marks this rank as busy on its own between two collectives (rank 0 writing a
    /// checkpoint, a rank reading its files) until [`end_solo`](Self::end_solo): peers that
    /// wait for it in a collective meanwhile wait on instead of timing out, however long the
    /// phase takes. The thread world honours it; MPI has no timeout to suspend. Prefer
    /// [`CommunicatorExt::solo`], which ends the phase however the work returns.
    fn begin_solo(&self, what: &'static str) {
        let _ = what;
    }
    /// Ends the phase [`begin_solo`](Self::begin_solo) began.
    fn end_solo(&self) {}
    /// Splits the world into groups (MPI's `MPI_Comm_split`): ranks that pass the same
    /// `color` form one new communicator, ranked in the order of their rank here. Every
    /// rank must call it (a collective); the groups' traffic is counted in their own stats.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>>;
    /// The communication log this communicator records into, when it is (or was split
    /// from) a [`CommsLogger`](super::CommsLogger); `None` otherwise.
    fn comms_log(&self) -> Option<Arc<CommsLog>> {
        None
    }
}

macro_rules! comm_span {
    ($name:literal, $self:ident, $len:expr) => {
        tracing::trace_span!(
            $name,
            rank = $self.rank(),
            world = $self.world_size(),
            elems = $len
        )
        .entered()
    };
}

/// Typed forms of the [`Communicator`] collectives, with a `tracing` span around each.
pub trait CommunicatorExt: Communicator {
    /// See [`Communicator::all_reduce_buf`].
    fn all_reduce<T: CommElement>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let _span = comm_span!("all_reduce", self, buf.len());
        self.all_reduce_buf(T::buf_mut(buf), op)
    }
    /// Reduce-scatter with per-rank chunk sizes; see [`Communicator::reduce_scatter_buf`].
    fn reduce_scatter<T: CommElement>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let _span = comm_span!("reduce_scatter", self, input.len());
        self.reduce_scatter_buf(T::buf(input), T::buf_mut(output), counts, op)
    }
    /// Reduce-scatter of an input whose length divides evenly by the world size.
    fn reduce_scatter_equal<T: CommElement>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = vec![output.len(); self.world_size()];
        self.reduce_scatter(input, output, &counts, op)
    }
    /// All-gather with per-rank chunk sizes; see [`Communicator::all_gather_buf`].
    fn all_gather<T: CommElement>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let _span = comm_span!("all_gather", self, output.len());
        self.all_gather_buf(T::buf(input), T::buf_mut(output), counts)
    }
    /// All-gather of equal chunks (`output.len() == input.len() * world_size`).
    fn all_gather_equal<T: CommElement>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = vec![input.len(); self.world_size()];
        self.all_gather(input, output, &counts)
    }
    /// See [`Communicator::broadcast_buf`].
    fn broadcast<T: CommElement>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let _span = comm_span!("broadcast", self, buf.len());
        self.broadcast_buf(T::buf_mut(buf), root)
    }
    /// See [`Communicator::all_to_all_buf`].
    fn all_to_all<T: CommElement>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let _span = comm_span!("all_to_all", self, input.len());
        self.all_to_all_buf(T::buf(input), T::buf_mut(output))
    }
    /// See [`Communicator::send_buf`].
    fn send<T: CommElement>(&self, buf: &[T], dst: usize, tag: u16) -> Result<()> {
        let _span = comm_span!("send", self, buf.len());
        self.send_buf(T::buf(buf), dst, tag)
    }
    /// See [`Communicator::recv_buf`].
    fn recv<T: CommElement>(&self, buf: &mut [T], src: usize, tag: u16) -> Result<()> {
        let _span = comm_span!("recv", self, buf.len());
        self.recv_buf(T::buf_mut(buf), src, tag)
    }
    /// Runs `work`, this rank's own between two collectives, as a solo phase `what` (see
    /// [`Communicator::begin_solo`]): peers waiting for this rank meanwhile do not time out.
    fn solo<R>(&self, what: &'static str, work: impl FnOnce() -> R) -> R {
        struct End<'a, C: Communicator + ?Sized>(&'a C);
        impl<C: Communicator + ?Sized> Drop for End<'_, C> {
            fn drop(&mut self) {
                self.0.end_solo();
            }
        }
        self.begin_solo(what);
        let _end = End(self);
        work()
    }
    /// The even split of `n` elements over this world (see [`even_split`]).
    fn even_counts(&self, n: usize) -> Vec<usize> {
        even_split(n, self.world_size())
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
