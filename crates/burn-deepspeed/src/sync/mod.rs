//! Gradient synchronisation: the [`GradSync`] trait and its regimes (ZeRO stages 0-3, 1-bit
//! compression), with the pieces they share (the flat gradient buffer, scaling and clipping,
//! the options read from the config). Adding a regime (offload, expert groups) is one new
//! file here and one arm in [`build`].

mod base;
mod bucket;
mod buffer;
mod build;
mod compressed;
mod device;
mod device_grads;
mod device_shards;
mod device_step;
mod elem;
mod expert;
mod expert_layout;
mod flat_optim;
mod grads;
mod host_grads;
mod host_shards;
mod norm;
mod offload;
mod options;
mod partitioned;
mod pieces;
mod place;
mod replicated;
pub mod scale;
mod shard_cut;
mod sharded;
mod sharded_offload;
mod shards;

pub use base::*;
pub use buffer::*;
pub use build::*;
pub use compressed::*;
pub use device::module_device;
pub use device_grads::DeviceGrads;
pub use device_shards::DeviceShards;
pub use device_step::DeviceOptimizer;
pub use elem::*;
pub use expert::*;
pub use expert_layout::WholeLayout;
pub use flat_optim::*;
pub use grads::{Cut, GradStore, Part};
pub use host_grads::HostGrads;
pub use host_shards::HostShards;
pub use norm::ModelParallelNorm;
pub use offload::*;
pub use options::*;
pub use partitioned::*;
pub use pieces::*;
pub use place::{ModelPlace, clipped};
pub use replicated::*;
pub use shard_cut::ShardCut;
pub use sharded::*;
