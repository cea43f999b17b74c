//! Where flat buffers live: the [`Place`] trait, with [`HostPlace`] (host memory) and
//! [`DevicePlace`] (the model's device), and the conformance suite every place passes.

mod base;
#[cfg(test)]
pub(crate) mod conformance;
mod device;
mod host;

pub use base::*;
pub use device::*;
pub use host::*;

#[cfg(test)]
mod tests;
