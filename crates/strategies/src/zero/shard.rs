//! [`ShardPlan`]: how ZeRO stage 3 (arXiv 1910.02054 §5.3) cuts every parameter tensor
//! across the data-parallel ranks.
//!
//! As in DeepSpeed, each tensor is cut on its own: a tensor of `n` elements is padded to
//! `world × chunk` with `chunk = ⌈n / world⌉`, and rank `r` stores elements
//! `r·chunk .. (r+1)·chunk` (zeros past `n`). A tensor gathered for use is one all-gather of
//! equal chunks; its gradient is one reduce-scatter of equal chunks.
//!
//! Tensors of at most `persistence_threshold` elements stay whole on every rank
//! (`stage3_param_persistence_threshold`): gathering them would cost more in latency than
//! their memory is worth. Their optimizer state is still cut the same way.
//!
//! The optimizer of a rank steps the real (unpadded) elements it stores, tensor after tensor:
//! [`ShardPlan::segments`] gives their place in the layout's flat order and in the rank's
//! buffer. This is plain data, tested without tensors.

use std::ops::Range;

use super::Segment;

/// How one tensor is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorShard {
    /// Elements of the whole tensor.
    pub numel: usize,
    /// Elements each rank stores (padded): `⌈numel / world⌉`.
    pub chunk: usize,
    /// Kept whole on every rank (at most the persistence threshold).
    pub persistent: bool,
}

/// The stage-3 cut of a list of tensors (in the layout's order) across `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    world: usize,
    tensors: Vec<TensorShard>,
    offsets: Vec<usize>,
}

impl ShardPlan {
    /// The plan for tensors of `sizes` elements over `world` ranks; tensors of at most
    /// `persistence_threshold` elements stay whole, while the whole tensors add up to at most
    /// `model_persistence` elements (`stage3_model_persistence_threshold`; later small
    /// tensors are partitioned).
    pub fn new(
        sizes: &[usize],
        world: usize,
        persistence_threshold: usize,
        model_persistence: usize,
    ) -> Self {
        assert!(world > 0, "a shard plan needs at least one rank");
        let mut offsets = Vec::with_capacity(sizes.len() + 1);
        offsets.push(0);
        let mut kept = 0usize;
        let tensors = sizes
            .iter()
            .map(|&numel| {
                offsets.push(offsets.last().copied().unwrap_or(0) + numel);
                let persistent = numel <= persistence_threshold
                    && kept.saturating_add(numel) <= model_persistence;
                if persistent {
                    kept += numel;
                }
                TensorShard {
                    numel,
                    chunk: numel.div_ceil(world),
                    persistent,
                }
            })
            .collect();
        Self {
            world,
            tensors,
            offsets,
        }
    }

    /// Ranks in the plan.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The tensors, in layout order.
    pub fn tensors(&self) -> &[TensorShard] {
        &self.tensors
    }

    /// Tensor `t`'s first element in the layout's flat order.
    pub fn offset(&self, t: usize) -> usize {
        self.offsets[t]
    }

    /// The real elements of tensor `t` that `rank` owns (empty when the padding covers its
    /// whole chunk).
    pub fn own(&self, rank: usize, t: usize) -> Range<usize> {
        let s = &self.tensors[t];
        let start = (rank * s.chunk).min(s.numel);
        start..((rank + 1) * s.chunk).min(s.numel)
    }

    /// The pieces `rank` owns, tensor after tensor: their place in the layout's flat order
    /// (`global`) and in the rank's buffer (`local`), skipping empty pieces.
    pub fn segments(&self, rank: usize) -> Vec<Segment> {
        let mut at = 0;
        let mut out = Vec::new();
        for t in 0..self.tensors.len() {
            let own = self.own(rank, t);
            if own.is_empty() {
                continue;
            }
            let len = own.len();
            out.push(Segment {
                tensor: t,
                global: self.offsets[t] + own.start..self.offsets[t] + own.end,
                local: at..at + len,
            });
            at += len;
        }
        out
    }

    /// Real elements `rank` owns (the length of its optimizer buffers).
    pub fn own_len(&self, rank: usize) -> usize {
        (0..self.tensors.len())
            .map(|t| self.own(rank, t).len())
            .sum()
    }

    /// Elements `rank` stores as parameters: the padded chunk of every partitioned tensor
    /// and every persistent tensor whole.
    pub fn stored_elems(&self) -> usize {
        self.tensors
            .iter()
            .map(|s| if s.persistent { s.numel } else { s.chunk })
            .sum()
    }

    /// Elements of the persistent tensors (kept whole on every rank).
    pub fn persistent_elems(&self) -> usize {
        self.tensors
            .iter()
            .filter(|s| s.persistent)
            .map(|s| s.numel)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_padded_to_equal_sizes_like_deepspeed() {
        // DeepSpeed's test: a tensor of 10 elements on 4 ranks stores 3, 3, 3, 3 (the last
        // one with 2 padding zeros).
        let plan = ShardPlan::new(&[10, 8, 3], 4, 0, usize::MAX);
        assert_eq!(plan.tensors()[0].chunk, 3);
        assert_eq!(plan.tensors()[1].chunk, 2);
        assert_eq!(plan.tensors()[2].chunk, 1);
        assert_eq!(plan.own(3, 0), 9..10);
        assert_eq!(
            plan.own(3, 2),
            3..3,
            "rank 3's chunk of a 3-element tensor is padding"
        );
        let owned: Vec<usize> = (0..4).map(|r| plan.own_len(r)).collect();
        assert_eq!(owned, vec![6, 6, 6, 3]);
        assert_eq!(owned.iter().sum::<usize>(), 21);
        assert_eq!(plan.stored_elems(), 6);
    }

    #[test]
    fn segments_cover_every_element_exactly_once() {
        for world in 1..=5 {
            let sizes = [1, 7, 22, 64, 1000, 5];
            let plan = ShardPlan::new(&sizes, world, 6, usize::MAX);
            let total: usize = sizes.iter().sum();
            let mut seen = vec![0u8; total];
            for r in 0..world {
                let segs = plan.segments(r);
                let mut at = 0;
                for s in &segs {
                    assert_eq!(s.local.start, at, "local pieces are back to back");
                    assert_eq!(s.local.len(), s.global.len());
                    at = s.local.end;
                    seen[s.global.clone()].iter_mut().for_each(|x| *x += 1);
                }
                assert_eq!(at, plan.own_len(r));
            }
            assert!(seen.iter().all(|&x| x == 1), "world {world}");
        }
    }

    #[test]
    fn small_tensors_persist_whole() {
        let plan = ShardPlan::new(&[100, 101, 50], 2, 100, usize::MAX);
        let persistent: Vec<bool> = plan.tensors().iter().map(|s| s.persistent).collect();
        assert_eq!(persistent, vec![true, false, true]);
        assert_eq!(plan.stored_elems(), 100 + 51 + 50);
        assert_eq!(plan.persistent_elems(), 150);
        assert_eq!(plan.offset(2), 201);
        // At most 120 whole elements in all: the second small tensor is partitioned.
        let capped = ShardPlan::new(&[100, 101, 50], 2, 100, 120);
        let persistent: Vec<bool> = capped.tensors().iter().map(|s| s.persistent).collect();
        assert_eq!(persistent, vec![true, false, false]);
    }
}
