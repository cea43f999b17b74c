//! [`device_collectives`]: the device collectives a rank's model device calls for.

use std::sync::Arc;

use burn::tensor::Device;

use super::{DeviceCollectives, HostCollectives};
use crate::Result;
use crate::comm::Communicator;

/// The environment variable that, set to `0` on any rank, keeps CUDA runs on
/// [`HostCollectives`] instead of NCCL (every rank then uses them).
pub const NCCL_ENV: &str = "BURN_DEEPSPEED_NCCL";

/// The device collectives for a model on `device`: NCCL (`NcclCollectives`, feature `cuda`)
/// when `device` is a CUDA device of a known ordinal, every rank can load
/// NCCL and has not turned it off with [`NCCL_ENV`], and no two ranks share a GPU (NCCL
/// refuses a communicator with two ranks on one device); [`HostCollectives`] otherwise (Flex
/// in place, wgpu and shared GPUs staged through host memory, counted). A collective: every
/// rank calls it, with a device of the same kind, and the ranks agree on the choice over
/// `comm` before NCCL starts.
pub fn device_collectives(
    comm: Arc<dyn Communicator>,
    device: &Device,
) -> Result<Arc<dyn DeviceCollectives>> {
    #[cfg(feature = "cuda")]
    if let Some(ordinal) = cuda_ordinal(device) {
        let off = std::env::var(NCCL_ENV).is_ok_and(|v| v == "0");
        let distinct = ordinals_distinct(comm.as_ref(), ordinal)?;
        if all_ranks_can(comm.as_ref(), distinct && !off && super::nccl_available())? {
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

/// Whether every rank's CUDA `ordinal` differs from every other rank's (a collective: one
/// all-reduce of a count per ordinal among the first 64, exact in f32).
#[cfg(feature = "cuda")]
pub fn ordinals_distinct(comm: &dyn Communicator, ordinal: usize) -> Result<bool> {
    use crate::comm::CommunicatorExt;
    let mut ranks_on = [0f32; 64];
    ranks_on[ordinal.min(63)] = 1.0;
    if comm.world_size() > 1 {
        comm.all_reduce(&mut ranks_on, crate::comm::ReduceOp::Sum)?;
    }
    Ok(ranks_on.iter().all(|&n| n <= 1.0))
}

/// The number of CUDA devices this machine has (0 when the CUDA driver cannot be loaded).
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> usize {
    // SAFETY: this only tries to open the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
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
