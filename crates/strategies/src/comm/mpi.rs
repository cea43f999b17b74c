//! The MPI world: one process per rank under `mpirun`, through the `mpi` crate (rsmpi).
//!
//! MPI is initialized once per process (`MPI_THREAD_SERIALIZED`), and every call goes through
//! one mutex, so the communicator may be shared between threads. A rank that panics calls
//! `MPI_Abort`, and `mpirun` then ends every other rank instead of leaving them blocked.
//!
//! Reductions of f16/bf16 run in f32 and of u8 in u32 (MPI has no 16-bit float types and its
//! u8 sum would overflow before a mean), with the same semantics as the thread world. Data
//! movement (gather, broadcast, all-to-all, send/recv) travels as raw bytes.
//!
//! MPI counts are `i32`: a buffer larger than [`MAX_MESSAGE`] bytes travels in several calls
//! of at most that size, never as a wrapped count. In debug builds every collective is
//! preceded by a small all-gather of its sequence number, kind, dtype, length and label, so
//! ranks that call different collectives fail with [`CommError::Mismatch`] naming both calls
//! instead of exchanging the wrong data.

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once};

use half::{bf16, f16};
use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::traits::*;

use super::{Buf, BufMut, CommStats, Communicator, DType, OpKind, ReduceOp, op_cost};
use crate::{CommError, Result};

/// The most bytes one MPI call moves per buffer (well inside `i32` counts). Larger buffers
/// travel in pieces; `BURN_DEEPSPEED_MPI_MAX_MESSAGE` (bytes) lowers the limit, which the
/// tests use to split small buffers.
pub const MAX_MESSAGE: usize = 1 << 30;

fn message_limit() -> usize {
    std::env::var("BURN_DEEPSPEED_MPI_MAX_MESSAGE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(MAX_MESSAGE, |v| v.clamp(8, MAX_MESSAGE) / 8 * 8)
}

/// `0..len` cut into consecutive ranges of at most `limit` (one empty range when `len` is 0,
/// so that a sender and its receiver always make the same number of calls).
fn pieces(len: usize, limit: usize) -> Vec<Range<usize>> {
    if len == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..len)
        .step_by(limit)
        .map(|a| a..(a + limit).min(len))
        .collect()
}

fn mpi_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
    }
}

/// The MPI environment of the process: dropping the universe finalizes MPI, so it lives as
/// long as the last communicator. Its mutex serializes every MPI call of the process.
struct Env {
    _universe: Universe,
}

// SAFETY: MPI was initialized with MPI_THREAD_SERIALIZED and every MPI call goes through the
// mutex around `Env`, so no two MPI calls ever run concurrently.
unsafe impl Send for Env {}

/// An MPI communicator handle, used only while the [`Env`] mutex is held.
struct Handle(ManuallyDrop<SimpleCommunicator>);

// SAFETY: as for `Env`: the handle is only touched under the process-wide MPI mutex.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// The MPI mutex held, with the communicator to call.
struct Locked<'a> {
    _guard: MutexGuard<'a, Env>,
    world: &'a SimpleCommunicator,
}

/// One process's handle on an MPI communicator: `MPI_COMM_WORLD` from
/// [`init`](MpiCommunicator::init), or a group from [`Communicator::split`].
pub struct MpiCommunicator {
    comm: Handle,
    env: Arc<Mutex<Env>>,
    rank: usize,
    size: usize,
    /// Bytes per MPI call at most (see [`MAX_MESSAGE`]).
    limit: usize,
    /// Collectives called so far (the debug-build sequence check).
    seq: AtomicU64,
    /// The label of the next collective (0: none).
    key: AtomicU64,
    stats: Mutex<CommStats>,
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        let _guard = self.env.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle is dropped once, here, and never used again; freeing a split
        // communicator is an MPI call, so it happens under the mutex (and before the last
        // `env` reference can finalize MPI).
        unsafe { ManuallyDrop::drop(&mut self.comm.0) };
    }
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiCommunicator {
    /// Initializes MPI and returns this process's communicator.
    ///
    /// Fails if MPI was already initialized in this process (MPI allows it once), or if the
    /// library cannot provide serialized multi-threading.
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::Mpi("MPI was already initialized in this process".into()))?;
        if threading < Threading::Serialized {
            return Err(CommError::Mpi(format!(
                "the MPI library offers only {threading:?} threading; Serialized is needed"
            )));
        }
        let world = universe.world();
        install_abort_on_panic();
        Ok(Self::wrap(
            world,
            Arc::new(Mutex::new(Env {
                _universe: universe,
            })),
        ))
    }

    fn wrap(comm: SimpleCommunicator, env: Arc<Mutex<Env>>) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            comm: Handle(ManuallyDrop::new(comm)),
            env,
            rank,
            size,
            limit: message_limit(),
            seq: AtomicU64::new(0),
            key: AtomicU64::new(0),
            stats: Mutex::new(CommStats::default()),
        }
    }

    /// In debug builds, checks that every rank's next collective is the same call (kind,
    /// dtype, total length, root, label) at the same sequence number; a mismatch names both.
    /// Release builds only consume the label.
    fn check_call(&self, kind: OpKind, dtype: DType, total: usize, root: usize) -> Result<()> {
        let key = self.key.swap(0, Ordering::SeqCst);
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        if !cfg!(debug_assertions) || self.size == 1 {
            return Ok(());
        }
        let header = CallHeader {
            seq,
            key,
            total: total as u64,
            kind: OpKind::ALL.iter().position(|k| *k == kind).unwrap_or(0) as u8,
            dtype: dtype as u8,
            root: root as u32,
        };
        let mine = header.to_bytes();
        let mut all = vec![0u8; CallHeader::BYTES * self.size];
        self.lock().world.all_gather_into(&mine[..], &mut all[..]);
        for (r, theirs) in all.chunks_exact(CallHeader::BYTES).enumerate() {
            if theirs != mine {
                let theirs = CallHeader::from_bytes(theirs);
                return Err(CommError::Mismatch {
                    rank: self.rank,
                    op: kind.name(),
                    detail: format!(
                        "this rank's collective #{} is {}, rank {r}'s #{} is {}",
                        header.seq,
                        header.describe(),
                        theirs.seq,
                        theirs.describe()
                    ),
                });
            }
        }
        Ok(())
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            _guard: self.env.lock().unwrap_or_else(|e| e.into_inner()),
            world: &self.comm.0,
        }
    }

    fn invalid(&self, op: &'static str, detail: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.rank,
            op,
            detail,
        }
    }

    /// Counts one call: `posted` bytes `(sent, received)` in the buffers handed to MPI (after
    /// padding and widening), and the ring model's figure for `counts`.
    fn record(
        &self,
        kind: OpKind,
        posted: (usize, usize),
        counts: &[usize],
        root: usize,
        elem: usize,
    ) {
        let model = op_cost(kind, self.rank, self.size, counts, root, elem);
        let moved = if self.size > 1 {
            (posted.0 as u64, posted.1 as u64)
        } else {
            (0, 0)
        };
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(kind, moved, model);
    }

    fn check_rank(&self, op: &'static str, what: &str, r: usize) -> Result<()> {
        if r >= self.size {
            return Err(self.invalid(op, format!("{what} {r} is not a rank of {}", self.size)));
        }
        Ok(())
    }

    /// All-reduce of f32 values (Mean = Sum / size); MPI needs distinct send and receive
    /// buffers, so the result comes back in a new one.
    fn reduce_f32(&self, send: &[f32], op: ReduceOp) -> Vec<f32> {
        let mut out = vec![0.0f32; send.len()];
        let per = (self.limit / 4).max(1);
        for (s, o) in send.chunks(per).zip(out.chunks_mut(per)) {
            self.lock().world.all_reduce_into(s, o, mpi_op(op));
        }
        if op == ReduceOp::Mean {
            let n = self.size as f32;
            out.iter_mut().for_each(|v| *v /= n);
        }
        out
    }

    /// Reduce-scatter of f32 values with per-rank counts: chunks are padded to the largest so
    /// that `MPI_Reduce_scatter_block` applies.
    fn reduce_scatter_f32(&self, input: &[f32], counts: &[usize], op: ReduceOp) -> Vec<f32> {
        let max = counts.iter().copied().max().unwrap_or(0);
        let mut padded = vec![0.0f32; max * self.size];
        let mut off = 0;
        for (r, &c) in counts.iter().enumerate() {
            padded[r * max..r * max + c].copy_from_slice(&input[off..off + c]);
            off += c;
        }
        let mut out = vec![0.0f32; max];
        // Columns of the padded matrix, so that one call posts at most `limit` bytes.
        let width = (self.limit / (4 * self.size)).max(1);
        if max * self.size * 4 <= self.limit {
            if max > 0 {
                self.lock()
                    .world
                    .reduce_scatter_block_into(&padded[..], &mut out[..], mpi_op(op));
            }
        } else {
            for cols in pieces(max, width) {
                let part: Vec<f32> = (0..self.size)
                    .flat_map(|r| {
                        padded[r * max + cols.start..r * max + cols.end]
                            .iter()
                            .copied()
                    })
                    .collect();
                self.lock()
                    .world
                    .reduce_scatter_block_into(&part[..], &mut out[cols], mpi_op(op));
            }
        }
        out.truncate(counts[self.rank]);
        if op == ReduceOp::Mean {
            let n = self.size as f32;
            out.iter_mut().for_each(|v| *v /= n);
        }
        out
    }
}

/// Prints why this rank gives up and aborts the whole MPI job (`mpirun` then ends every
/// process). Does not take the MPI mutex: another thread may be blocked in a call holding it,
/// and `MPI_Abort` is the one call meant for that state.
fn abort_job(rank: usize, reason: &str) -> ! {
    eprintln!("burn-deepspeed: rank {rank} aborts the MPI job: {reason}");
    SimpleCommunicator::world().abort(1)
}

/// Byte counts and displacements as MPI's `i32`s (the caller keeps the total under
/// [`MAX_MESSAGE`]).
fn counts_and_displs(bytes: &[usize]) -> (Vec<i32>, Vec<i32>) {
    let counts: Vec<i32> = bytes.iter().map(|&c| c as i32).collect();
    let displs = counts
        .iter()
        .scan(0i32, |acc, &c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect();
    (counts, displs)
}

/// What the debug-build sequence check exchanges about a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CallHeader {
    seq: u64,
    key: u64,
    total: u64,
    kind: u8,
    dtype: u8,
    root: u32,
}

impl CallHeader {
    const BYTES: usize = 30;

    fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.key.to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b[24] = self.kind;
        b[25] = self.dtype;
        b[26..30].copy_from_slice(&self.root.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Self {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Self {
            seq: u64_at(0),
            key: u64_at(8),
            total: u64_at(16),
            kind: b[24],
            dtype: b[25],
            root: u32::from_le_bytes(b[26..30].try_into().expect("4 bytes")),
        }
    }

    fn describe(&self) -> String {
        let kind = OpKind::ALL
            .get(self.kind as usize)
            .map_or("unknown", |k| k.name());
        let dtype = [DType::F32, DType::F16, DType::BF16, DType::U8]
            .into_iter()
            .find(|d| *d as u8 == self.dtype);
        let mut s = format!("{kind}({dtype:?} x {}, root {}", self.total, self.root);
        if self.key != 0 {
            s += &format!(", label {:#x}", self.key);
        }
        s + ")"
    }
}

fn install_abort_on_panic() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            // A panic the library catches itself becomes an error, which the ranks agree on.
            if super::panic_is_caught() {
                return;
            }
            eprintln!("burn-deepspeed: a rank panicked; aborting the MPI job");
            SimpleCommunicator::world().abort(101);
        }));
    });
}

fn widen(buf: Buf<'_>) -> Vec<f32> {
    match buf {
        Buf::F32(s) => s.to_vec(),
        Buf::F16(s) => s.iter().map(|v| v.to_f32()).collect(),
        Buf::BF16(s) => s.iter().map(|v| v.to_f32()).collect(),
        Buf::U8(s) => s.iter().map(|&v| v as f32).collect(),
    }
}

fn narrow(values: &[f32], out: BufMut<'_>, op: ReduceOp) {
    match out {
        BufMut::F32(s) => s.copy_from_slice(values),
        BufMut::F16(s) => s
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = f16::from_f32(*v)),
        BufMut::BF16(s) => s
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = bf16::from_f32(*v)),
        // u8 sums wrap and means floor, as in the thread world. u8 values summed in f32 are
        // exact up to 2^24 / 255 ranks.
        BufMut::U8(s) => s.iter_mut().zip(values).for_each(|(o, v)| {
            *o = match op {
                ReduceOp::Sum => (*v as u64 % 256) as u8,
                ReduceOp::Mean | ReduceOp::Max => v.floor() as u8,
            }
        }),
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let n = buf.len();
        let elem = buf.dtype().size();
        self.check_call(OpKind::AllReduce, buf.dtype(), n, 0)?;
        let send = widen(buf.as_buf());
        let values = if buf.dtype() == super::DType::U8 && op == ReduceOp::Mean {
            // Mean of u8 floors the exact sum.
            let size = self.size as f32;
            let mut sum = self.reduce_f32(&send, ReduceOp::Sum);
            sum.iter_mut().for_each(|v| *v = (*v / size).floor());
            sum
        } else {
            self.reduce_f32(&send, op)
        };
        narrow(&values, buf, op);
        // Every dtype is reduced in f32 (widened), from and into an f32 buffer.
        self.record(OpKind::AllReduce, (4 * n, 4 * n), &[n], 0, elem);
        Ok(())
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let name = OpKind::ReduceScatter.name();
        let total: usize = counts.iter().sum();
        if counts.len() != self.size
            || input.len() != total
            || output.len() != counts[self.rank]
            || input.dtype() != output.dtype()
        {
            return Err(self.invalid(
                name,
                format!(
                    "input {} / output {} elements ({:?} / {:?}) do not fit counts {counts:?}",
                    input.len(),
                    output.len(),
                    input.dtype(),
                    output.dtype()
                ),
            ));
        }
        let elem = input.dtype().size();
        self.check_call(OpKind::ReduceScatter, input.dtype(), total, 0)?;
        let values = widen(input);
        let u8_mean = input.dtype() == super::DType::U8 && op == ReduceOp::Mean;
        let reduce_op = if u8_mean { ReduceOp::Sum } else { op };
        let mut out = self.reduce_scatter_f32(&values, counts, reduce_op);
        if u8_mean {
            let size = self.size as f32;
            out.iter_mut().for_each(|v| *v = (*v / size).floor());
        }
        narrow(&out, output, op);
        // Widened to f32 and padded to the largest chunk per rank.
        let max = counts.iter().copied().max().unwrap_or(0);
        let posted = (4 * max * self.size, 4 * max);
        self.record(OpKind::ReduceScatter, posted, counts, 0, elem);
        Ok(())
    }

    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        counts: &[usize],
    ) -> Result<()> {
        let name = OpKind::AllGather.name();
        let total: usize = counts.iter().sum();
        if counts.len() != self.size
            || input.len() != counts[self.rank]
            || output.len() != total
            || input.dtype() != output.dtype()
        {
            return Err(self.invalid(
                name,
                format!(
                    "input {} / output {} elements do not fit counts {counts:?}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let elem = input.dtype().size();
        self.check_call(OpKind::AllGather, input.dtype(), total, 0)?;
        let byte_counts: Vec<usize> = counts.iter().map(|&c| c * elem).collect();
        if total * elem <= self.limit {
            let (counts32, displs32) = counts_and_displs(&byte_counts);
            let inner = self.lock();
            let mut partition =
                PartitionMut::new(output.as_bytes_mut(), &counts32[..], &displs32[..]);
            inner
                .world
                .all_gather_varcount_into(input.as_bytes(), &mut partition);
        } else {
            // Rounds in which each rank sends the next (at most) `per` bytes of its part.
            let per = (self.limit / self.size).max(1);
            let longest = byte_counts.iter().copied().max().unwrap_or(0);
            let displs: Vec<usize> = byte_counts
                .iter()
                .scan(0, |acc, &c| {
                    let d = *acc;
                    *acc += c;
                    Some(d)
                })
                .collect();
            let out = output.as_bytes_mut();
            for round in pieces(longest, per) {
                let part = |c: usize| c.clamp(round.start, round.end) - round.start;
                let sizes: Vec<usize> = byte_counts.iter().map(|&c| part(c)).collect();
                let mut received = vec![0u8; sizes.iter().sum()];
                let own = input.as_bytes();
                let from = round.start.min(own.len());
                let mine = &own[from..from + sizes[self.rank]];
                {
                    let (counts32, displs32) = counts_and_displs(&sizes);
                    let inner = self.lock();
                    let mut partition =
                        PartitionMut::new(&mut received[..], &counts32[..], &displs32[..]);
                    inner.world.all_gather_varcount_into(mine, &mut partition);
                }
                let mut at = 0;
                for (r, &n) in sizes.iter().enumerate().filter(|(_, n)| **n > 0) {
                    let dst = displs[r] + round.start;
                    out[dst..dst + n].copy_from_slice(&received[at..at + n]);
                    at += n;
                }
            }
        }
        let posted = (counts[self.rank] * elem, total * elem);
        self.record(OpKind::AllGather, posted, counts, 0, elem);
        Ok(())
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        self.check_rank(OpKind::Broadcast.name(), "root", root)?;
        let n = buf.len();
        let elem = buf.dtype().size();
        self.check_call(OpKind::Broadcast, buf.dtype(), n, root)?;
        let bytes = buf.as_bytes_mut();
        for piece in pieces(bytes.len(), self.limit) {
            let inner = self.lock();
            inner
                .world
                .process_at_rank(root as i32)
                .broadcast_into(&mut bytes[piece]);
        }
        let posted = if self.rank == root {
            (n * elem, 0)
        } else {
            (0, n * elem)
        };
        self.record(OpKind::Broadcast, posted, &[n], root, elem);
        Ok(())
    }

    fn all_to_all_buf(&self, input: Buf<'_>, mut output: BufMut<'_>) -> Result<()> {
        if !input.len().is_multiple_of(self.size)
            || output.len() != input.len()
            || input.dtype() != output.dtype()
        {
            return Err(self.invalid(
                OpKind::AllToAll.name(),
                format!(
                    "input ({}) must split into {} equal chunks and output ({}) match it",
                    input.len(),
                    self.size,
                    output.len()
                ),
            ));
        }
        let chunk = input.len() / self.size;
        let elem = input.dtype().size();
        self.check_call(OpKind::AllToAll, input.dtype(), input.len(), 0)?;
        let (send, recv) = (input.as_bytes(), output.as_bytes_mut());
        if send.len() <= self.limit {
            self.lock().world.all_to_all_into(send, recv);
        } else {
            // Rounds in which each destination gets the next (at most) `per` bytes of its
            // chunk.
            let chunk_bytes = chunk * elem;
            let per = (self.limit / self.size).max(1);
            for round in pieces(chunk_bytes, per) {
                let width = round.len();
                let part: Vec<u8> = (0..self.size)
                    .flat_map(|j| {
                        let at = j * chunk_bytes + round.start;
                        send[at..at + width].iter().copied()
                    })
                    .collect();
                let mut received = vec![0u8; part.len()];
                self.lock()
                    .world
                    .all_to_all_into(&part[..], &mut received[..]);
                for j in 0..self.size {
                    let at = j * chunk_bytes + round.start;
                    recv[at..at + width].copy_from_slice(&received[j * width..(j + 1) * width]);
                }
            }
        }
        let bytes = input.len() * elem;
        self.record(
            OpKind::AllToAll,
            (bytes, bytes),
            &vec![chunk; self.size],
            0,
            elem,
        );
        Ok(())
    }

    fn send_buf(&self, buf: Buf<'_>, dst: usize, tag: u16) -> Result<()> {
        self.check_rank(OpKind::Send.name(), "destination", dst)?;
        let bytes = buf.as_bytes();
        for piece in pieces(bytes.len(), self.limit) {
            let inner = self.lock();
            inner
                .world
                .process_at_rank(dst as i32)
                .send_with_tag(&bytes[piece], tag as i32);
        }
        let (n, elem) = (buf.len(), buf.dtype().size());
        self.record(OpKind::Send, (n * elem, 0), &[n], 0, elem);
        Ok(())
    }

    fn recv_buf(&self, mut buf: BufMut<'_>, src: usize, tag: u16) -> Result<()> {
        self.check_rank(OpKind::Recv.name(), "source", src)?;
        let bytes = buf.as_bytes_mut();
        let expected = bytes.len();
        for piece in pieces(expected, self.limit) {
            let want = piece.len();
            let status = {
                let inner = self.lock();
                inner
                    .world
                    .process_at_rank(src as i32)
                    .receive_into_with_tag(&mut bytes[piece.clone()], tag as i32)
            };
            let got = status.count(u8::equivalent_datatype()) as usize;
            if got != want {
                return Err(CommError::Mismatch {
                    rank: self.rank,
                    op: OpKind::Recv.name(),
                    detail: format!(
                        "rank {src} sent {got} bytes where bytes {piece:?} of {expected} \
                         were expected"
                    ),
                });
            }
        }
        let (n, elem) = (buf.len(), buf.dtype().size());
        self.record(OpKind::Recv, (0, n * elem), &[n], 0, elem);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.check_call(OpKind::Barrier, DType::U8, 0, 0)?;
        self.lock().world.barrier();
        self.record(OpKind::Barrier, (0, 0), &[0], 0, 1);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort(&self, reason: &str) {
        abort_job(self.rank, reason);
    }

    fn label_next(&self, key: u64) {
        self.key.store(key, Ordering::SeqCst);
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let color = i32::try_from(color).map_err(|_| {
            self.invalid(
                "split",
                format!("color {color} does not fit an MPI color (i32)"),
            )
        })?;
        let sub = self
            .lock()
            .world
            .split_by_color(Color::with_value(color))
            .ok_or_else(|| CommError::Mpi("MPI_Comm_split returned no communicator".into()))?;
        Ok(Arc::new(MpiCommunicator::wrap(sub, self.env.clone())))
    }
}
