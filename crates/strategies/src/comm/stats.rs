//! Per-rank counters of calls and bytes, by kind of operation, and the cost model behind them.

use std::fmt;

/// A kind of communication operation, for counters and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// All-reduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast.
    Broadcast,
    /// All-to-all.
    AllToAll,
    /// Point-to-point send.
    Send,
    /// Point-to-point receive.
    Recv,
    /// Barrier.
    Barrier,
}

impl OpKind {
    /// Every kind, in a fixed order.
    pub const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
    ];

    /// The snake-case name used in spans, counters and JSON.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Calls and bytes of one kind of operation on one rank.
///
/// Two figures are kept apart:
/// - `bytes_sent` / `bytes_received` are **measured**: what the transport moved for this rank.
///   In the thread world, the bytes copied out of this rank's buffers into the shared round and
///   the bytes copied into them; under MPI, the bytes of the buffers handed to the MPI calls,
///   after the padding (uneven reduce-scatter) and widening (16-bit and u8 reductions run in
///   f32) the implementation applies.
/// - `model_bytes_sent` / `model_bytes_received` are **modelled**: what the same call would
///   move under the bandwidth-optimal ring algorithm ([`op_cost`]), the same for every backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Bytes this rank's transport sent (measured).
    pub bytes_sent: u64,
    /// Bytes this rank's transport received (measured).
    pub bytes_received: u64,
    /// Bytes the ring model says this rank sends.
    pub model_bytes_sent: u64,
    /// Bytes the ring model says this rank receives.
    pub model_bytes_received: u64,
}

/// Bytes one call moved for one rank: `(sent, received)`.
pub type Moved = (u64, u64);

/// Per-rank communication counters, by kind of operation: measured bytes and, beside them,
/// the ring model's ([`OpStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    ops: [OpStats; 8],
}

impl CommStats {
    /// Counters of one kind of operation.
    pub fn get(&self, kind: OpKind) -> OpStats {
        self.ops[kind.index()]
    }
    /// Records one call: the bytes the transport `moved` and the ring model's `model`.
    pub fn record(&mut self, kind: OpKind, moved: Moved, model: Moved) {
        let s = &mut self.ops[kind.index()];
        s.calls += 1;
        s.bytes_sent += moved.0;
        s.bytes_received += moved.1;
        s.model_bytes_sent += model.0;
        s.model_bytes_received += model.1;
    }
    /// Bytes the transport sent over every kind of operation (measured).
    pub fn total_sent(&self) -> u64 {
        self.ops.iter().map(|s| s.bytes_sent).sum()
    }
    /// Bytes the transport received over every kind of operation (measured).
    pub fn total_received(&self) -> u64 {
        self.ops.iter().map(|s| s.bytes_received).sum()
    }
    /// Bytes the ring model says were sent over every kind of operation.
    pub fn total_model_sent(&self) -> u64 {
        self.ops.iter().map(|s| s.model_bytes_sent).sum()
    }
    /// The sum of two sets of counters (e.g. of this rank's groups).
    pub fn plus(&self, other: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(other.ops.iter()) {
            o.calls += e.calls;
            o.bytes_sent += e.bytes_sent;
            o.bytes_received += e.bytes_received;
            o.model_bytes_sent += e.model_bytes_sent;
            o.model_bytes_received += e.model_bytes_received;
        }
        out
    }
    /// Counters accumulated since `earlier` (a snapshot of the same rank).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(earlier.ops.iter()) {
            o.calls -= e.calls;
            o.bytes_sent -= e.bytes_sent;
            o.bytes_received -= e.bytes_received;
            o.model_bytes_sent -= e.model_bytes_sent;
            o.model_bytes_received -= e.model_bytes_received;
        }
        out
    }
}

/// Bytes `(sent, received)` by `rank` for one operation under the ring cost model.
///
/// * all-reduce of n elements = reduce-scatter + all-gather of the even split of n;
/// * reduce-scatter: a rank sends its contribution to every other owner's chunk and receives
///   (N−1) contributions to its own chunk;
/// * all-gather: a rank's chunk reaches N−1 peers; it receives every other chunk;
/// * broadcast: a pipelined chain from the root: every rank but the last sends n, every rank but
///   the root receives n;
/// * all-to-all: (N−1) chunks each way; send/recv: exactly the message.
///
/// `counts` are the chunk sizes per rank (elements), `elem` the bytes per element.
pub fn op_cost(
    kind: OpKind,
    rank: usize,
    world: usize,
    counts: &[usize],
    root: usize,
    elem: usize,
) -> (u64, u64) {
    if world <= 1 {
        return (0, 0);
    }
    let total: usize = counts.iter().sum();
    let own = counts.get(rank).copied().unwrap_or(0);
    let peers = world - 1;
    let (s, r) = match kind {
        OpKind::AllReduce => {
            let split = even_split(total, world);
            let own = split[rank];
            let rs = (total - own, peers * own);
            let ag = (peers * own, total - own);
            (rs.0 + ag.0, rs.1 + ag.1)
        }
        OpKind::ReduceScatter => (total - own, peers * own),
        OpKind::AllGather => (peers * own, total - own),
        OpKind::Broadcast => {
            let last = (root + world - 1) % world;
            let sent = if rank == last { 0 } else { total };
            let recv = if rank == root { 0 } else { total };
            (sent, recv)
        }
        OpKind::AllToAll => (peers * own, peers * own),
        OpKind::Send => (total, 0),
        OpKind::Recv => (0, total),
        OpKind::Barrier => (0, 0),
    };
    ((s * elem) as u64, (r * elem) as u64)
}

/// Splits `n` elements into `parts` contiguous chunks whose sizes differ by at most one
/// (the first `n % parts` chunks get the extra element).
pub fn even_split(n: usize, parts: usize) -> Vec<usize> {
    let base = n / parts;
    let extra = n % parts;
    (0..parts).map(|i| base + usize::from(i < extra)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_cost_matches_ring_formula() {
        // 2(N-1)/N * n elements each way.
        for world in 2..6 {
            let n = 60 * world;
            let (s, r) = op_cost(OpKind::AllReduce, 1, world, &[n], 0, 4);
            let expected = (2 * (world - 1) * n / world * 4) as u64;
            assert_eq!((s, r), (expected, expected));
        }
    }

    #[test]
    fn sent_equals_received_over_the_world() {
        let counts = [3, 5, 0, 7];
        for kind in OpKind::ALL {
            let (mut sent, mut recv) = (0, 0);
            for rank in 0..4 {
                let per_rank_counts: Vec<usize> = match kind {
                    OpKind::AllReduce | OpKind::Broadcast => vec![15],
                    _ => counts.to_vec(),
                };
                let (s, r) = op_cost(kind, rank, 4, &per_rank_counts, 2, 2);
                sent += s;
                recv += r;
            }
            if !matches!(kind, OpKind::Send | OpKind::Recv | OpKind::AllToAll) {
                assert_eq!(sent, recv, "{kind}");
            }
        }
    }

    #[test]
    fn even_split_is_balanced() {
        assert_eq!(even_split(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(even_split(2, 3), vec![1, 1, 0]);
        assert_eq!(even_split(10, 4).iter().sum::<usize>(), 10);
    }
}
