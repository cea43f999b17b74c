//! [`device_collectives`]: the device collectives a rank's model device calls for.

use std::sync::Arc;

use burn::tensor::Device;

use super::{DeviceCollectives, HostCollectives};
use crate::Result;
use crate::comm::Communicator;

/// The environment variable that, set to `0` on any rank, keeps CUDA runs on
/// [`HostCollectives`] instead of NCCL (every rank then uses them).
pub const NCCL_ENV: &str = "BURN_DEEPSPEED_NCCL";

/// The device collectives for a model on `device`: NCCL ([`NcclCollectives`](super::NcclCollectives),
/// feature `cuda`) when `device` is a CUDA device of a known ordinal and every rank can load
/// NCCL and has not turned it off with [`NCCL_ENV`]; [`HostCollectives`] otherwise (Flex in
/// place, wgpu staged through host memory). A collective: every rank calls it, with a device
/// of the same kind, and the ranks agree on the choice over `comm` before NCCL starts.
pub fn device_collectives(
    comm: Arc<dyn Communicator>,
    device: &Device,
) -> Result<Arc<dyn DeviceCollectives>> {
    #[cfg(feature = "cuda")]
    if let Some(ordinal) = cuda_ordinal(device) {
        let off = std::env::var(NCCL_ENV).is_ok_and(|v| v == "0");
        if all_ranks_can(comm.as_ref(), !off && super::nccl_available())? {
            return Ok(Arc::new(super::NcclCollectives::new(comm, ordinal)?));
        }
    }
    let _ = device;
    Ok(Arc::new(HostCollectives::new(comm)))
}

/// The CUDA ordinal of `device` (among the first 64), when it is a CUDA device.
#[cfg(feature = "cuda")]
pub fn cuda_ordinal(device: &Device) -> Option<usize> {
    let device = device.clone().inner();
    (0..64).find(|&i| device == Device::cuda(i))
}

/// Whether `mine` holds on every rank (a collective: one all-reduce of a byte).
pub fn all_ranks_can(comm: &dyn Communicator, mine: bool) -> Result<bool> {
    use crate::comm::CommunicatorExt;
    let mut refuse = [u8::from(!mine)];
    if comm.world_size() > 1 {
        comm.all_reduce(&mut refuse, crate::comm::ReduceOp::Max)?;
    }
    Ok(refuse[0] == 0)
}
