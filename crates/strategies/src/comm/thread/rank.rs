//! One rank's handle on a thread world, and the collectives it runs there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::round::{Contribution, Header, Owned};
use super::world::{Shared, lock};
use crate::comm::{
    Buf, BufMut, CommElement, CommStats, Communicator, DType, OpKind, ReduceOp, op_cost,
};
use crate::{CommError, Result};

/// Calls `$f::<T>(slice, ...)` with the typed slice inside a [`BufMut`].
macro_rules! with_typed_mut {
    ($buf:expr, |$s:ident| $body:expr) => {
        match $buf {
            BufMut::F32($s) => $body,
            BufMut::F16($s) => $body,
            BufMut::BF16($s) => $body,
            BufMut::U8($s) => $body,
        }
    };
}

/// One rank's handle on a [`ThreadWorld`].
#[derive(Debug)]
pub struct ThreadCommunicator {
    pub(super) rank: usize,
    shared: Arc<Shared>,
    seq: AtomicU64,
    splits: AtomicU64,
    /// The label of the next collective (0: none).
    key: AtomicU64,
    stats: Mutex<CommStats>,
}

impl ThreadCommunicator {
    pub(super) fn new(rank: usize, shared: Arc<Shared>) -> Self {
        Self {
            rank,
            shared,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            key: AtomicU64::new(0),
            stats: Mutex::new(CommStats::default()),
        }
    }

    /// Sets what this rank is busy with on its own (`None`: nothing).
    fn set_solo(&self, what: Option<&'static str>) {
        let root = self.shared.root();
        let mut solo = root.solo.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = solo.get_mut(self.shared.members[self.rank]) {
            *slot = what;
        }
    }

    /// Marks this rank failed in its world's whole family (see [`Shared::fail_family`]).
    fn fail(&self, reason: &str) {
        self.shared
            .fail_family(self.shared.members[self.rank], reason);
    }

    fn invalid(&self, op: &'static str, detail: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.rank,
            op,
            detail,
        }
    }

    fn check_counts(&self, op: &'static str, counts: &[usize]) -> Result<usize> {
        if counts.len() != self.shared.world {
            return Err(self.invalid(
                op,
                format!(
                    "{} chunk counts given for a world of {}",
                    counts.len(),
                    self.shared.world
                ),
            ));
        }
        Ok(counts.iter().sum())
    }

    /// Checks the `(input, output)` lengths of a call against what its `counts` need.
    fn check_lens(
        &self,
        op: &'static str,
        (input, output): (usize, usize),
        need: (usize, usize),
        counts: &[usize],
    ) -> Result<()> {
        if (input, output) == need {
            return Ok(());
        }
        let detail = format!(
            "input has {input} elements and output {output}, but counts {counts:?} need {} and {}",
            need.0, need.1
        );
        Err(self.invalid(op, detail))
    }

    fn check_rank(&self, op: &'static str, what: &str, r: usize) -> Result<()> {
        if r >= self.shared.world {
            return Err(self.invalid(
                op,
                format!(
                    "{what} {r} is not a rank of a world of {}",
                    self.shared.world
                ),
            ));
        }
        Ok(())
    }

    /// Counts one call: `copied` elements `(out of, into)` this rank's buffers (what this
    /// transport moves), and the ring model's figure for `counts`.
    fn record(
        &self,
        kind: OpKind,
        copied: (usize, usize),
        counts: &[usize],
        root: usize,
        elem: usize,
    ) {
        let model = op_cost(kind, self.rank, self.shared.world, counts, root, elem);
        let moved = if self.shared.world > 1 {
            ((copied.0 * elem) as u64, (copied.1 * elem) as u64)
        } else {
            (0, 0)
        };
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(kind, moved, model);
    }

    /// Meets the other ranks in this rank's next round (see [`Shared::rendezvous`]).
    fn rendezvous(&self, mut header: Header, data: Owned) -> Result<Vec<Arc<Contribution>>> {
        header.key = self.key.swap(0, Ordering::SeqCst);
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.shared.rendezvous(self.rank, seq, header, data)
    }
}

impl Communicator for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let n = buf.len();
        let header = Header {
            key: 0,
            kind: OpKind::AllReduce,
            dtype: buf.dtype(),
            len: n,
            counts: vec![],
            root: 0,
            op: Some(op),
        };
        let elem = buf.dtype().size();
        let contribs = self.rendezvous(header, Owned::copy_of(buf.as_buf()))?;
        fn reduce<T: CommElement>(c: &[Arc<Contribution>], out: &mut [T], op: ReduceOp) {
            let inputs: Vec<&[T]> = c.iter().map(|c| c.data.typed::<T>()).collect();
            T::reduce_into(&inputs, out, op);
        }
        with_typed_mut!(buf, |s| reduce(&contribs, s, op));
        self.record(OpKind::AllReduce, (n, n), &[n], 0, elem);
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
        let total = self.check_counts(name, counts)?;
        let lens = (input.len(), output.len());
        self.check_lens(name, lens, (total, counts[self.rank]), counts)?;
        if input.dtype() != output.dtype() {
            return Err(self.invalid(name, "input and output dtypes differ".into()));
        }
        let header = Header {
            key: 0,
            kind: OpKind::ReduceScatter,
            dtype: input.dtype(),
            len: total,
            counts: counts.to_vec(),
            root: 0,
            op: Some(op),
        };
        let contribs = self.rendezvous(header, Owned::copy_of(input))?;
        let start: usize = counts[..self.rank].iter().sum();
        let end = start + counts[self.rank];
        fn reduce<T: CommElement>(
            c: &[Arc<Contribution>],
            out: &mut [T],
            op: ReduceOp,
            range: std::ops::Range<usize>,
        ) {
            let inputs: Vec<&[T]> = c
                .iter()
                .map(|c| &c.data.typed::<T>()[range.clone()])
                .collect();
            T::reduce_into(&inputs, out, op);
        }
        with_typed_mut!(output, |s| reduce(&contribs, s, op, start..end));
        self.record(
            OpKind::ReduceScatter,
            (total, counts[self.rank]),
            counts,
            0,
            input.dtype().size(),
        );
        Ok(())
    }

    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let name = OpKind::AllGather.name();
        let total = self.check_counts(name, counts)?;
        let lens = (input.len(), output.len());
        self.check_lens(name, lens, (counts[self.rank], total), counts)?;
        if input.dtype() != output.dtype() {
            return Err(self.invalid(name, "input and output dtypes differ".into()));
        }
        let header = Header {
            key: 0,
            kind: OpKind::AllGather,
            dtype: input.dtype(),
            len: input.len(),
            counts: counts.to_vec(),
            root: 0,
            op: None,
        };
        let contribs = self.rendezvous(header, Owned::copy_of(input))?;
        fn gather<T: CommElement>(c: &[Arc<Contribution>], out: &mut [T]) {
            let mut off = 0;
            for c in c {
                let part = c.data.typed::<T>();
                out[off..off + part.len()].copy_from_slice(part);
                off += part.len();
            }
        }
        let elem = input.dtype().size();
        with_typed_mut!(output, |s| gather(&contribs, s));
        self.record(
            OpKind::AllGather,
            (counts[self.rank], total),
            counts,
            0,
            elem,
        );
        Ok(())
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let name = OpKind::Broadcast.name();
        self.check_rank(name, "root", root)?;
        let header = Header {
            key: 0,
            kind: OpKind::Broadcast,
            dtype: buf.dtype(),
            len: buf.len(),
            counts: vec![],
            root,
            op: None,
        };
        // Only the root's data travels.
        let data = if self.rank == root {
            Owned::copy_of(buf.as_buf())
        } else {
            Owned::empty()
        };
        let n = buf.len();
        let elem = buf.dtype().size();
        let contribs = self.rendezvous(header, data)?;
        if self.rank != root {
            let src = &contribs[root].data;
            debug_assert_eq!(src.len(), n);
            with_typed_mut!(buf, |s| s.copy_from_slice(src.typed()));
        }
        let copied = if self.rank == root { (n, 0) } else { (0, n) };
        self.record(OpKind::Broadcast, copied, &[n], root, elem);
        Ok(())
    }

    fn all_to_all_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        let name = OpKind::AllToAll.name();
        let world = self.shared.world;
        if !input.len().is_multiple_of(world) || output.len() != input.len() {
            return Err(self.invalid(
                name,
                format!(
                    "input ({}) must split into {world} equal chunks and output ({}) match it",
                    input.len(),
                    output.len()
                ),
            ));
        }
        if input.dtype() != output.dtype() {
            return Err(self.invalid(name, "input and output dtypes differ".into()));
        }
        let chunk = input.len() / world;
        let header = Header {
            key: 0,
            kind: OpKind::AllToAll,
            dtype: input.dtype(),
            len: input.len(),
            counts: vec![],
            root: 0,
            op: None,
        };
        let elem = input.dtype().size();
        let contribs = self.rendezvous(header, Owned::copy_of(input))?;
        let me = self.rank;
        fn exchange<T: CommElement>(
            c: &[Arc<Contribution>],
            out: &mut [T],
            me: usize,
            chunk: usize,
        ) {
            for (j, c) in c.iter().enumerate() {
                out[j * chunk..(j + 1) * chunk]
                    .copy_from_slice(&c.data.typed::<T>()[me * chunk..(me + 1) * chunk]);
            }
        }
        with_typed_mut!(output, |s| exchange(&contribs, s, me, chunk));
        let n = input.len();
        self.record(OpKind::AllToAll, (n, n), &vec![chunk; world], 0, elem);
        Ok(())
    }

    fn send_buf(&self, buf: Buf<'_>, dst: usize, tag: u16) -> Result<()> {
        let name = OpKind::Send.name();
        self.check_rank(name, "destination", dst)?;
        let mut state = lock(&self.shared.state);
        if let Some(e) = state.peer_failure(name) {
            return Err(e);
        }
        state
            .mailboxes
            .entry((self.rank, dst, tag))
            .or_default()
            .push_back(Owned::copy_of(buf));
        drop(state);
        self.shared.cv.notify_all();
        let n = buf.len();
        self.record(OpKind::Send, (n, 0), &[n], 0, buf.dtype().size());
        Ok(())
    }

    fn recv_buf(&self, mut buf: BufMut<'_>, src: usize, tag: u16) -> Result<()> {
        let name = OpKind::Recv.name();
        self.check_rank(name, "source", src)?;
        let mut deadline = Instant::now() + self.shared.timeout;
        let mut state = lock(&self.shared.state);
        let msg = loop {
            if let Some(m) = state
                .mailboxes
                .get_mut(&(src, self.rank, tag))
                .and_then(|q| q.pop_front())
            {
                break m;
            }
            if let Some(e) = state.peer_failure(name) {
                return Err(e);
            }
            if state.exited[src] {
                drop(state);
                if let Some((rank, reason)) = self.shared.family_failure() {
                    return Err(CommError::PeerFailed {
                        rank,
                        op: name,
                        reason,
                    });
                }
                return Err(CommError::PeerFailed {
                    rank: self.shared.members[src],
                    op: name,
                    reason: format!("it left the world without sending the message (tag {tag})"),
                });
            }
            let now = Instant::now();
            if now >= deadline && self.shared.solo_among(&[src]).is_some() {
                deadline = now + self.shared.timeout;
            }
            if now >= deadline {
                drop(state);
                self.fail(&format!("it timed out in `recv` waiting for rank {src}"));
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op: name,
                    waited: self.shared.timeout,
                    missing: vec![src],
                });
            }
            state = self
                .shared
                .cv
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(state);
        let dtype_ok = matches!(
            (&msg, &buf),
            (Owned::F32(_), BufMut::F32(_))
                | (Owned::F16(_), BufMut::F16(_))
                | (Owned::BF16(_), BufMut::BF16(_))
                | (Owned::U8(_), BufMut::U8(_))
        );
        if !dtype_ok || msg.len() != buf.len() {
            return Err(CommError::Mismatch {
                rank: self.rank,
                op: name,
                detail: format!(
                    "rank {src} sent {} elements of another shape/dtype than the {} {:?} expected",
                    msg.len(),
                    buf.len(),
                    buf.dtype()
                ),
            });
        }
        let n = buf.len();
        let elem = buf.dtype().size();
        with_typed_mut!(&mut buf, |s| s.copy_from_slice(msg.typed()));
        self.record(OpKind::Recv, (0, n), &[n], 0, elem);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let header = Header {
            key: 0,
            kind: OpKind::Barrier,
            dtype: DType::U8,
            len: 0,
            counts: vec![],
            root: 0,
            op: None,
        };
        self.rendezvous(header, Owned::empty())?;
        self.record(OpKind::Barrier, (0, 0), &[0], 0, 1);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort(&self, reason: &str) {
        self.fail(reason);
    }

    fn label_next(&self, key: u64) {
        self.key.store(key, Ordering::SeqCst);
    }

    fn begin_solo(&self, what: &'static str) {
        self.set_solo(Some(what));
    }

    fn end_solo(&self) {
        self.set_solo(None);
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let world = self.shared.world;
        let mine = (color as u64).to_le_bytes();
        let mut all = vec![0u8; 8 * world];
        self.all_gather_buf(Buf::U8(&mine), BufMut::U8(&mut all), &vec![8; world])?;
        let colors: Vec<usize> = all
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let members: Vec<usize> = (0..world).filter(|&r| colors[r] == color).collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank is a member of its own color");
        let split = self.splits.fetch_add(1, Ordering::SeqCst);
        let shared = {
            let mut state = lock(&self.shared.state);
            let key = (split, color);
            let entry = state.groups.entry(key).or_insert_with(|| {
                let roots = members.iter().map(|&r| self.shared.members[r]).collect();
                let group = Shared::new(roots, self.shared.timeout, Some(self.shared.clone()));
                (group, members.len())
            });
            let shared = entry.0.clone();
            entry.1 -= 1;
            if entry.1 == 0 {
                state.groups.remove(&key);
            }
            shared
        };
        Ok(Arc::new(ThreadCommunicator::new(rank, shared)))
    }
}

impl Drop for ThreadCommunicator {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.fail("it panicked");
        }
        let mut state = lock(&self.shared.state);
        state.exited[self.rank] = true;
        drop(state);
        self.shared.cv.notify_all();
    }
}
