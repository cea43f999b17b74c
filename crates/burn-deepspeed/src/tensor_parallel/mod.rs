//! Tensor slicing (Megatron-LM, arXiv 1909.08053), the third axis of DeepSpeed's 3D
//! parallelism: a layer's weight is cut across the ranks of a tensor-parallel group, and two
//! conjugate ops keep the activations consistent ([`TensorParallel::copy`], Megatron's `f`,
//! and [`TensorParallel::reduce`], its `g`).

mod group;
mod op;

pub use group::*;
pub use op::TensorParallelOps;
