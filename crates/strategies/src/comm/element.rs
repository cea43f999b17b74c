//! Element types a communicator moves, and the dtype-tagged buffers of the object-safe API.

use half::{bf16, f16};

use super::ReduceOp;

/// Data type of a communication buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// Brain float 16.
    BF16,
    /// Raw bytes (packed bits, quantized codes).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }
}

/// A read-only buffer of one of the supported element types.
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// bytes.
    U8(&'a [u8]),
}

/// A writable buffer of one of the supported element types.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
    /// bytes.
    U8(&'a mut [u8]),
}

impl Buf<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F16(_) => DType::F16,
            Buf::BF16(_) => DType::BF16,
            Buf::U8(_) => DType::U8,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(s) => s.len(),
            Buf::F16(s) => s.len(),
            Buf::BF16(s) => s.len(),
            Buf::U8(s) => s.len(),
        }
    }
    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes, native endian.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Buf::F32(s) => bytemuck::cast_slice(s),
            Buf::F16(s) => bytemuck::cast_slice(s),
            Buf::BF16(s) => bytemuck::cast_slice(s),
            Buf::U8(s) => s,
        }
    }
}

impl BufMut<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.as_buf().dtype()
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_buf().len()
    }
    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A read-only view.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(s) => Buf::F32(s),
            BufMut::F16(s) => Buf::F16(s),
            BufMut::BF16(s) => Buf::BF16(s),
            BufMut::U8(s) => Buf::U8(s),
        }
    }
    /// The raw bytes, native endian, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            BufMut::F32(s) => bytemuck::cast_slice_mut(s),
            BufMut::F16(s) => bytemuck::cast_slice_mut(s),
            BufMut::BF16(s) => bytemuck::cast_slice_mut(s),
            BufMut::U8(s) => s,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u8 {}
}

/// An element type the communicators support: f32, f16, bf16 and u8.
///
/// Reductions of 16-bit floats accumulate in f32 and round once; u8 sums wrap, as MPI's do.
pub trait CommElement: sealed::Sealed + bytemuck::Pod + Send + Sync + PartialOrd + 'static {
    /// The dtype tag.
    const DTYPE: DType;
    /// Wraps a slice as a dtype-tagged buffer.
    fn buf(s: &[Self]) -> Buf<'_>;
    /// Wraps a mutable slice as a dtype-tagged buffer.
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// Widens to f64 (for reductions and tests).
    fn to_f64(self) -> f64;
    /// Narrows from f64, rounding to nearest.
    fn from_f64(v: f64) -> Self;
    /// Reduces `inputs` (one slice per rank, in rank order) element-wise into `out`.
    ///
    /// Floats accumulate in f32 in rank order, so every rank that reduces the same inputs gets
    /// bit-identical results. `Mean` divides the sum by the number of inputs.
    fn reduce_into(inputs: &[&[Self]], out: &mut [Self], op: ReduceOp);
}

fn reduce_f32_like<T: Copy>(
    inputs: &[&[T]],
    out: &mut [T],
    op: ReduceOp,
    widen: impl Fn(T) -> f32,
    narrow: impl Fn(f32) -> T,
) {
    let n = inputs.len() as f32;
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = widen(inputs[0][i]);
        for input in &inputs[1..] {
            let v = widen(input[i]);
            match op {
                ReduceOp::Sum | ReduceOp::Mean => acc += v,
                ReduceOp::Max => acc = if v > acc || v.is_nan() { v } else { acc },
            }
        }
        if op == ReduceOp::Mean {
            acc /= n;
        }
        *o = narrow(acc);
    }
}

impl CommElement for f32 {
    const DTYPE: DType = DType::F32;
    fn buf(s: &[Self]) -> Buf<'_> {
        Buf::F32(s)
    }
    fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
        BufMut::F32(s)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn reduce_into(inputs: &[&[Self]], out: &mut [Self], op: ReduceOp) {
        reduce_f32_like(inputs, out, op, |v| v, |v| v);
    }
}

impl CommElement for f16 {
    const DTYPE: DType = DType::F16;
    fn buf(s: &[Self]) -> Buf<'_> {
        Buf::F16(s)
    }
    fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
        BufMut::F16(s)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn reduce_into(inputs: &[&[Self]], out: &mut [Self], op: ReduceOp) {
        reduce_f32_like(inputs, out, op, f16::to_f32, f16::from_f32);
    }
}

impl CommElement for bf16 {
    const DTYPE: DType = DType::BF16;
    fn buf(s: &[Self]) -> Buf<'_> {
        Buf::BF16(s)
    }
    fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
        BufMut::BF16(s)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn reduce_into(inputs: &[&[Self]], out: &mut [Self], op: ReduceOp) {
        reduce_f32_like(inputs, out, op, bf16::to_f32, bf16::from_f32);
    }
}

impl CommElement for u8 {
    const DTYPE: DType = DType::U8;
    fn buf(s: &[Self]) -> Buf<'_> {
        Buf::U8(s)
    }
    fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
        BufMut::U8(s)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v.round().clamp(0.0, 255.0) as u8
    }
    fn reduce_into(inputs: &[&[Self]], out: &mut [Self], op: ReduceOp) {
        let n = inputs.len() as u32;
        for (i, o) in out.iter_mut().enumerate() {
            let values = inputs.iter().map(|s| s[i] as u32);
            *o = match op {
                ReduceOp::Sum => values.fold(0u32, |a, v| a.wrapping_add(v)) as u8,
                ReduceOp::Mean => (values.sum::<u32>() / n) as u8,
                ReduceOp::Max => values.max().unwrap_or(0) as u8,
            };
        }
    }
}
