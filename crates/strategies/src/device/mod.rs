//! Collectives on the model's device buffers: the [`DeviceCollectives`] trait beside the
//! host [`Communicator`](crate::comm::Communicator), [`HostCollectives`] (Flex in place, any
//! other device staged through host memory), NCCL with feature `cuda`, and the bootstrap of
//! a device transport's identifier over the host communicator.

mod bootstrap;
mod collectives;
pub mod conformance;
mod host;
#[cfg(feature = "cuda")]
mod nccl;
mod select;

pub use bootstrap::*;
pub use collectives::{DeviceCollectives, DeviceTraffic};
pub use host::*;
#[cfg(feature = "cuda")]
pub use nccl::*;
pub use select::*;

#[cfg(test)]
mod tests;
