//! [`SliceLayout`]: how a sliced parameter is cut from its whole tensor, and the host-side
//! joining of every rank's slice back into the whole (plain data, tested without tensors).

use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt};

use super::TensorParallel;
use crate::Result;
use crate::flat::ParamLayout;

/// How a sliced parameter's whole tensor is cut: along `dim`, which is `sections` equal
/// sections stacked (1 for a plain layer; 3 for a fused `[q | k | v]` projection), each cut
/// into one equal block per rank of the group. A rank holds block `rank` of every section,
/// concatenated in section order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceLayout {
    /// The dimension that is cut.
    pub dim: usize,
    /// Equal sections of that dimension, each cut on its own.
    pub sections: usize,
}

impl SliceLayout {
    /// The whole tensor's shape, from one slice's `shape` over `parts` ranks.
    pub fn whole_shape(&self, shape: &[usize], parts: usize) -> Vec<usize> {
        let mut whole = shape.to_vec();
        whole[self.dim] *= parts;
        whole
    }

    /// The whole tensor, row-major, from every rank's slice (`slices[r]`: rank r's values,
    /// row-major in the slice's `shape`).
    ///
    /// # Panics
    /// When the slices' lengths do not match `shape`, or `dim` is not in it.
    pub fn join(&self, slices: &[&[f32]], shape: &[usize]) -> Vec<f32> {
        let (outer, mid, inner) = self.split_dims(shape);
        let block = mid / self.sections;
        let mut whole = Vec::with_capacity(outer * mid * inner * slices.len());
        for o in 0..outer {
            for s in 0..self.sections {
                for slice in slices {
                    assert_eq!(slice.len(), outer * mid * inner, "a slice's length");
                    let start = (o * mid + s * block) * inner;
                    whole.extend_from_slice(&slice[start..start + block * inner]);
                }
            }
        }
        whole
    }

    /// Rank `rank`'s slice of `whole` (row-major in `whole_shape`) over `parts` ranks: the
    /// inverse of [`join`](Self::join).
    ///
    /// # Panics
    /// When a section does not split into `parts` equal blocks.
    pub fn cut(&self, whole: &[f32], whole_shape: &[usize], parts: usize, rank: usize) -> Vec<f32> {
        let (outer, mid, inner) = self.split_dims(whole_shape);
        assert!(
            mid.is_multiple_of(self.sections * parts),
            "{mid} features in {} sections do not split into {parts} slices",
            self.sections
        );
        let section = mid / self.sections;
        let block = section / parts;
        let mut slice = Vec::with_capacity(whole.len() / parts);
        for o in 0..outer {
            for s in 0..self.sections {
                let start = (o * mid + s * section + rank * block) * inner;
                slice.extend_from_slice(&whole[start..start + block * inner]);
            }
        }
        slice
    }

    /// `shape` as (elements before `dim`, `dim`'s length, elements after it).
    fn split_dims(&self, shape: &[usize]) -> (usize, usize, usize) {
        assert!(
            self.dim < shape.len(),
            "dimension {} of {shape:?}",
            self.dim
        );
        let outer = shape[..self.dim].iter().product();
        let inner = shape[self.dim + 1..].iter().product();
        (outer, shape[self.dim], inner)
    }
}

/// The whole model's flat values from this rank's `local` ones (flat in `layout`, this rank's
/// slices): each sliced tensor's slices gathered over `comm` (the tensor-parallel group of
/// `tp`) and joined by its layout, the replicated ones as they are. A collective over the
/// group when it has more than one rank; `local` as it is otherwise.
pub(crate) fn join_flat(
    comm: &dyn Communicator,
    tp: &TensorParallel,
    layout: &ParamLayout,
    local: &[f32],
) -> Result<Vec<f32>> {
    let parts = tp.size();
    if parts == 1 {
        return Ok(local.to_vec());
    }
    let mut whole = Vec::with_capacity(local.len() * parts);
    for slot in &layout.slots {
        let mine = &local[slot.offset..slot.offset + slot.numel];
        match tp.layout(slot.id) {
            None => whole.extend_from_slice(mine),
            Some(cut) => {
                let mut all = vec![0.0f32; slot.numel * parts];
                comm.all_gather_equal(mine, &mut all)?;
                let slices: Vec<&[f32]> = all.chunks(slot.numel).collect();
                whole.extend(cut.join(&slices, &slot.shape));
            }
        }
    }
    Ok(whole)
}

/// This rank's flat values (in `layout`, its slices) from the whole tensors `whole(i)` of
/// each slot `i`: the sliced ones cut by their layouts, the replicated ones as they are.
pub(crate) fn cut_flat<'a>(
    tp: &TensorParallel,
    layout: &ParamLayout,
    whole: impl Fn(usize) -> &'a [f32],
) -> Vec<f32> {
    let mut local = Vec::with_capacity(layout.numel);
    for (i, slot) in layout.slots.iter().enumerate() {
        match tp.layout(slot.id) {
            None => local.extend_from_slice(whole(i)),
            Some(cut) => {
                let shape = cut.whole_shape(&slot.shape, tp.size());
                local.extend(cut.cut(whole(i), &shape, tp.size(), tp.rank()));
            }
        }
    }
    local
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[2, 6]` tensor with 3 sections along dim 1 over 2 ranks: each rank holds one column
    /// of every section; cutting and joining are inverse.
    #[test]
    fn sections_are_cut_and_joined_in_order() {
        let whole: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let layout = SliceLayout {
            dim: 1,
            sections: 3,
        };
        let a = layout.cut(&whole, &[2, 6], 2, 0);
        let b = layout.cut(&whole, &[2, 6], 2, 1);
        assert_eq!(a, [0., 2., 4., 6., 8., 10.]);
        assert_eq!(b, [1., 3., 5., 7., 9., 11.]);
        assert_eq!(layout.join(&[&a, &b], &[2, 3]), whole);
        assert_eq!(layout.whole_shape(&[2, 3], 2), [2, 6]);
    }

    /// Rows (dim 0) over 3 ranks, and a vector, round-trip.
    #[test]
    fn rows_and_vectors_round_trip() {
        let whole: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let rows = SliceLayout {
            dim: 0,
            sections: 1,
        };
        let parts: Vec<_> = (0..3).map(|r| rows.cut(&whole, &[6, 4], 3, r)).collect();
        assert_eq!(parts[1], (8..16).map(|i| i as f32).collect::<Vec<_>>());
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(rows.join(&refs, &[2, 4]), whole);
        let parts: Vec<_> = (0..4).map(|r| rows.cut(&whole, &[24], 4, r)).collect();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(rows.join(&refs, &[6]), whole);
    }
}
