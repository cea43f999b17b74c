//! [`DevicePlace`]: flat buffers as rank-1 f32 tensors on the model's device, computed by
//! device ops and the CubeCL kernels, and reduced through the [`DeviceCollectives`].

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::ext::{onebit_compress, unpack_signs};

use super::Place;
use crate::comm::{Communicator, ReduceOp};
use crate::device::{DeviceCollectives, host_resident};
use crate::{CommError, Result};

/// The model's device: buffers are `Tensor<1>` of f32, element-wise operations device ops,
/// reductions summed on the device in f32, collectives through the
/// [`DeviceCollectives`] (NCCL on CUDA; host staging otherwise), 1-bit signs packed in u32
/// words (the length padded to a multiple of 32·N so that every rank's chunk is whole words).
/// Scalars (compression scales, norms) go through the host communicator of the same ranks.
///
/// On Flex (host memory) the place computes what [`HostPlace`](super::HostPlace) does, bit for
/// bit, wherever the two paddings and precisions agree; the conformance suite checks it.
#[derive(Debug)]
pub struct DevicePlace {
    coll: Arc<dyn DeviceCollectives>,
    comm: Arc<dyn Communicator>,
    device: Device,
    reads: AtomicU64,
}

impl DevicePlace {
    /// Buffers on `device` (its inner device: outside every autodiff graph), reduced through
    /// `coll`, with scalars over `comm` (the host communicator of the same ranks).
    pub fn new(
        coll: Arc<dyn DeviceCollectives>,
        comm: Arc<dyn Communicator>,
        device: &Device,
    ) -> Self {
        Self {
            coll,
            comm,
            device: device.clone().inner(),
            reads: AtomicU64::new(0),
        }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device collectives.
    pub fn collectives(&self) -> &Arc<dyn DeviceCollectives> {
        &self.coll
    }

    /// The host communicator, shared.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Reads `t` into host memory, counting the bytes off host memory.
    fn read(&self, t: Tensor<1>) -> Result<Vec<f32>> {
        let values = t
            .try_into_data()
            .map_err(|e| format!("{e:?}"))
            .and_then(|d| {
                d.convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| format!("{e:?}"))
            })
            .map_err(|detail| CommError::Device {
                rank: self.rank(),
                op: "read from the device",
                detail,
            })?;
        if !host_resident(&self.device) {
            self.reads
                .fetch_add(4 * values.len() as u64, Ordering::Relaxed);
        }
        Ok(values)
    }

    /// One value per range, `f(range of buf)` (a one-element tensor), `empty` for an empty
    /// range, read to the host in one transfer.
    fn per_range(
        &self,
        buf: &Tensor<1>,
        ranges: &[Range<usize>],
        empty: f32,
        f: impl Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<f32>> {
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let parts = ranges
            .iter()
            .map(|r| match r.is_empty() {
                true => Tensor::full([1], empty, &self.device),
                false => f(buf.clone().slice(r.clone())),
            })
            .collect();
        self.read(Tensor::cat(parts, 0))
    }

    /// `f(range of a, its value)` for each non-empty range, joined.
    fn map_ranges(
        &self,
        a: Tensor<1>,
        ranges: &[Range<usize>],
        values: &[f32],
        f: impl Fn(Tensor<1>, Range<usize>, f32) -> Tensor<1>,
    ) -> Tensor<1> {
        let parts: Vec<Tensor<1>> = ranges
            .iter()
            .zip(values)
            .filter(|(r, _)| !r.is_empty())
            .map(|(r, &v)| f(a.clone().slice(r.clone()), r.clone(), v))
            .collect();
        match parts.is_empty() {
            true => a,
            false => Tensor::cat(parts, 0),
        }
    }

    fn kernel(&self, e: burn_deepspeed_cubecl_kernels::KernelError) -> CommError {
        CommError::Device {
            rank: self.rank(),
            op: "1-bit compression",
            detail: e.to_string(),
        }
    }
}

impl Place for DevicePlace {
    type Buf = Tensor<1>;
    type Signs = Tensor<1, Int>;

    fn rank(&self) -> usize {
        self.coll.rank()
    }

    fn world_size(&self) -> usize {
        self.coll.world_size()
    }

    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn zeros(&self, n: usize) -> Tensor<1> {
        Tensor::zeros([n], &self.device)
    }

    fn upload(&self, values: Vec<f32>) -> Tensor<1> {
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), (&self.device, DType::F32))
    }

    fn download(&self, buf: &Tensor<1>) -> Result<Vec<f32>> {
        self.read(buf.clone())
    }

    fn len(&self, buf: &Tensor<1>) -> usize {
        buf.dims()[0]
    }

    fn slice(&self, buf: &Tensor<1>, range: Range<usize>) -> Tensor<1> {
        buf.clone().slice(range)
    }

    fn cat(&self, parts: Vec<Tensor<1>>) -> Tensor<1> {
        match parts.is_empty() {
            true => self.zeros(0),
            false => Tensor::cat(parts, 0),
        }
    }

    fn pad(&self, buf: Tensor<1>, n: usize) -> Tensor<1> {
        match n.saturating_sub(buf.dims()[0]) {
            0 => buf,
            pad => Tensor::cat(vec![buf, Tensor::zeros([pad], &self.device)], 0),
        }
    }

    fn add(&self, a: Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a + b.clone()
    }

    fn sub(&self, a: Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a - b.clone()
    }

    fn mul(&self, a: Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a * b.clone()
    }

    fn div(&self, a: Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a / b.clone()
    }

    fn scaled(&self, a: Tensor<1>, f: f32) -> Tensor<1> {
        match f {
            1.0 => a,
            f => a.mul_scalar(f),
        }
    }

    fn div_scalar(&self, a: Tensor<1>, f: f32) -> Tensor<1> {
        a.div_scalar(f)
    }

    fn add_scalar(&self, a: Tensor<1>, f: f32) -> Tensor<1> {
        a.add_scalar(f)
    }

    fn sqrt(&self, a: Tensor<1>) -> Tensor<1> {
        a.sqrt()
    }

    fn add_scaled(&self, a: Tensor<1>, b: &Tensor<1>, f: f32) -> Tensor<1> {
        match f {
            0.0 => a,
            f => a + b.clone().mul_scalar(f),
        }
    }

    fn ema(&self, x: Tensor<1>, g: &Tensor<1>, beta: f32) -> Tensor<1> {
        x.mul_scalar(beta) + g.clone().mul_scalar(1.0 - beta)
    }

    fn ema_sq(&self, x: Tensor<1>, g: &Tensor<1>, beta: f32) -> Tensor<1> {
        x.mul_scalar(beta) + g.clone().mul_scalar(1.0 - beta) * g.clone()
    }

    fn squared_norm(&self, buf: &Tensor<1>) -> Result<f64> {
        let sq = self.read(buf.clone().powi_scalar(2).sum())?;
        Ok(sq.first().copied().unwrap_or(0.0) as f64)
    }

    fn norms(&self, buf: &Tensor<1>, ranges: &[Range<usize>]) -> Result<Vec<f32>> {
        let sq = self.per_range(buf, ranges, 0.0, |x| x.powi_scalar(2).sum())?;
        Ok(sq.into_iter().map(f32::sqrt).collect())
    }

    fn maxes(&self, buf: &Tensor<1>, ranges: &[Range<usize>]) -> Result<Vec<f32>> {
        let max = self.per_range(buf, ranges, 0.0, |x| x.max())?;
        Ok(max.into_iter().map(|m| m.max(0.0)).collect())
    }

    fn scale_ranges(&self, buf: Tensor<1>, ranges: &[Range<usize>], f: &[f32]) -> Tensor<1> {
        self.map_ranges(buf, ranges, f, |x, _, f| x.mul_scalar(f))
    }

    fn div_ranges(&self, buf: Tensor<1>, ranges: &[Range<usize>], d: &[f32]) -> Tensor<1> {
        self.map_ranges(buf, ranges, d, |x, _, d| x.div_scalar(d))
    }

    fn add_scaled_ranges(
        &self,
        a: Tensor<1>,
        b: &Tensor<1>,
        ranges: &[Range<usize>],
        f: &[f32],
    ) -> Tensor<1> {
        self.map_ranges(a, ranges, f, |a, r, f| a + b.clone().slice(r).mul_scalar(f))
    }

    fn host_reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    fn all_reduce(&self, buf: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
        match self.world_size() {
            1 => Ok(buf),
            _ => self.coll.all_reduce(buf, op),
        }
    }

    fn sign_padded_len(&self, n: usize) -> usize {
        word_padded_len(n, self.world_size())
    }

    fn compress(&self, x: Tensor<1>, error: Tensor<1>) -> Result<(Tensor<1, Int>, f32, Tensor<1>)> {
        let out = onebit_compress(x, error).map_err(|e| self.kernel(e))?;
        // The scale is read by the host.
        if !host_resident(&self.device) {
            self.reads.fetch_add(4, Ordering::Relaxed);
        }
        Ok(out)
    }

    fn unpack(
        &self,
        signs: &Tensor<1, Int>,
        j: usize,
        parts: usize,
        scale: f32,
        len: usize,
    ) -> Result<Tensor<1>> {
        let words = signs.dims()[0] / parts.max(1);
        let part = signs.clone().slice(j * words..(j + 1) * words);
        unpack_signs(part, scale, len).map_err(|e| self.kernel(e))
    }

    fn all_to_all_signs(&self, signs: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        self.coll.all_to_all_words(signs)
    }

    fn all_gather_signs(&self, signs: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        self.coll.all_gather_words(signs)
    }
}

/// Elements after padding `n` for `world` ranks on a device: a multiple of 32·`world`, so
/// that every rank's chunk packs into whole u32 words.
pub fn word_padded_len(n: usize, world: usize) -> usize {
    let unit = 32 * world.max(1);
    n.div_ceil(unit) * unit
}
