//! The ZeRO stage 1/2 partition of a flat buffer: `world` contiguous slices in rank order, as
//! balanced as possible (sizes differ by at most one element), so that no padding is needed.
//!
//! DeepSpeed (`stage_1_and_2.py`) pads the flat buffer to a multiple of `2·world` and cuts equal
//! slices; our communicator takes per-rank counts, so the slices are balanced instead and a
//! parameter may straddle two ranks just the same. Because the slices are contiguous in rank
//! order, any contiguous bucket of the buffer is reduce-scattered (or all-gathered) with the
//! per-rank intersections as counts.

use std::ops::Range;

use crate::comm::even_split;

/// How a flat buffer of `numel` elements is cut across `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatPartition {
    bounds: Vec<usize>,
}

/// The part of one tensor that falls in one rank's slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Index of the tensor in the flat layout.
    pub tensor: usize,
    /// Elements of the flat buffer.
    pub global: Range<usize>,
    /// The same elements, counted from the start of the rank's slice.
    pub local: Range<usize>,
}

/// `a ∩ b`; when they do not overlap, the empty range at `a.start` (so that offsets relative
/// to `a` stay in bounds).
fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let (start, end) = (a.start.max(b.start), a.end.min(b.end));
    if start < end {
        start..end
    } else {
        a.start..a.start
    }
}

impl FlatPartition {
    /// The balanced cut of `numel` elements over `world` ranks.
    ///
    /// # Panics
    /// When `world` is 0.
    pub fn new(numel: usize, world: usize) -> Self {
        assert!(world > 0, "a partition needs at least one rank");
        let mut bounds = vec![0];
        for c in even_split(numel, world) {
            bounds.push(bounds.last().copied().unwrap_or(0) + c);
        }
        Self { bounds }
    }

    /// A cut at tensor boundaries: the tensors (of `sizes` elements, back to back) go to
    /// `world` contiguous groups whose largest is as small as possible (DeepSpeed's
    /// `partition_balanced`). Every tensor then lives whole on one rank, so an optimizer
    /// that steps whole tensors (any of Burn's) can step a rank's slice.
    pub fn tensor_aligned(sizes: &[usize], world: usize) -> Self {
        assert!(world > 0, "a partition needs at least one rank");
        let weights: Vec<f64> = sizes.iter().map(|&n| n as f64).collect();
        let cuts = crate::pipe::partition_balanced(&weights, world);
        let mut offsets = vec![0];
        for &n in sizes {
            offsets.push(offsets.last().copied().unwrap_or(0) + n);
        }
        Self {
            bounds: cuts.iter().map(|&t| offsets[t]).collect(),
        }
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Elements of the whole buffer.
    pub fn numel(&self) -> usize {
        self.bounds[self.world()]
    }

    /// Rank `rank`'s slice of the buffer.
    pub fn range(&self, rank: usize) -> Range<usize> {
        self.bounds[rank]..self.bounds[rank + 1]
    }

    /// Every rank's slice length.
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.world()).map(|r| self.range(r).len()).collect()
    }

    /// How many elements of `range` fall in each rank's slice: the counts of a reduce-scatter
    /// or all-gather of that contiguous range.
    pub fn counts_in(&self, range: &Range<usize>) -> Vec<usize> {
        (0..self.world())
            .map(|r| intersect(&self.range(r), range).len())
            .collect()
    }

    /// The part of `range` in `rank`'s slice, in buffer coordinates; when they do not
    /// overlap, the empty range at the start of the slice.
    pub fn own_in(&self, rank: usize, range: &Range<usize>) -> Range<usize> {
        intersect(&self.range(rank), range)
    }

    /// The pieces of the tensors (of `sizes` elements, laid out back to back) that fall in
    /// `rank`'s slice, in layout order.
    pub fn segments(&self, rank: usize, sizes: &[usize]) -> Vec<Segment> {
        let own = self.range(rank);
        let mut out = Vec::new();
        let mut offset = 0;
        for (tensor, &n) in sizes.iter().enumerate() {
            let global = intersect(&(offset..offset + n), &own);
            if !global.is_empty() {
                let local = global.start - own.start..global.end - own.start;
                out.push(Segment {
                    tensor,
                    global,
                    local,
                });
            }
            offset += n;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_balanced_contiguous_and_cover_the_buffer() {
        for (numel, world) in [(0, 3), (5, 4), (15, 2), (1000, 3), (7, 1)] {
            let p = FlatPartition::new(numel, world);
            let sizes = p.sizes();
            assert_eq!(sizes.iter().sum::<usize>(), numel);
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            for r in 1..world {
                assert_eq!(p.range(r - 1).end, p.range(r).start);
            }
        }
        // DeepSpeed's 3x5 parameter on 2 ranks is padded to 8+8; balanced, it is 8+7.
        assert_eq!(FlatPartition::new(15, 2).sizes(), vec![8, 7]);
        assert_eq!(FlatPartition::new(5, 4).sizes(), vec![2, 1, 1, 1]);
    }

    #[test]
    fn bucket_counts_are_the_per_rank_intersections() {
        let p = FlatPartition::new(10, 3); // 4, 3, 3
        assert_eq!(p.counts_in(&(0..10)), vec![4, 3, 3]);
        assert_eq!(p.counts_in(&(3..8)), vec![1, 3, 1]);
        assert_eq!(p.counts_in(&(4..7)), vec![0, 3, 0]);
        assert_eq!(p.own_in(2, &(3..8)), 7..8);
        assert_eq!(p.own_in(0, &(4..7)), 0..0);
        assert_eq!(p.own_in(2, &(0..3)), 7..7);
    }

    #[test]
    fn a_tensor_aligned_cut_keeps_tensors_whole_and_balanced() {
        let sizes = [4, 4, 4, 4, 10, 2];
        let p = FlatPartition::tensor_aligned(&sizes, 3);
        // Tensor boundaries are at 0, 4, 8, 12, 16, 26, 28.
        assert_eq!(p.sizes().iter().sum::<usize>(), 28);
        for r in 0..3 {
            let range = p.range(r);
            assert!([0, 4, 8, 12, 16, 26, 28].contains(&range.start));
            assert!([0, 4, 8, 12, 16, 26, 28].contains(&range.end));
        }
        // The 10-element tensor bounds the best cut from below: 12 is optimal here.
        assert_eq!(*p.sizes().iter().max().unwrap(), 12);
    }

    #[test]
    fn segments_split_a_straddling_tensor() {
        let p = FlatPartition::new(10, 2); // 0..5, 5..10
        let sizes = [3, 4, 3]; // 0..3, 3..7, 7..10
        let r0 = p.segments(0, &sizes);
        let r1 = p.segments(1, &sizes);
        assert_eq!(
            r0,
            vec![
                Segment {
                    tensor: 0,
                    global: 0..3,
                    local: 0..3
                },
                Segment {
                    tensor: 1,
                    global: 3..5,
                    local: 3..5
                },
            ]
        );
        assert_eq!(
            r1,
            vec![
                Segment {
                    tensor: 1,
                    global: 5..7,
                    local: 0..2
                },
                Segment {
                    tensor: 2,
                    global: 7..10,
                    local: 2..5
                },
            ]
        );
    }
}
