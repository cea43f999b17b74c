//! [`HostCollectives`]: device collectives through the host [`Communicator`], in place on
//! Flex's host buffers and staged through host memory on any other device.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::collectives::{
    DeviceCollectives, DeviceTraffic, as_buf, as_buf_mut, check_counts, check_dtype,
    check_equal_chunks, check_peer, check_words, host_zeros,
};
use crate::comm::{Buf, BufMut, Communicator, ReduceOp};
use crate::{CommError, Result};

/// Whether `device` keeps its tensors in host memory (Flex, with or without autodiff): its
/// buffers reach the communicator without a host/device copy.
pub fn host_resident(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// The device collectives of every backend without a device transport of its own.
///
/// On Flex a tensor's buffer already is host memory: a tensor that owns its buffer alone is
/// read and rebuilt without a copy (Burn's Flex hands its bytes over in `into_data` and takes
/// them back in `from_data`), and the traffic counters stay at zero. On any other device
/// (wgpu, CUDA without NCCL) each collective reads its input to the host, runs the host
/// collective and writes the result back, and the counters add both copies: wgpu has no
/// other path between ranks.
#[derive(Debug)]
pub struct HostCollectives {
    comm: Arc<dyn Communicator>,
    device_to_host: AtomicU64,
    host_to_device: AtomicU64,
}

impl HostCollectives {
    /// Device collectives over the ranks of `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            device_to_host: AtomicU64::new(0),
            host_to_device: AtomicU64::new(0),
        }
    }

    /// The host communicator underneath.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    fn device_error(&self, op: &'static str, detail: String) -> CommError {
        CommError::Device {
            rank: self.comm.rank(),
            op,
            detail,
        }
    }

    /// The tensor's values in host memory, and its device.
    fn read(&self, op: &'static str, t: Tensor<1>) -> Result<(TensorData, Device)> {
        check_dtype(self.comm.rank(), op, t.dtype())?;
        let device = t.device();
        let data = t
            .try_into_data()
            .map_err(|e| self.device_error(op, format!("reading the buffer failed: {e:?}")))?;
        if !host_resident(&device) {
            self.device_to_host
                .fetch_add(data.bytes().len() as u64, Ordering::Relaxed);
        }
        Ok((data, device))
    }

    /// Host values as a tensor on `device`, in their own dtype.
    fn write(&self, data: TensorData, device: &Device) -> Tensor<1> {
        if !host_resident(device) {
            self.host_to_device
                .fetch_add(data.bytes().len() as u64, Ordering::Relaxed);
        }
        let dtype = data.dtype();
        Tensor::from_data(data, (device, dtype))
    }

    /// u32 words in host memory (counted as a device read off Flex).
    fn read_words(&self, op: &'static str, t: Tensor<1, Int>) -> Result<(TensorData, Device)> {
        check_words(self.comm.rank(), op, t.dtype())?;
        let device = t.device();
        let data = t
            .try_into_data()
            .map_err(|e| self.device_error(op, format!("reading the words failed: {e:?}")))?;
        if !host_resident(&device) {
            self.device_to_host
                .fetch_add(data.bytes().len() as u64, Ordering::Relaxed);
        }
        Ok((data, device))
    }

    /// Host bytes of u32 words as a tensor on `device`.
    fn write_words(&self, bytes: Vec<u8>, device: &Device) -> Tensor<1, Int> {
        if !host_resident(device) {
            self.host_to_device
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        let n = bytes.len() / 4;
        let data = TensorData::from_bytes_vec(bytes, [n], DType::U32);
        Tensor::from_data(data, (device, DType::U32))
    }

    fn view_error(&self, op: &'static str) -> impl Fn(String) -> CommError + '_ {
        move |detail| self.device_error(op, detail)
    }
}

impl DeviceCollectives for HostCollectives {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn kind(&self) -> &'static str {
        "host"
    }

    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
        if self.world_size() == 1 {
            // One rank's sum, mean and maximum are its own values.
            check_dtype(self.rank(), "all_reduce", t.dtype())?;
            return Ok(t);
        }
        let (mut data, device) = self.read("all_reduce", t)?;
        self.comm.all_reduce_buf(
            as_buf_mut(&mut data).map_err(self.view_error("all_reduce"))?,
            op,
        )?;
        Ok(self.write(data, &device))
    }

    fn reduce_scatter(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        let (rank, world) = (self.rank(), self.world_size());
        check_counts(rank, world, "reduce_scatter", counts, t.dims()[0])?;
        let (data, device) = self.read("reduce_scatter", t)?;
        let mut out = host_zeros(data.dtype(), counts[rank]);
        let e = self.view_error("reduce_scatter");
        self.comm.reduce_scatter_buf(
            as_buf(&data).map_err(&e)?,
            as_buf_mut(&mut out).map_err(&e)?,
            counts,
            ReduceOp::Sum,
        )?;
        Ok(self.write(out, &device))
    }

    fn all_gather(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        let (rank, world) = (self.rank(), self.world_size());
        check_counts(rank, world, "all_gather", counts, t.dims()[0])?;
        let (data, device) = self.read("all_gather", t)?;
        let mut out = host_zeros(data.dtype(), counts.iter().sum());
        let e = self.view_error("all_gather");
        self.comm.all_gather_buf(
            as_buf(&data).map_err(&e)?,
            as_buf_mut(&mut out).map_err(&e)?,
            counts,
        )?;
        Ok(self.write(out, &device))
    }

    fn broadcast(&self, t: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        check_peer(self.rank(), self.world_size(), "broadcast", root, true)?;
        let (mut data, device) = self.read("broadcast", t)?;
        self.comm.broadcast_buf(
            as_buf_mut(&mut data).map_err(self.view_error("broadcast"))?,
            root,
        )?;
        Ok(self.write(data, &device))
    }

    fn all_to_all(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        check_equal_chunks(self.rank(), self.world_size(), t.dims()[0])?;
        let (data, device) = self.read("all_to_all", t)?;
        let mut out = host_zeros(data.dtype(), data.num_elements());
        let e = self.view_error("all_to_all");
        self.comm.all_to_all_buf(
            as_buf(&data).map_err(&e)?,
            as_buf_mut(&mut out).map_err(&e)?,
        )?;
        Ok(self.write(out, &device))
    }

    fn send(&self, t: Tensor<1>, dst: usize, tag: u16) -> Result<()> {
        check_peer(self.rank(), self.world_size(), "send", dst, false)?;
        let (data, _) = self.read("send", t)?;
        self.comm
            .send_buf(as_buf(&data).map_err(self.view_error("send"))?, dst, tag)
    }

    fn recv(&self, like: Tensor<1>, src: usize, tag: u16) -> Result<Tensor<1>> {
        check_peer(self.rank(), self.world_size(), "recv", src, false)?;
        check_dtype(self.rank(), "recv", like.dtype())?;
        let device = like.device();
        let mut data = host_zeros(like.dtype(), like.dims()[0]);
        self.comm.recv_buf(
            as_buf_mut(&mut data).map_err(self.view_error("recv"))?,
            src,
            tag,
        )?;
        Ok(self.write(data, &device))
    }

    fn all_to_all_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        check_equal_chunks(self.rank(), self.world_size(), t.dims()[0])?;
        let (data, device) = self.read_words("all_to_all_words", t)?;
        let mut out = vec![0u8; data.as_bytes().len()];
        self.comm
            .all_to_all_buf(Buf::U8(data.as_bytes()), BufMut::U8(&mut out))?;
        Ok(self.write_words(out, &device))
    }

    fn all_gather_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        let (data, device) = self.read_words("all_gather_words", t)?;
        let bytes = data.as_bytes();
        let mut out = vec![0u8; bytes.len() * self.world_size()];
        let counts = vec![bytes.len(); self.world_size()];
        self.comm
            .all_gather_buf(Buf::U8(bytes), BufMut::U8(&mut out), &counts)?;
        Ok(self.write_words(out, &device))
    }

    fn barrier(&self) -> Result<()> {
        self.comm.barrier()
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    fn traffic(&self) -> DeviceTraffic {
        DeviceTraffic {
            device_to_host: self.device_to_host.load(Ordering::Relaxed),
            host_to_device: self.host_to_device.load(Ordering::Relaxed),
        }
    }
}
