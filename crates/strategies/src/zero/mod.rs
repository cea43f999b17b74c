//! ZeRO-DP (arXiv 1910.02054) building blocks: how a flat buffer is cut across data-parallel
//! ranks ([`FlatPartition`]), and the optimizer that steps one rank's cut of it
//! ([`PartitionedOptimizer`]). Both are independent of Burn's tensors.

mod optimizer;
mod partition;

pub use optimizer::*;
pub use partition::*;
