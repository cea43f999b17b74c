//! Gradient buckets: contiguous runs of a flat gradient reduced in one collective.
//!
//! DeepSpeed reduces gradients in buckets of `reduce_bucket_size` *elements* (ZeRO paper,
//! arXiv 1910.02054): larger buckets mean fewer, more efficient collectives; smaller ones less
//! staging memory. A plan is plain data, computed once from the parameter sizes.

use std::ops::Range;

/// Contiguous ranges of a flat buffer of `total` elements, each at most `bucket_size` long
/// (the last may be shorter). A `bucket_size` of 0 means one bucket for everything.
pub fn bucket_ranges(total: usize, bucket_size: usize) -> Vec<Range<usize>> {
    if total == 0 {
        return Vec::new();
    }
    let size = if bucket_size == 0 { total } else { bucket_size };
    (0..total.div_ceil(size))
        .map(|i| i * size..((i + 1) * size).min(total))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_buffer_once() {
        for (total, size) in [(0, 4), (1, 4), (10, 4), (12, 4), (12, 0), (5, 100)] {
            let b = bucket_ranges(total, size);
            let covered: Vec<usize> = b.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(covered, (0..total).collect::<Vec<_>>());
            if size > 0 {
                assert!(b.iter().all(|r| r.len() <= size));
            }
        }
        assert_eq!(bucket_ranges(10, 4), vec![0..4, 4..8, 8..10]);
    }
}
