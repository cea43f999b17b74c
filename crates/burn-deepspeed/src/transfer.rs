//! Host/device copies, counted where they happen.
//!
//! Every copy the engine makes between a tensor on the model's device and host memory (a
//! gradient read into a flat host buffer, a parameter rebuilt from host values, a stage-3
//! shard gathered through the host communicator, an activation checkpoint kept on the
//! host) goes through `read`, `read_f32` or [`write`] here, which add the bytes moved to
//! this thread's counter unless the device keeps its tensors in host memory (Flex), where no
//! host/device boundary exists. A rank runs its engine on one thread (a thread of the thread
//! world, or an MPI process's main thread), so [`host_device_bytes`] read on the rank's
//! thread is that rank's total.
//!
//! Copies made to stage a collective (the host communicator moving device buffers, as it must
//! between wgpu ranks) run inside `staging` and are also added to
//! [`staged_collective_bytes`]: where training is device-resident, every host/device byte of
//! a step is a staged collective byte, and the two counters agree.

use std::cell::Cell;

use burn::backend::{Backend, Flex};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_deepspeed_strategies::device::{DeviceCollectives, host_resident};

thread_local! {
    static COPIED: Cell<u64> = const { Cell::new(0) };
    static STAGED: Cell<u64> = const { Cell::new(0) };
    static STAGING: Cell<u32> = const { Cell::new(0) };
}

/// Bytes this thread has copied between host memory and a device so far (both directions).
pub fn host_device_bytes() -> u64 {
    COPIED.with(Cell::get)
}

/// The part of [`host_device_bytes`] copied to stage a collective (see `staging`).
pub fn staged_collective_bytes() -> u64 {
    STAGED.with(Cell::get)
}

/// Runs `f`, a collective whose device buffers pass through host memory: the copies it makes
/// count as staged collective bytes as well.
pub(crate) fn staging<T>(f: impl FnOnce() -> T) -> T {
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            STAGING.with(|s| s.set(s.get() - 1));
        }
    }
    STAGING.with(|s| s.set(s.get() + 1));
    let _scope = Scope;
    f()
}

/// Runs the device collective `f` on `coll`, counting the bytes it staged through host
/// memory (the traffic `coll` reports; none under NCCL or on Flex) as host/device copies of
/// `device` that staged a collective.
pub(crate) fn staged_collective<T>(
    coll: &dyn DeviceCollectives,
    device: &Device,
    f: impl FnOnce(&dyn DeviceCollectives) -> T,
) -> T {
    let before = coll.traffic().total();
    let out = f(coll);
    let moved = (coll.traffic().total() - before) as usize;
    staging(|| count(device, moved));
    out
}

fn add(bytes: usize) {
    COPIED.with(|c| c.set(c.get() + bytes as u64));
    if STAGING.with(Cell::get) > 0 {
        STAGED.with(|c| c.set(c.get() + bytes as u64));
    }
}

/// Adds `bytes` copied to or from `device`.
pub(crate) fn count(device: &Device, bytes: usize) {
    if !host_resident(device) {
        add(bytes);
    }
}

/// Adds `bytes` copied to or from a device of backend `B` (the custom ops' primitives).
pub(crate) fn count_primitive<B: Backend>(bytes: usize) {
    if std::any::TypeId::of::<B>() != std::any::TypeId::of::<Flex>() {
        add(bytes);
    }
}

/// The tensor's values in host memory, in its own dtype.
pub(crate) fn read<const D: usize>(t: Tensor<D>) -> TensorData {
    let device = t.device();
    let data = t.into_data();
    count(&device, data.bytes().len());
    data
}

/// The tensor's values in host memory as f32.
pub(crate) fn read_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    read(t)
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data converts to a Vec<f32>")
}

/// Host values as a tensor on `device` in `dtype`.
pub(crate) fn write<const D: usize>(data: TensorData, device: &Device, dtype: DType) -> Tensor<D> {
    count(device, data.num_elements() * dtype.size());
    Tensor::from_data(data, (device, dtype))
}

/// Host values as a tensor on `device` in its default float dtype.
pub(crate) fn write_default<const D: usize>(data: TensorData, device: &Device) -> Tensor<D> {
    let t = Tensor::<D>::from_data(data, device);
    count(device, t.shape().num_elements() * t.dtype().size());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flex_copies_count_nothing_and_the_counter_is_per_thread() {
        let before = host_device_bytes();
        let t = write::<1>(
            TensorData::new(vec![1.0f32; 10], [10]),
            &Device::flex(),
            DType::F32,
        );
        assert_eq!(read_f32(t), vec![1.0; 10]);
        assert_eq!(host_device_bytes(), before);
        count_primitive::<Flex>(100);
        assert_eq!(host_device_bytes(), before);
        std::thread::spawn(|| {
            count_primitive::<burn::backend::Autodiff<Flex>>(100);
            staging(|| count_primitive::<burn::backend::Autodiff<Flex>>(50));
            assert_eq!(host_device_bytes(), 150);
            assert_eq!(staged_collective_bytes(), 50);
        })
        .join()
        .unwrap();
        assert_eq!(host_device_bytes(), before);
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_copies_count_both_directions() {
        let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
        let before = host_device_bytes();
        let t = write::<1>(TensorData::new(vec![1.0f32; 10], [10]), &device, DType::F32);
        assert_eq!(host_device_bytes() - before, 40);
        let staged = staged_collective_bytes();
        assert_eq!(staging(|| read_f32(t)), vec![1.0; 10]);
        assert_eq!(host_device_bytes() - before, 80);
        assert_eq!(staged_collective_bytes() - staged, 40);
    }
}
