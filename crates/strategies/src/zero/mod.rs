//! ZeRO-DP (arXiv 1910.02054) building blocks: how a flat buffer is cut across data-parallel
//! ranks ([`FlatPartition`]), and the optimizer that steps one rank's cut of it
//! ([`PartitionedOptimizer`]), and how stage 3 cuts each tensor ([`ShardPlan`]). All are
//! independent of Burn's tensors.

mod optimizer;
mod partition;
mod shard;

pub use optimizer::*;
pub use partition::*;
pub use shard::*;
