//! [`Place`]: where a regime's flat f32 buffers live, and the few operations an algorithm
//! written once needs of them.

use std::fmt::Debug;
use std::ops::Range;

use crate::Result;
use crate::comm::{Communicator, ReduceOp};

/// Where flat f32 buffers live (host memory, a device) and how they are computed on and
/// reduced over the ranks: the one seam between an algorithm and its storage, as CubeCL's
/// `Runtime` is between a kernel and its device. An optimizer or a regime written over
/// `Place` runs unchanged on [`HostPlace`](super::HostPlace) (`Vec<f32>`, loops on the CPU,
/// the host [`Communicator`]) and on [`DevicePlace`](super::DevicePlace) (`Tensor<1>`,
/// device ops and CubeCL kernels, the
/// [`DeviceCollectives`](crate::device::DeviceCollectives)).
///
/// Every element-wise operation states its order of operations, and each place keeps it, so
/// that an algorithm gives the same bits wherever the place's arithmetic is IEEE f32 (the
/// host and Flex). Reductions keep each place's own precision: the host sums squares in f64,
/// a device in f32. Per-tensor values (norms, maxima: one value per range) come back to the
/// host as `Vec<f32>`; a device place counts the bytes it reads for them
/// ([`host_reads`](Self::host_reads)).
///
/// The conformance suite (`conformance`, in the tests) runs every operation on every place built.
pub trait Place: Send + Sync + Debug {
    /// A flat f32 buffer in this place.
    type Buf: Clone + Send + Debug;
    /// The packed signs of a 1-bit compression in this place.
    type Signs: Send;

    /// This rank in the place's world.
    fn rank(&self) -> usize;
    /// Ranks in the place's world.
    fn world_size(&self) -> usize;
    /// The host communicator of the same ranks (scalars: compression scales, norms).
    fn comm(&self) -> &dyn Communicator;

    /// `n` zeros.
    fn zeros(&self, n: usize) -> Self::Buf;
    /// Host values in this place.
    fn upload(&self, values: Vec<f32>) -> Self::Buf;
    /// The buffer's values in host memory.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Elements in the buffer.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Elements `range` of the buffer.
    fn slice(&self, buf: &Self::Buf, range: Range<usize>) -> Self::Buf;
    /// The buffers joined in order.
    fn cat(&self, parts: Vec<Self::Buf>) -> Self::Buf;
    /// The buffer followed by zeros up to `n` elements (`n` at least its length).
    fn pad(&self, buf: Self::Buf, n: usize) -> Self::Buf;

    /// `a + b`.
    fn add(&self, a: Self::Buf, b: &Self::Buf) -> Self::Buf;
    /// `a − b`.
    fn sub(&self, a: Self::Buf, b: &Self::Buf) -> Self::Buf;
    /// `a · b`, element by element.
    fn mul(&self, a: Self::Buf, b: &Self::Buf) -> Self::Buf;
    /// `a / b`.
    fn div(&self, a: Self::Buf, b: &Self::Buf) -> Self::Buf;
    /// `a · f` (`a` itself when `f` is 1).
    fn scaled(&self, a: Self::Buf, f: f32) -> Self::Buf;
    /// `a / f`.
    fn div_scalar(&self, a: Self::Buf, f: f32) -> Self::Buf;
    /// `a + f`.
    fn add_scalar(&self, a: Self::Buf, f: f32) -> Self::Buf;
    /// `√a`.
    fn sqrt(&self, a: Self::Buf) -> Self::Buf;
    /// `a + f·b`. A device may return `a` itself when `f` is 0; the host computes `f·b`
    /// always (the two differ only where `b` is not finite or `a` is −0).
    fn add_scaled(&self, a: Self::Buf, b: &Self::Buf, f: f32) -> Self::Buf;
    /// `β·x + (1−β)·g`: an exponential moving average.
    fn ema(&self, x: Self::Buf, g: &Self::Buf, beta: f32) -> Self::Buf;
    /// `β·x + ((1−β)·g)·g`: an exponential moving average of squares.
    fn ema_sq(&self, x: Self::Buf, g: &Self::Buf, beta: f32) -> Self::Buf;

    /// The squared L2 norm of the buffer (the host sums in f64, a device in f32).
    fn squared_norm(&self, buf: &Self::Buf) -> Result<f64>;
    /// Per range, the L2 norm of the buffer there (0 for an empty range), in f32 (the host
    /// sums the squares in f64).
    fn norms(&self, buf: &Self::Buf, ranges: &[Range<usize>]) -> Result<Vec<f32>>;
    /// Per range, the largest of 0 and the buffer's values there.
    fn maxes(&self, buf: &Self::Buf, ranges: &[Range<usize>]) -> Result<Vec<f32>>;
    /// Each range of the buffer times its factor (`ranges` in order, covering the buffer).
    fn scale_ranges(&self, buf: Self::Buf, ranges: &[Range<usize>], f: &[f32]) -> Self::Buf;
    /// Each range of the buffer divided by its divisor (`ranges` in order, covering it).
    fn div_ranges(&self, buf: Self::Buf, ranges: &[Range<usize>], d: &[f32]) -> Self::Buf;
    /// `a + f_t·b` over each range `t` (`ranges` in order, covering the buffers).
    fn add_scaled_ranges(
        &self,
        a: Self::Buf,
        b: &Self::Buf,
        ranges: &[Range<usize>],
        f: &[f32],
    ) -> Self::Buf;

    /// Bytes read from the place into host memory for the per-range values and scalars so far
    /// (0 on the host and on Flex).
    fn host_reads(&self) -> u64;

    /// The buffer reduced over every rank by `op`. Collective.
    fn all_reduce(&self, buf: Self::Buf, op: ReduceOp) -> Result<Self::Buf>;

    /// Elements after padding `n` for a 1-bit compressed all-reduce over this world: every
    /// rank's chunk packs into whole units of the place's sign words.
    fn sign_padded_len(&self, n: usize) -> usize;
    /// The 1-bit compression of `x + error` (DeepSpeed's error feedback): its packed signs,
    /// its scale ‖x + error‖₂/√n, and the new error (what the compression left out).
    fn compress(&self, x: Self::Buf, error: Self::Buf) -> Result<(Self::Signs, f32, Self::Buf)>;
    /// Part `j` of `parts` equal parts of packed signs, unpacked to `len` values ±`scale`.
    fn unpack(
        &self,
        signs: &Self::Signs,
        j: usize,
        parts: usize,
        scale: f32,
        len: usize,
    ) -> Result<Self::Buf>;
    /// Sends part `j` of this rank's signs to rank `j` and returns the parts received, in
    /// rank order. Collective.
    fn all_to_all_signs(&self, signs: Self::Signs) -> Result<Self::Signs>;
    /// Every rank's signs, in rank order. Collective.
    fn all_gather_signs(&self, signs: Self::Signs) -> Result<Self::Signs>;
}
