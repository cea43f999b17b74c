//! [`ShardCut`]: one rank's view of a stage-3 [`ShardPlan`] (arXiv 1910.02054 §5.3), as the
//! regime's buffers are laid out: the rank's pieces back to back, the persistent tensors'
//! whole gradients back to back, and where every rank's persistent pieces land in their
//! all-gather. Plain data, tested without tensors.

use std::ops::Range;

use burn_deepspeed_strategies::zero::{Segment, ShardPlan};

/// One rank's pieces of a [`ShardPlan`] and the persistent tensors' buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardCut {
    /// The rank.
    pub rank: usize,
    /// Its pieces, tensor after tensor (its buffers' order).
    pub segments: Vec<Segment>,
    /// Per tensor: its piece's range in the rank's buffer, if it has one.
    pub local: Vec<Option<Range<usize>>>,
    /// Elements of the rank's pieces.
    pub own_len: usize,
    /// Per persistent tensor: where it starts in the buffer of persistent tensors (whole,
    /// back to back).
    pub persistent_at: Vec<Option<usize>>,
    /// Elements of the persistent tensors.
    pub persistent_len: usize,
    /// The all-gather of the persistent pieces: every rank's count (its pieces back to back,
    /// tensor after tensor).
    pub gather_counts: Vec<usize>,
    /// Per persistent tensor (in order): where each rank's piece lands in the gathered
    /// buffer, in rank order, empty pieces left out.
    pub gather_parts: Vec<Vec<Range<usize>>>,
}

impl ShardCut {
    /// Rank `rank`'s view of `plan`.
    pub fn of(plan: &ShardPlan, rank: usize) -> Self {
        let tensors = plan.tensors();
        let segments = plan.segments(rank);
        let mut local = vec![None; tensors.len()];
        for s in &segments {
            local[s.tensor] = Some(s.local.clone());
        }
        let mut persistent_at = vec![None; tensors.len()];
        let mut persistent_len = 0;
        for (t, s) in tensors.iter().enumerate() {
            if s.persistent {
                persistent_at[t] = Some(persistent_len);
                persistent_len += s.numel;
            }
        }
        let persistent: Vec<usize> = (0..tensors.len())
            .filter(|&t| tensors[t].persistent)
            .collect();
        let mut gather_parts = vec![Vec::new(); persistent.len()];
        let mut gather_counts = Vec::with_capacity(plan.world());
        let mut at = 0;
        for r in 0..plan.world() {
            let start = at;
            for (k, &t) in persistent.iter().enumerate() {
                let n = plan.own(r, t).len();
                if n > 0 {
                    gather_parts[k].push(at..at + n);
                }
                at += n;
            }
            gather_counts.push(at - start);
        }
        Self {
            rank,
            own_len: plan.own_len(rank),
            segments,
            local,
            persistent_at,
            persistent_len,
            gather_counts,
            gather_parts,
        }
    }

    /// The persistent tensors, in layout order.
    pub fn persistent(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.local.len()).filter(|&t| self.persistent_at[t].is_some())
    }

    /// The pieces as (where each starts in the rank's buffer, the flat range of the layout it
    /// holds), for a model-parallel norm's windows.
    pub fn windows(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.segments
            .iter()
            .map(|s| (s.local.start, s.global.clone()))
    }

    /// Each piece's tensor and its range in the rank's buffer, in buffer order.
    pub fn pieces(&self) -> Vec<(usize, Range<usize>)> {
        (self.segments.iter())
            .map(|s| (s.tensor, s.local.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn persistent_pieces_land_in_rank_order() {
        // Tensors of 5 (persistent), 8 (partitioned) and 3 (persistent) elements over 2
        // ranks: chunks of 3, 4 and 2.
        let plan = ShardPlan::new(&[5, 8, 3], 2, 5, usize::MAX);
        let cut = ShardCut::of(&plan, 1);
        // Rank 0 holds 0..3 of the first and 0..2 of the last; rank 1 3..5 and 2..3.
        assert_eq!(cut.gather_counts, vec![5, 3]);
        assert_eq!(cut.gather_parts, vec![vec![0..3, 5..7], vec![3..5, 7..8]]);
        assert_eq!(cut.persistent_at, vec![Some(0), None, Some(5)]);
        assert_eq!(cut.persistent_len, 8);
        // Rank 1's buffer: 2 of the first, 4 of the second, 1 of the last.
        assert_eq!(cut.local, vec![Some(0..2), Some(2..6), Some(6..7)]);
        assert_eq!(cut.own_len, 7);
        assert_eq!(cut.persistent().collect::<Vec<_>>(), vec![0, 2]);
    }
}
