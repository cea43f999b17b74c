//! Tensor slicing (Megatron-LM, arXiv 1909.08053), the third axis of DeepSpeed's 3D
//! parallelism: a layer's weight is cut across the ranks of a tensor-parallel group, and two
//! conjugate ops keep the activations consistent ([`TensorParallel::copy`], Megatron's `f`,
//! and [`TensorParallel::reduce`], its `g`). The layers: [`ColumnParallelLinear`],
//! [`RowParallelLinear`], [`VocabParallelEmbedding`] and [`vocab_parallel_cross_entropy`];
//! Burn's stock transformer sliced: [`ParallelTransformerEncoderLayer`] (from a
//! `TransformerEncoderLayer`), [`ParallelMultiHeadAttention`], [`ParallelFeedForward`].

mod cross_entropy;
mod embedding;
mod group;
mod layout;
mod linear;
mod op;
mod transformer;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use embedding::VocabParallelEmbedding;
pub use group::*;
pub use layout::SliceLayout;
pub(crate) use layout::{cut_flat, join_flat};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use op::TensorParallelOps;
pub use transformer::{
    ParallelFeedForward, ParallelMultiHeadAttention, ParallelTransformerEncoderLayer,
};

#[cfg(test)]
mod test_util {
    use burn::tensor::Tensor;

    pub(super) fn read<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().expect("f32")
    }

    /// `a` equals `b` within 1e-5 relative (plus 1e-5 absolute).
    pub(super) fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: {x} vs {y}"
            );
        }
    }
}
