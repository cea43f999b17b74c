//! Quantized weights for inference: DeepSpeed-Inference's group-wise INT8 and INT4 weights
//! (asymmetric by default, as DeepSpeed's post-initialization quantization), stored packed
//! (INT4 two per byte) with one step and offset per group, and multiplied by the fused
//! dequantize-matmul ([`dequant_matmul`]) so that a weight is never whole in f32.
//!
//! A [`QuantizedMatrix`] replaces the weight of a linear layer (`y = x · W`) or an embedding
//! table (rows looked up). The tensor-parallel layers take one through their `quantized`
//! methods, so a model built from them (or whole, with [`TensorParallel::none`]) quantizes
//! its slices layer by layer: each rank holds Ψ/tp codes.
//!
//! [`TensorParallel::none`]: crate::tensor_parallel::TensorParallel::none

use std::sync::Arc;

use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::ext::QuantizedTensor;
use burn_deepspeed_cubecl_kernels::qmatmul::dequant_matmul;
pub use burn_deepspeed_cubecl_kernels::quantize::{Bits, Scheme};
use burn_deepspeed_cubecl_kernels::quantize::{Quantized, Quantizer};
use burn_deepspeed_cubecl_kernels::words::to_words;
use burn_deepspeed_strategies::device::host_resident;

use crate::{DeepSpeedError, Result};

/// The dtype a model serves in (DeepSpeed's `init_inference(dtype=...)`): f32, a 16-bit
/// float (every parameter cast), or INT8/INT4 weights (the matrices quantized; activations,
/// LayerNorms and biases in fp16, as DeepSpeed serves them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InferenceDtype {
    /// f32 throughout.
    F32,
    /// Every parameter in f16 (activations follow).
    F16,
    /// Every parameter in bf16.
    Bf16,
    /// Weight matrices in INT8 ([`WeightQuantization::int8`]).
    Int8,
    /// Weight matrices in INT4 ([`WeightQuantization::int4`]).
    Int4,
}

impl InferenceDtype {
    /// The names [`parse`](Self::parse) takes.
    pub const NAMES: [&'static str; 5] = ["fp32", "fp16", "bf16", "int8", "int4"];

    /// The dtype named `name`: `fp32`, `fp16`, `bf16`, `int8` or `int4` (also `float32`,
    /// `float16`, `half`, `bfloat16`, as DeepSpeed's torch dtypes are spelled).
    ///
    /// # Errors
    /// For any other name, listing these.
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "fp32" | "float32" | "float" | "f32" => Self::F32,
            "fp16" | "float16" | "half" | "f16" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            "int8" => Self::Int8,
            "int4" => Self::Int4,
            _ => {
                return Err(DeepSpeedError::Data(format!(
                    "unknown inference dtype `{name}`: expected one of {}",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }

    /// The float dtype the model computes in and keeps its unquantized parameters in (layer
    /// norms, biases), `None` for fp32. INT8 and INT4 run in fp16 around their quantized
    /// matrices, as DeepSpeed's INT8 inference does.
    pub fn float(self) -> Option<FloatDType> {
        match self {
            Self::F16 | Self::Int8 | Self::Int4 => Some(FloatDType::F16),
            Self::Bf16 => Some(FloatDType::BF16),
            _ => None,
        }
    }

    /// The weight quantization (INT8 and INT4 only), with its default groups.
    pub fn quantization(self) -> Option<WeightQuantization> {
        match self {
            Self::Int8 => Some(WeightQuantization::int8()),
            Self::Int4 => Some(WeightQuantization::int4()),
            _ => None,
        }
    }
}

impl std::fmt::Display for InferenceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Bf16 => 2,
            Self::Int8 => 3,
            Self::Int4 => 4,
        };
        f.write_str(Self::NAMES[i])
    }
}

/// How weights are quantized: code width, scheme, and values per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightQuantization {
    /// 8 or 4 bits per code.
    pub bits: Bits,
    /// Symmetric (a step per group) or asymmetric (a step and an offset).
    pub scheme: Scheme,
    /// The largest group: a weight's groups run along its rows (its output features) and
    /// take the largest size up to this that divides a row (even for INT4), or whole rows
    /// when a row fits (`usize::MAX`: one group per matrix), so that no group straddles a
    /// row boundary.
    pub group: usize,
}

impl WeightQuantization {
    /// INT8, symmetric (as DeepSpeed-Inference's INT8 kernels), groups of up to 512 values
    /// (a step per group: under 1% over one byte per weight).
    pub fn int8() -> Self {
        Self {
            bits: Bits::Int8,
            scheme: Scheme::Symmetric,
            group: 512,
        }
    }

    /// INT4, asymmetric (as DeepSpeed's post-initialization quantization), groups of 64
    /// values (two codes per byte).
    pub fn int4() -> Self {
        Self {
            bits: Bits::Int4,
            scheme: Scheme::Asymmetric,
            group: 64,
        }
    }

    /// The same with groups of up to `group` values.
    pub fn with_group(mut self, group: usize) -> Self {
        self.group = group;
        self
    }

    /// The same under `scheme`.
    pub fn with_scheme(mut self, scheme: Scheme) -> Self {
        self.scheme = scheme;
        self
    }

    /// The quantizer for a `[rows, cols]` matrix: groups of whole rows when
    /// [`group`](Self::group) holds a row (the most rows up to it that divide the matrix;
    /// every row of the matrix in one group is per-tensor quantization), else the largest
    /// part of a row up to it that divides the row (even for INT4). No group straddles a row
    /// boundary.
    fn quantizer_for(&self, rows: usize, cols: usize) -> Result<Quantizer> {
        let even = self.bits == Bits::Int4;
        let fits = |g: usize| !even || g.is_multiple_of(2);
        let group = if self.group >= cols && cols > 0 {
            (1..=(self.group / cols).min(rows.max(1)))
                .rev()
                .find(|r| rows.is_multiple_of(*r) && fits(r * cols))
                .map(|r| r * cols)
        } else {
            (1..=self.group.min(cols))
                .rev()
                .find(|g| cols.is_multiple_of(*g) && fits(*g))
        };
        let group = group.ok_or_else(|| {
            DeepSpeedError::Data(format!(
                "rows of {cols} values have no {} group of at most {} values",
                if even { "even" } else { "whole" },
                self.group
            ))
        })?;
        Quantizer::new(self.bits, self.scheme, group)
            .map_err(|e| DeepSpeedError::Data(e.to_string()))
    }
}

/// A `[rows, cols]` matrix stored quantized, group-wise along its rows: in host memory, or
/// (after [`on`](Self::on) a wgpu or CUDA device) as tensors of that device.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    values: Codes,
    rows: usize,
    cols: usize,
    /// The weight's dtype: rows looked up come back in it.
    dtype: DType,
}

/// Where a [`QuantizedMatrix`]'s codes, steps and offsets live.
#[derive(Debug, Clone)]
enum Codes {
    /// Host memory: the CPU's fused dequantize-matmul reads them.
    Host(Arc<Quantized>),
    /// A device's tensors (u32 code words, f32 steps and offsets): the CubeCL kernel
    /// dequantizes them as it loads them.
    Device(Arc<QuantizedTensor>),
}

impl QuantizedMatrix {
    /// `weight` quantized under `how` (in host memory: see [`on`](Self::on)).
    ///
    /// # Errors
    /// When no group fits a row (see [`WeightQuantization::group`]).
    pub fn quantize(weight: &Tensor<2>, how: &WeightQuantization) -> Result<Self> {
        let [rows, cols] = weight.dims();
        let quantizer = how.quantizer_for(rows, cols)?;
        let values = host_f32(weight.clone());
        Ok(Self {
            values: Codes::Host(Arc::new(quantizer.quantize(&values))),
            rows,
            cols,
            dtype: weight.dtype(),
        })
    }

    /// Rows and columns.
    pub fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// The matrix with its codes on `device` when that is not host memory (wgpu, CUDA), so
    /// that [`matmul`](Self::matmul) runs the CubeCL kernel there (the weight dequantized as
    /// it is loaded) and the host copy is dropped; unchanged on Flex. For a layer's weight:
    /// an embedding table keeps its host codes ([`rows`](Self::rows) reads a few of them).
    pub fn on(self, device: &Device) -> Self {
        let Codes::Host(host) = &self.values else {
            return self;
        };
        if host_resident(device) {
            return self;
        }
        let q = &**host;
        let groups = q.steps.len();
        let offsets = match q.offsets.is_empty() {
            true => vec![0.0; groups],
            false => q.offsets.clone(),
        };
        let floats = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [groups]), device);
        let words = to_words(&q.codes);
        let n = words.len();
        let codes = Tensor::<1, Int>::from_data(TensorData::new(words, [n]), (device, DType::U32));
        let values = Codes::Device(Arc::new(QuantizedTensor {
            quantizer: q.quantizer,
            len: q.len,
            codes,
            steps: floats(q.steps.clone()),
            offsets: floats(offsets),
        }));
        Self { values, ..self }
    }

    /// The quantizer that holds the values (its group is the one the rows took).
    pub fn quantizer(&self) -> Quantizer {
        match &self.values {
            Codes::Host(q) => q.quantizer,
            Codes::Device(q) => q.quantizer,
        }
    }

    /// Bytes held: the codes, and each group's step and offset (on a device, the offsets of
    /// a symmetric matrix too: zeros, which the kernel adds).
    pub fn bytes(&self) -> u64 {
        match &self.values {
            Codes::Host(q) => q.bytes() as u64,
            Codes::Device(q) => {
                let n = |t: usize| t as u64 * 4;
                n(q.codes.shape().num_elements())
                    + n(q.steps.shape().num_elements())
                    + n(q.offsets.shape().num_elements())
            }
        }
    }

    /// The matrix in f32 (for checks: inference never makes it).
    pub fn dequantize(&self, device: &Device) -> Tensor<2> {
        match &self.values {
            Codes::Host(q) => {
                let data = TensorData::new(q.dequantize(), [self.rows, self.cols]);
                Tensor::from_data(data, device)
            }
            Codes::Device(q) => q
                .dequantize()
                .expect("the tensors were built together")
                .reshape([self.rows, self.cols])
                .to_device(device),
        }
    }

    /// `x · W` for `x` `[..., rows]`: `[..., cols]`, by the fused dequantize-matmul: the
    /// CPU's for host codes, the CubeCL kernel on the device's for codes [`on`](Self::on) a
    /// device; `x` keeps its device and dtype.
    ///
    /// # Panics
    /// When `x`'s last dimension is not the matrix's rows.
    pub fn matmul<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mut dims = x.dims();
        assert_eq!(
            dims[D - 1],
            self.rows,
            "a [.., {}] input times a quantized [{}, {}] weight",
            dims[D - 1],
            self.rows,
            self.cols
        );
        let (device, dtype) = (x.device(), x.dtype());
        let m = dims[..D - 1].iter().product();
        let host = match &self.values {
            Codes::Host(q) => q,
            Codes::Device(q) => {
                let x2 = x.reshape([m, self.rows]).cast(FloatDType::F32);
                dims[D - 1] = self.cols;
                return q
                    .matmul(x2, self.cols)
                    .expect("the shapes were checked")
                    .reshape(dims)
                    .cast(dtype);
            }
        };
        let xs = host_f32(x);
        let mut out = vec![0.0f32; m * self.cols];
        dequant_matmul(&xs, m, host, self.rows, self.cols, &mut out)
            .expect("the shapes were checked");
        dims[D - 1] = self.cols;
        Tensor::<D>::from_data(TensorData::new(out, dims), &device).cast(dtype)
    }

    /// The rows `ids` `[batch, t]` name, dequantized: `[batch, t, cols]` (an embedding
    /// lookup), in the weight's dtype on `ids`' device. Host codes dequantize only those rows;
    /// codes on a device dequantize the whole matrix first (keep tables on the host).
    ///
    /// # Panics
    /// When an id is not a row.
    pub fn rows(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let device = ids.device();
        let host = match &self.values {
            Codes::Host(q) => q,
            Codes::Device(_) => {
                let flat = ids.reshape([b * t]);
                let rows = self.dequantize(&device).select(0, flat);
                return rows.reshape([b, t, self.cols]).cast(self.dtype);
            }
        };
        let ids = ids
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .expect("i64 ids");
        let mut out = vec![0.0f32; ids.len() * self.cols];
        for (&id, row) in ids.iter().zip(out.chunks_mut(self.cols)) {
            let id = usize::try_from(id)
                .ok()
                .filter(|&i| i < self.rows)
                .unwrap_or_else(|| panic!("id {id} of a table of {} rows", self.rows));
            host.dequantize_range_into(id * self.cols, row);
        }
        Tensor::<3>::from_data(TensorData::new(out, [b, t, self.cols]), &device).cast(self.dtype)
    }
}

/// The values of `x` in f32 on the host.
fn host_f32<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    x.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("converted to f32")
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution};

    use super::*;

    fn max_rel(a: &Tensor<3>, b: &Tensor<3>) -> f32 {
        let (a, b) = (host_f32(a.clone()), host_f32(b.clone()));
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    }

    /// The quantized product equals x times the dequantized weight, and is close to x · W
    /// (INT8 tighter than INT4).
    #[test]
    fn matmul_is_x_times_the_dequantized_weight() {
        let device = Device::flex();
        // Seeded values (Burn's global generator is shared with the tests running beside
        // this one): w ~ N(0, 0.05) by Box-Muller, x ~ U[0, 1).
        let mut state = 11u64;
        let mut uniform = || crate::inference::splitmix_uniform(&mut state);
        let normal: Vec<f32> = (0..96 * 192)
            .map(|_| {
                let (a, b) = (uniform().max(f64::MIN_POSITIVE), uniform());
                ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos() * 0.05) as f32
            })
            .collect();
        let w = Tensor::<2>::from_data(TensorData::new(normal, [96, 192]), &device);
        let xs: Vec<f32> = (0..2 * 3 * 96).map(|_| uniform() as f32).collect();
        let x = Tensor::<3>::from_data(TensorData::new(xs, [2, 3, 96]), &device);
        let exact = x.clone().matmul(w.clone().unsqueeze());
        for (how, bound) in [
            (WeightQuantization::int8(), 0.01),
            (WeightQuantization::int4(), 0.2),
        ] {
            let q = QuantizedMatrix::quantize(&w, &how).expect("quantizes");
            // 192 values per row: INT8 takes two rows (384, up to 512), INT4 a third of one.
            let group = q.quantizer().group();
            assert_eq!(group, if how.bits == Bits::Int8 { 384 } else { 64 });
            let y = q.matmul(x.clone());
            let via = x.clone().matmul(q.dequantize(&device).unsqueeze());
            assert!(max_rel(&y, &via) < 1e-5, "{how:?}: {}", max_rel(&y, &via));
            let err = max_rel(&y, &exact);
            println!("{how:?}: max relative error {err}");
            assert!(err < bound && err > 0.0, "{how:?}: {err}");
        }
    }

    /// On wgpu the codes move to the device and the CubeCL kernel multiplies: the product
    /// equals the host path's on the same codes within 1e-5, the bytes are the device's
    /// (symmetric INT8's zero offsets included), and a table on the device still looks up.
    #[cfg(feature = "wgpu")]
    #[test]
    fn codes_on_a_wgpu_device_multiply_there_like_the_host_path() {
        let flex = Device::flex();
        let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
        let w = Tensor::<2>::random([96, 192], Distribution::Normal(0.0, 0.05), &flex);
        let x = Tensor::<3>::random([2, 3, 96], Distribution::Default, &flex);
        for how in [WeightQuantization::int8(), WeightQuantization::int4()] {
            let host = QuantizedMatrix::quantize(&w, &how).expect("quantizes");
            let on = QuantizedMatrix::quantize(&w.clone().to_device(&wgpu), &how)
                .expect("quantizes")
                .on(&wgpu);
            assert!(matches!(on.values, Codes::Device(_)), "{how:?}: moved");
            assert!(matches!(host.clone().on(&flex).values, Codes::Host(_)));
            let y = on.matmul(x.clone().to_device(&wgpu));
            assert_eq!(y.device(), wgpu);
            let err = max_rel(&y.to_device(&flex), &host.matmul(x.clone()));
            assert!(err < 1e-5, "{how:?}: {err}");
            let groups = (96 * 192usize).div_ceil(host.quantizer().group()) as u64;
            let codes = (96 * 192 / if how.bits == Bits::Int8 { 1 } else { 2 }) as u64;
            assert_eq!(on.bytes(), codes + 8 * groups, "{how:?}");
            let ids = Tensor::<2, Int>::from_data([[3, 0], [95, 7]], &wgpu);
            let rows = on.rows(ids.clone());
            let want = host.rows(ids.to_device(&flex));
            assert!(
                max_rel(&rows.to_device(&flex), &want) < 1e-6,
                "{how:?}: rows"
            );
        }
    }

    #[test]
    fn rows_are_the_dequantized_tables_rows() {
        let device = Device::flex();
        let w = Tensor::<2>::random([10, 16], Distribution::Default, &device);
        let q = QuantizedMatrix::quantize(&w, &WeightQuantization::int4().with_group(8))
            .expect("quantizes");
        let ids =
            Tensor::<2, Int>::from_data(TensorData::new(vec![3i64, 0, 9, 3], [2, 2]), &device);
        let got = q.rows(ids.clone());
        let want = burn::tensor::module::embedding(q.dequantize(&device), ids);
        assert_eq!(max_rel(&got, &want), 0.0);
        // Two codes per byte, and a step and an offset per group of 8.
        assert_eq!(q.bytes(), 160 / 2 + 20 * 8);
    }

    #[test]
    fn dtype_names_parse_and_print() {
        for name in InferenceDtype::NAMES {
            let dtype = InferenceDtype::parse(name).expect("a name");
            assert_eq!(dtype.to_string(), name);
        }
        assert_eq!(
            InferenceDtype::parse("Half").ok(),
            Some(InferenceDtype::F16)
        );
        let e = InferenceDtype::parse("int3").expect_err("no such dtype");
        assert!(
            e.to_string().contains("`int3`") && e.to_string().contains("int4"),
            "{e}"
        );
    }

    #[test]
    fn groups_hold_parts_of_rows_or_whole_rows() {
        let group = |how: WeightQuantization, rows, cols| {
            how.quantizer_for(rows, cols).expect("a group").group()
        };
        let int8 = WeightQuantization::int8();
        assert_eq!(group(int8, 256, 768), 384);
        assert_eq!(group(int8, 256, 192), 384);
        assert_eq!(group(int8, 12, 256), 512);
        assert_eq!(group(int8.with_group(usize::MAX), 12, 256), 12 * 256);
        assert_eq!(group(int8.with_group(1000), 12, 256), 3 * 256);
        assert_eq!(group(WeightQuantization::int4(), 8, 96), 48);
    }

    #[test]
    fn rows_without_a_group_are_refused() {
        // int4 needs even groups: rows of 7, three of them.
        let w = Tensor::<2>::zeros([3, 7], &Device::flex());
        let e = QuantizedMatrix::quantize(&w, &WeightQuantization::int4()).expect_err("odd rows");
        assert!(e.to_string().contains("rows of 7 values"), "{e}");
    }
}
