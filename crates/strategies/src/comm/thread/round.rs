//! The numbered rounds in which the ranks of a thread world meet: what each deposits, and how
//! a rank waits for the others.

use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};

use super::world::{Shared, lock};
use crate::comm::{Buf, CommElement, DType, OpKind, ReduceOp};
use crate::{CommError, Result};

#[derive(Debug, Default)]
pub(super) struct Round {
    pub(super) contribs: Vec<Option<Arc<Contribution>>>,
    pub(super) arrived: usize,
    pub(super) left: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Header {
    /// The caller's label (see [`Communicator::label_next`]); 0 when none.
    pub(super) key: u64,
    pub(super) kind: OpKind,
    pub(super) dtype: DType,
    pub(super) len: usize,
    pub(super) counts: Vec<usize>,
    pub(super) root: usize,
    pub(super) op: Option<ReduceOp>,
}

#[derive(Debug)]
pub(super) struct Contribution {
    pub(super) header: Header,
    pub(super) data: Owned,
}

/// A typed copy of a rank's buffer.
#[derive(Debug)]
pub(super) enum Owned {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U8(Vec<u8>),
}

impl Owned {
    pub(super) fn copy_of(buf: Buf<'_>) -> Self {
        match buf {
            Buf::F32(s) => Owned::F32(s.to_vec()),
            Buf::F16(s) => Owned::F16(s.to_vec()),
            Buf::BF16(s) => Owned::BF16(s.to_vec()),
            Buf::U8(s) => Owned::U8(s.to_vec()),
        }
    }
    pub(super) fn empty() -> Self {
        Owned::U8(Vec::new())
    }
    pub(super) fn len(&self) -> usize {
        match self {
            Owned::F32(v) => v.len(),
            Owned::F16(v) => v.len(),
            Owned::BF16(v) => v.len(),
            Owned::U8(v) => v.len(),
        }
    }
    /// The data as `T` (the caller has checked that the dtype is `T`'s).
    pub(super) fn typed<T: CommElement>(&self) -> &[T] {
        match self {
            Owned::F32(v) => bytemuck::cast_slice(v),
            Owned::F16(v) => bytemuck::cast_slice(v),
            Owned::BF16(v) => bytemuck::cast_slice(v),
            Owned::U8(v) => bytemuck::cast_slice(v),
        }
    }
}

impl Shared {
    /// Deposits `rank`'s contribution (its call number `seq`) to the next round and returns every rank's, in rank
    /// order, once all have arrived.
    pub(super) fn rendezvous(
        self: &Arc<Self>,
        rank: usize,
        seq: u64,
        header: Header,
        data: Owned,
    ) -> Result<Vec<Arc<Contribution>>> {
        let op = header.kind.name();
        let world = self.world;
        let mut deadline = Instant::now() + self.timeout;
        let mut state = lock(&self.state);
        if let Some(e) = state.peer_failure(op) {
            return Err(e);
        }
        {
            let round = state.rounds.entry(seq).or_default();
            if round.contribs.is_empty() {
                round.contribs = vec![None; world];
            }
            round.contribs[rank] = Some(Arc::new(Contribution { header, data }));
            round.arrived += 1;
        }
        self.cv.notify_all();
        loop {
            let round = &state.rounds[&seq];
            if round.arrived == world {
                break;
            }
            if let Some(e) = state.peer_failure(op) {
                return Err(e);
            }
            let missing: Vec<usize> = (0..world)
                .filter(|&r| round.contribs[r].is_none())
                .collect();
            if let Some(&gone) = missing.iter().find(|&&r| state.exited[r]) {
                drop(state);
                // It may have left because of a failure elsewhere in the family: name that.
                if let Some((rank, reason)) = self.family_failure() {
                    return Err(CommError::PeerFailed { rank, op, reason });
                }
                return Err(CommError::PeerFailed {
                    rank: self.members[gone],
                    op,
                    reason: "it left the world without joining this operation".into(),
                });
            }
            let now = Instant::now();
            // A rank busy on its own (writing a checkpoint) is not late: wait on.
            if now >= deadline && self.solo_among(&missing).is_some() {
                deadline = now + self.timeout;
            }
            if now >= deadline {
                drop(state);
                self.fail_family(
                    self.members[rank],
                    &format!("it timed out in `{op}` waiting for rank(s) {missing:?}"),
                );
                return Err(CommError::Timeout {
                    rank,
                    op,
                    waited: self.timeout,
                    missing,
                });
            }
            state = self
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
        let mine = &contribs[rank].header;
        for (r, c) in contribs.iter().enumerate() {
            if !compatible(mine, &c.header) {
                return Err(CommError::Mismatch {
                    rank,
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
pub(super) fn compatible(a: &Header, b: &Header) -> bool {
    let same_len_required = !matches!(a.kind, OpKind::AllGather);
    a.kind == b.kind
        && a.key == b.key
        && a.dtype == b.dtype
        && a.counts == b.counts
        && a.root == b.root
        && a.op == b.op
        && (!same_len_required || a.len == b.len)
}
