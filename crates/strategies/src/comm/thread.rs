//! The in-process world: one thread per rank, the default on one machine.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::{Buf, BufMut, CommElement, CommStats, Communicator, DType, OpKind, ReduceOp, op_cost};
use crate::{CommError, Result};

/// Options of a [`ThreadWorld`].
#[derive(Debug, Clone)]
pub struct ThreadWorldOptions {
    /// How long a rank waits for its peers in one operation before it fails with
    /// [`CommError::Timeout`] (and makes the others fail too).
    pub timeout: Duration,
}

impl Default for ThreadWorldOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
        }
    }
}

/// A world of ranks that are threads of this process.
///
/// Collectives rendezvous in numbered rounds: each rank deposits a copy of its input, waits
/// until every rank has arrived, then computes its own output from the same contributions in
/// rank order, so every rank sees bit-identical reductions. A rank whose communicator is
/// dropped while panicking, or that times out, marks the world failed, and every rank waiting
/// or arriving later gets [`CommError::PeerFailed`] at once.
#[derive(Debug, Clone)]
pub struct ThreadWorld {
    shared: Arc<Shared>,
}

impl ThreadWorld {
    /// A world of `world_size` ranks; 0 is refused.
    pub fn new(world_size: usize, options: ThreadWorldOptions) -> Result<Self> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument {
                rank: 0,
                op: "ThreadWorld::new",
                detail: "a world needs at least one rank, found 0".into(),
            });
        }
        Ok(Self {
            shared: Shared::new((0..world_size).collect(), options.timeout, None),
        })
    }

    /// The communicator of every rank, in rank order. Hand each to one thread.
    pub fn communicators(&self) -> Vec<ThreadCommunicator> {
        (0..self.shared.world)
            .map(|rank| ThreadCommunicator {
                rank,
                shared: self.shared.clone(),
                seq: AtomicU64::new(0),
                splits: AtomicU64::new(0),
                key: AtomicU64::new(0),
                stats: Mutex::new(CommStats::default()),
            })
            .collect()
    }

    /// Runs `f` on `world_size` threads, one per rank, and returns each rank's result (an
    /// `Err` holds the panic payload of a rank that panicked). A world of 0 ranks runs
    /// nothing and returns no results.
    pub fn run<R, F>(
        world_size: usize,
        options: ThreadWorldOptions,
        f: F,
    ) -> Vec<std::thread::Result<R>>
    where
        R: Send,
        F: Fn(ThreadCommunicator) -> R + Sync,
    {
        let Ok(world) = ThreadWorld::new(world_size, options) else {
            return Vec::new();
        };
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = world
                .communicators()
                .into_iter()
                .map(|comm| {
                    std::thread::Builder::new()
                        .name(format!("rank-{}", comm.rank))
                        .spawn_scoped(scope, move || f(comm))
                        .expect("failed to spawn a rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        })
    }
}

#[derive(Debug)]
struct Shared {
    world: usize,
    /// Each rank's rank in the root world (the one no `split` made), which errors name.
    members: Vec<usize>,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// The world this one was split from.
    parent: Option<Arc<Shared>>,
    /// The groups split from this world.
    children: Mutex<Vec<Weak<Shared>>>,
    /// In the root world: what each rank (by root rank) is busy with on its own between two
    /// collectives (see [`Communicator::begin_solo`]). Locked alone, never with `state`
    /// waiting on it.
    solo: Mutex<Vec<Option<&'static str>>>,
}

impl Shared {
    fn new(members: Vec<usize>, timeout: Duration, parent: Option<Arc<Shared>>) -> Arc<Self> {
        let world = members.len();
        let shared = Arc::new(Shared {
            world,
            members,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                mailboxes: HashMap::new(),
                failure: None,
                exited: vec![false; world],
                groups: HashMap::new(),
            }),
            cv: Condvar::new(),
            parent,
            children: Mutex::new(Vec::new()),
            solo: Mutex::new(vec![None; world]),
        });
        if let Some(parent) = &shared.parent {
            parent
                .children
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Arc::downgrade(&shared));
        }
        shared
    }

    /// Records that root rank `rank` failed for `reason` in this world, the worlds it was
    /// split from and every group split from any of them, and wakes every waiting rank.
    fn fail_family(self: &Arc<Self>, rank: usize, reason: &str) {
        // Mark every world before waking anyone: a rank woken in one world must not leave
        // (and so fail a peer in another world for leaving) before that world is marked.
        let family = self.root().family();
        for world in &family {
            let mut state = lock(&world.state);
            if state.failure.is_none() {
                state.failure = Some((rank, reason.to_string()));
            }
        }
        for world in &family {
            world.cv.notify_all();
        }
    }

    /// The world no `split` made, that this one descends from.
    fn root(self: &Arc<Self>) -> Arc<Self> {
        let mut root = self.clone();
        while let Some(parent) = root.parent.clone() {
            root = parent;
        }
        root
    }

    /// This world and every group split from it, at any depth.
    fn family(self: Arc<Self>) -> Vec<Arc<Self>> {
        let mut out = vec![self];
        let mut at = 0;
        while at < out.len() {
            let children = out[at].children.lock().unwrap_or_else(|e| e.into_inner());
            let live: Vec<Arc<Self>> = children.iter().filter_map(Weak::upgrade).collect();
            drop(children);
            out.extend(live);
            at += 1;
        }
        out
    }

    /// The failure recorded in the root world, which every failure of the family reaches.
    fn family_failure(self: &Arc<Self>) -> Option<(usize, String)> {
        lock(&self.root().state).failure.clone()
    }

    /// What the first of `ranks` (ranks of this world) that is busy on its own is doing.
    fn solo_among(self: &Arc<Self>, ranks: &[usize]) -> Option<(usize, &'static str)> {
        let root = self.root();
        let solo = root.solo.lock().unwrap_or_else(|e| e.into_inner());
        ranks.iter().find_map(|&r| {
            let global = self.members[r];
            solo.get(global)
                .copied()
                .flatten()
                .map(|what| (global, what))
        })
    }
}

#[derive(Debug)]
struct State {
    rounds: HashMap<u64, Round>,
    mailboxes: HashMap<(usize, usize, u16), VecDeque<Owned>>,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
    /// Worlds created by `split`, keyed by (split number, color), with how many of their
    /// members have not picked them up yet.
    groups: HashMap<(u64, usize), (Arc<Shared>, usize)>,
}

#[derive(Debug, Default)]
struct Round {
    contribs: Vec<Option<Arc<Contribution>>>,
    arrived: usize,
    left: usize,
}

#[derive(Debug, Clone, PartialEq)]
struct Header {
    /// The caller's label (see [`Communicator::label_next`]); 0 when none.
    key: u64,
    kind: OpKind,
    dtype: DType,
    len: usize,
    counts: Vec<usize>,
    root: usize,
    op: Option<ReduceOp>,
}

#[derive(Debug)]
struct Contribution {
    header: Header,
    data: Owned,
}

/// A typed copy of a rank's buffer.
#[derive(Debug)]
enum Owned {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U8(Vec<u8>),
}

impl Owned {
    fn copy_of(buf: Buf<'_>) -> Self {
        match buf {
            Buf::F32(s) => Owned::F32(s.to_vec()),
            Buf::F16(s) => Owned::F16(s.to_vec()),
            Buf::BF16(s) => Owned::BF16(s.to_vec()),
            Buf::U8(s) => Owned::U8(s.to_vec()),
        }
    }
    fn empty() -> Self {
        Owned::U8(Vec::new())
    }
    fn len(&self) -> usize {
        match self {
            Owned::F32(v) => v.len(),
            Owned::F16(v) => v.len(),
            Owned::BF16(v) => v.len(),
            Owned::U8(v) => v.len(),
        }
    }
    /// The data as `T` (the caller has checked that the dtype is `T`'s).
    fn typed<T: CommElement>(&self) -> &[T] {
        match self {
            Owned::F32(v) => bytemuck::cast_slice(v),
            Owned::F16(v) => bytemuck::cast_slice(v),
            Owned::BF16(v) => bytemuck::cast_slice(v),
            Owned::U8(v) => bytemuck::cast_slice(v),
        }
    }
}

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
    rank: usize,
    shared: Arc<Shared>,
    seq: AtomicU64,
    splits: AtomicU64,
    /// The label of the next collective (0: none).
    key: AtomicU64,
    stats: Mutex<CommStats>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ThreadCommunicator {
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

    /// Fails with the recorded failure of another rank, if any.
    fn failure_of_peer(&self, state: &State, op: &'static str) -> Option<CommError> {
        state
            .failure
            .as_ref()
            .map(|(rank, reason)| CommError::PeerFailed {
                rank: *rank,
                op,
                reason: reason.clone(),
            })
    }

    /// Deposits this rank's contribution to the next round and returns every rank's, in rank
    /// order, once all have arrived.
    fn rendezvous(&self, mut header: Header, data: Owned) -> Result<Vec<Arc<Contribution>>> {
        header.key = self.key.swap(0, Ordering::SeqCst);
        let op = header.kind.name();
        let world = self.shared.world;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mut deadline = Instant::now() + self.shared.timeout;
        let mut state = lock(&self.shared.state);
        if let Some(e) = self.failure_of_peer(&state, op) {
            return Err(e);
        }
        {
            let round = state.rounds.entry(seq).or_default();
            if round.contribs.is_empty() {
                round.contribs = vec![None; world];
            }
            round.contribs[self.rank] = Some(Arc::new(Contribution { header, data }));
            round.arrived += 1;
        }
        self.shared.cv.notify_all();
        loop {
            let round = &state.rounds[&seq];
            if round.arrived == world {
                break;
            }
            if let Some(e) = self.failure_of_peer(&state, op) {
                return Err(e);
            }
            let missing: Vec<usize> = (0..world)
                .filter(|&r| round.contribs[r].is_none())
                .collect();
            if let Some(&gone) = missing.iter().find(|&&r| state.exited[r]) {
                drop(state);
                // It may have left because of a failure elsewhere in the family: name that.
                if let Some((rank, reason)) = self.shared.family_failure() {
                    return Err(CommError::PeerFailed { rank, op, reason });
                }
                return Err(CommError::PeerFailed {
                    rank: self.shared.members[gone],
                    op,
                    reason: "it left the world without joining this operation".into(),
                });
            }
            let now = Instant::now();
            // A rank busy on its own (writing a checkpoint) is not late: wait on.
            if now >= deadline && self.shared.solo_among(&missing).is_some() {
                deadline = now + self.shared.timeout;
            }
            if now >= deadline {
                drop(state);
                self.fail(&format!(
                    "it timed out in `{op}` waiting for rank(s) {missing:?}"
                ));
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op,
                    waited: self.shared.timeout,
                    missing,
                });
            }
            state = self
                .shared
                .cv
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let round = state.rounds.get_mut(&seq).expect("round exists");
        let contribs: Vec<Arc<Contribution>> = round
            .contribs
            .iter()
            .map(|c| c.clone().expect("every rank arrived"))
            .collect();
        round.left += 1;
        if round.left == world {
            state.rounds.remove(&seq);
        }
        drop(state);
        let mine = &contribs[self.rank].header;
        for (r, c) in contribs.iter().enumerate() {
            if !compatible(mine, &c.header) {
                return Err(CommError::Mismatch {
                    rank: self.rank,
                    op,
                    detail: format!(
                        "this rank's call #{seq} is {}, rank {r}'s is {}",
                        mine.describe(),
                        c.header.describe()
                    ),
                });
            }
        }
        Ok(contribs)
    }
}

impl Header {
    /// The call, for a mismatch error.
    fn describe(&self) -> String {
        let mut s = format!("{}({:?} x {}", self.kind.name(), self.dtype, self.len);
        if !self.counts.is_empty() {
            s += &format!(", counts {:?}", self.counts);
        }
        if self.kind == OpKind::Broadcast {
            s += &format!(", root {}", self.root);
        }
        if let Some(op) = self.op {
            s += &format!(", {op:?}");
        }
        if self.key != 0 {
            s += &format!(", label {:#x}", self.key);
        }
        s + ")"
    }
}

/// Two ranks' calls match when everything but the per-rank length agrees (the length is
/// per-rank for uneven all-gathers; the ops check lengths against `counts` themselves).
fn compatible(a: &Header, b: &Header) -> bool {
    let same_len_required = !matches!(a.kind, OpKind::AllGather);
    a.kind == b.kind
        && a.key == b.key
        && a.dtype == b.dtype
        && a.counts == b.counts
        && a.root == b.root
        && a.op == b.op
        && (!same_len_required || a.len == b.len)
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
        if input.len() != total || output.len() != counts[self.rank] {
            return Err(self.invalid(
                name,
                format!(
                    "input has {} elements and output {}, but counts {:?} need {} and {}",
                    input.len(),
                    output.len(),
                    counts,
                    total,
                    counts[self.rank]
                ),
            ));
        }
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
        if input.len() != counts[self.rank] || output.len() != total {
            return Err(self.invalid(
                name,
                format!(
                    "input has {} elements and output {}, but counts {:?} need {} and {}",
                    input.len(),
                    output.len(),
                    counts,
                    counts[self.rank],
                    total
                ),
            ));
        }
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
        if let Some(e) = self.failure_of_peer(&state, name) {
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
            if let Some(e) = self.failure_of_peer(&state, name) {
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
        Ok(Arc::new(ThreadCommunicator {
            rank,
            shared,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            key: AtomicU64::new(0),
            stats: Mutex::new(CommStats::default()),
        }))
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
