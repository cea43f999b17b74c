//! The fused ops on Burn tensors: a `#[backend_extension]` whose `Flex` arm runs the CPU
//! path and whose `Cube` arm (features `wgpu` / `cuda`) launches the CubeCL kernels of
//! `crate::cube` on the tensors' own device buffers. Autodiff tensors are stepped through
//! their inner values: an optimizer step is not part of the graph.
//!
//! The functions at the bottom are the API: they take and return [`Tensor`]s and check
//! their arguments (dtypes, lengths) with a [`KernelError`].

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend, DType, Flex, backend_extension};
use burn::tensor::{Int, Tensor, TensorData};

use crate::KernelError;
use crate::adam::AdamParams;
use crate::lamb::LambParams;
use crate::quantize::{Quantized, Quantizer, Scheme};
use crate::words::{to_bytes, to_words};

/// Fused optimizer and compression ops on a backend's primitives. Use the functions of this
/// module rather than these methods.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait FusedOps: Backend {
    /// One Adam/AdamW step; returns the new (p, m, v).
    fn fused_adam(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: AdamParams,
        step: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// One LAMB step on a whole tensor; returns the new (p, m, v).
    fn fused_lamb(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: LambParams,
        step: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Group-wise quantization of a flat f32 tensor: (code words, steps, offsets).
    fn quantize_groups(
        x: FloatTensor<Self>,
        quantizer: Quantizer,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The `len` values of quantized code words.
    fn dequantize_groups(
        codes: IntTensor<Self>,
        steps: FloatTensor<Self>,
        offsets: FloatTensor<Self>,
        quantizer: Quantizer,
        len: usize,
    ) -> FloatTensor<Self>;

    /// `x · W` (`[m, n]`) for an f32 `x` `[m, k]` and a quantized `[k, n]` weight in code
    /// words, dequantized as it is loaded.
    #[allow(clippy::too_many_arguments)]
    fn dequant_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        steps: FloatTensor<Self>,
        offsets: FloatTensor<Self>,
        quantizer: Quantizer,
        k: usize,
        n: usize,
    ) -> FloatTensor<Self>;

    /// Error-feedback 1-bit compression: (sign words, scale `[1]`, new error).
    fn onebit_compress(
        x: FloatTensor<Self>,
        error: FloatTensor<Self>,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `len` values of ±`scale` from sign words.
    fn unpack_signs(packed: IntTensor<Self>, scale: f32, len: usize) -> FloatTensor<Self>;
}

/// The Flex arm: the CPU path on the tensors' storage.
mod flex {
    use burn::backend::flex::FlexTensor;

    use super::*;
    use crate::adam::{ParamElement, adam_step};
    use crate::{lamb, sign};

    /// Whether the storage is exactly the values, in order.
    fn exact(t: &FlexTensor) -> bool {
        let n = t.layout().num_elements();
        t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == n * t.dtype().size()
    }

    /// A tensor to read: its storage exactly its values (copied only when strided).
    fn contiguous(t: FlexTensor) -> FlexTensor {
        if exact(&t) {
            t
        } else {
            FlexTensor::from_data(t.into_data())
        }
    }

    /// A tensor to update in place: also owned by it alone (copied when shared, so that
    /// other holders never see the update).
    fn owned(t: FlexTensor) -> FlexTensor {
        if exact(&t) && t.is_unique() {
            t
        } else {
            FlexTensor::from_data(t.into_data())
        }
    }

    fn adam_typed<P: ParamElement + burn::tensor::Element + bytemuck::Pod>(
        p: &mut FlexTensor,
        g: &FlexTensor,
        m: &mut FlexTensor,
        v: &mut FlexTensor,
        h: &AdamParams,
        step: u32,
    ) {
        let (m, v) = (m.storage_mut::<f32>(), v.storage_mut::<f32>());
        adam_step::<P>(h, step, p.storage_mut::<P>(), g.storage::<P>(), m, v);
    }

    impl FusedOps for Flex {
        fn fused_adam(
            p: FlexTensor,
            g: FlexTensor,
            m: FlexTensor,
            v: FlexTensor,
            params: AdamParams,
            step: u32,
        ) -> (FlexTensor, FlexTensor, FlexTensor) {
            let (mut p, g, mut m, mut v) = (owned(p), contiguous(g), owned(m), owned(v));
            match p.dtype() {
                DType::F32 => adam_typed::<f32>(&mut p, &g, &mut m, &mut v, &params, step),
                DType::BF16 => adam_typed::<half::bf16>(&mut p, &g, &mut m, &mut v, &params, step),
                DType::F16 => adam_typed::<half::f16>(&mut p, &g, &mut m, &mut v, &params, step),
                other => unreachable!("checked by fused_adam: {other:?}"),
            }
            (p, m, v)
        }

        fn fused_lamb(
            p: FlexTensor,
            g: FlexTensor,
            m: FlexTensor,
            v: FlexTensor,
            params: LambParams,
            step: u32,
        ) -> (FlexTensor, FlexTensor, FlexTensor) {
            let (mut p, g, mut m, mut v) = (owned(p), contiguous(g), owned(m), owned(v));
            lamb::lamb_step(
                &params,
                step,
                p.storage_mut::<f32>(),
                g.storage::<f32>(),
                m.storage_mut::<f32>(),
                v.storage_mut::<f32>(),
            );
            (p, m, v)
        }

        fn quantize_groups(
            x: FlexTensor,
            quantizer: Quantizer,
        ) -> (FlexTensor, FlexTensor, FlexTensor) {
            let x = contiguous(x);
            let q = quantizer.quantize(x.storage::<f32>());
            let groups = q.steps.len();
            let offsets = if q.offsets.is_empty() {
                vec![0.0; groups]
            } else {
                q.offsets
            };
            let words = to_words(&q.codes);
            let nw = words.len();
            (
                FlexTensor::from_data(TensorData::new(words, [nw])),
                FlexTensor::from_data(TensorData::new(q.steps, [groups])),
                FlexTensor::from_data(TensorData::new(offsets, [groups])),
            )
        }

        fn dequantize_groups(
            codes: FlexTensor,
            steps: FlexTensor,
            offsets: FlexTensor,
            quantizer: Quantizer,
            len: usize,
        ) -> FlexTensor {
            let (codes, steps, offsets) =
                (contiguous(codes), contiguous(steps), contiguous(offsets));
            let q = host_quantized(
                quantizer,
                len,
                codes.storage::<u32>(),
                steps.storage::<f32>(),
                offsets.storage::<f32>(),
            );
            FlexTensor::from_data(TensorData::new(q.dequantize(), [len]))
        }

        fn dequant_matmul(
            x: FlexTensor,
            codes: FlexTensor,
            steps: FlexTensor,
            offsets: FlexTensor,
            quantizer: Quantizer,
            k: usize,
            n: usize,
        ) -> FlexTensor {
            let (x, codes) = (contiguous(x), contiguous(codes));
            let (steps, offsets) = (contiguous(steps), contiguous(offsets));
            let w = host_quantized(
                quantizer,
                k * n,
                codes.storage::<u32>(),
                steps.storage::<f32>(),
                offsets.storage::<f32>(),
            );
            let m = x.layout().num_elements() / k.max(1);
            let mut out = vec![0.0f32; m * n];
            crate::qmatmul::dequant_matmul(x.storage::<f32>(), m, &w, k, n, &mut out)
                .unwrap_or_else(|e| panic!("{e} (after the tensor checks; a bug in this crate)"));
            FlexTensor::from_data(TensorData::new(out, [m, n]))
        }

        fn onebit_compress(
            x: FlexTensor,
            error: FlexTensor,
        ) -> (FlexTensor, FlexTensor, FlexTensor) {
            let (x, mut error) = (contiguous(x), owned(error));
            let n = x.layout().num_elements();
            let mut packed = vec![0u8; sign::packed_len(n)];
            let scale =
                sign::onebit_compress(x.storage::<f32>(), error.storage_mut::<f32>(), &mut packed);
            let words = to_words(&packed);
            let nw = words.len();
            (
                FlexTensor::from_data(TensorData::new(words, [nw])),
                FlexTensor::from_data(TensorData::new(vec![scale], [1])),
                error,
            )
        }

        fn unpack_signs(packed: FlexTensor, scale: f32, len: usize) -> FlexTensor {
            let packed = contiguous(packed);
            let bytes = to_bytes(packed.storage::<u32>(), sign::packed_len(len));
            let mut out = vec![0.0f32; len];
            sign::unpack_signs(&bytes, scale, &mut out);
            FlexTensor::from_data(TensorData::new(out, [len]))
        }
    }
}

/// The CPU form of quantized values held as code words.
fn host_quantized(
    quantizer: Quantizer,
    len: usize,
    words: &[u32],
    steps: &[f32],
    offsets: &[f32],
) -> Quantized {
    Quantized {
        quantizer,
        len,
        codes: to_bytes(words, quantizer.bits().bytes_for(len)),
        steps: steps.to_vec(),
        offsets: if quantizer.scheme() == Scheme::Symmetric {
            Vec::new()
        } else {
            offsets.to_vec()
        },
    }
}

/// The Cube arm: the CubeCL kernels on the tensors' buffers.
#[cfg(feature = "cube")]
mod cube {
    use burn::backend::{Cube, TensorMetadata};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;

    use super::*;
    use crate::cube::{adam, lamb, qmatmul, quantize, sign};

    /// Contiguous and owned alone, so that a kernel may write it in place.
    fn owned(t: CubeTensor) -> CubeTensor {
        let t = into_contiguous(t);
        if t.can_mut() && t.is_contiguous_buffer() {
            t
        } else {
            t.copy()
        }
    }

    /// A kernel's result after the public function checked its arguments: the buffers are
    /// the tensors' own, of the sizes their shapes give.
    fn checked<T>(result: Result<T, KernelError>) -> T {
        result.unwrap_or_else(|e| panic!("{e} (after the tensor checks; a bug in this crate)"))
    }

    fn len(t: &CubeTensor) -> usize {
        t.shape().num_elements()
    }

    fn new_like(
        t: &CubeTensor,
        handle: cubecl::server::Handle,
        n: usize,
        dtype: DType,
    ) -> CubeTensor {
        CubeTensor::new_contiguous(
            t.client.clone(),
            t.device.clone(),
            [n].into(),
            handle,
            dtype,
        )
    }

    impl FusedOps for Cube {
        fn fused_adam(
            p: CubeTensor,
            g: CubeTensor,
            m: CubeTensor,
            v: CubeTensor,
            params: AdamParams,
            step: u32,
        ) -> (CubeTensor, CubeTensor, CubeTensor) {
            let (p, g, m, v) = (owned(p), into_contiguous(g), owned(m), owned(v));
            let n = len(&p);
            let handles = [&p.handle, &g.handle, &m.handle, &v.handle];
            let client = &p.client;
            let launched = match p.dtype {
                DType::F32 => adam::adam_step::<f32>(client, &params, step, n, handles),
                DType::BF16 => adam::adam_step::<half::bf16>(client, &params, step, n, handles),
                DType::F16 => adam::adam_step::<half::f16>(client, &params, step, n, handles),
                other => unreachable!("checked by fused_adam: {other:?}"),
            };
            checked(launched);
            (p, m, v)
        }

        fn fused_lamb(
            p: CubeTensor,
            g: CubeTensor,
            m: CubeTensor,
            v: CubeTensor,
            params: LambParams,
            step: u32,
        ) -> (CubeTensor, CubeTensor, CubeTensor) {
            let (p, g, m, v) = (owned(p), into_contiguous(g), owned(m), owned(v));
            let n = len(&p);
            checked(lamb::lamb_step(
                &p.client,
                &params,
                step,
                n,
                [&p.handle, &g.handle, &m.handle, &v.handle],
            ));
            (p, m, v)
        }

        fn quantize_groups(
            x: CubeTensor,
            quantizer: Quantizer,
        ) -> (CubeTensor, CubeTensor, CubeTensor) {
            let x = into_contiguous(x);
            let n = len(&x);
            let q = checked(quantize::quantize(&x.client, &quantizer, &x.handle, n));
            let groups = n.div_ceil(quantizer.group());
            let (codes, steps, offsets) = q.into_parts();
            (
                new_like(&x, codes, quantizer.bits().words_for(n), DType::U32),
                new_like(&x, steps, groups, DType::F32),
                new_like(&x, offsets, groups, DType::F32),
            )
        }

        fn dequantize_groups(
            codes: CubeTensor,
            steps: CubeTensor,
            offsets: CubeTensor,
            quantizer: Quantizer,
            len: usize,
        ) -> CubeTensor {
            let codes = into_contiguous(codes);
            let q = checked(quantize::DeviceQuantized::from_parts(
                quantizer,
                len,
                codes.handle.clone(),
                into_contiguous(steps).handle,
                into_contiguous(offsets).handle,
            ));
            let out = q.dequantize(&codes.client);
            new_like(&codes, out, len, DType::F32)
        }

        fn dequant_matmul(
            x: CubeTensor,
            codes: CubeTensor,
            steps: CubeTensor,
            offsets: CubeTensor,
            quantizer: Quantizer,
            k: usize,
            n: usize,
        ) -> CubeTensor {
            let x = into_contiguous(x);
            let w = checked(quantize::DeviceQuantized::from_parts(
                quantizer,
                k * n,
                into_contiguous(codes).handle,
                into_contiguous(steps).handle,
                into_contiguous(offsets).handle,
            ));
            let m = len(&x) / k.max(1);
            let out = checked(qmatmul::dequant_matmul(&x.client, &x.handle, m, &w, k, n));
            CubeTensor::new_contiguous(
                x.client.clone(),
                x.device.clone(),
                [m, n].into(),
                out,
                DType::F32,
            )
        }

        fn onebit_compress(
            x: CubeTensor,
            error: CubeTensor,
        ) -> (CubeTensor, CubeTensor, CubeTensor) {
            let (x, error) = (into_contiguous(x), owned(error));
            let n = len(&x);
            let nw = sign::sign_words(n);
            let packed = x.client.empty(nw.max(1) * 4);
            let scale = checked(sign::onebit_compress(
                &x.client,
                n,
                &x.handle,
                &error.handle,
                &packed,
            ));
            let scale = crate::cube::upload(&x.client, &[scale]);
            (
                new_like(&x, packed, nw, DType::U32),
                new_like(&x, scale, 1, DType::F32),
                error,
            )
        }

        fn unpack_signs(packed: CubeTensor, scale: f32, len: usize) -> CubeTensor {
            let packed = into_contiguous(packed);
            let out = packed.client.empty(len.max(1) * 4);
            checked(sign::unpack_signs(
                &packed.client,
                len,
                &packed.handle,
                scale,
                &out,
            ));
            new_like(&packed, out, len, DType::F32)
        }
    }
}

/// An optimizer step's (p, m, v) as untracked autodiff tensors.
#[allow(clippy::type_complexity)]
fn lift<B: Backend, C: CheckpointStrategy>(
    (p, m, v): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
) -> (
    FloatTensor<Autodiff<B, C>>,
    FloatTensor<Autodiff<B, C>>,
    FloatTensor<Autodiff<B, C>>,
) {
    type A<B, C> = Autodiff<B, C>;
    (
        A::<B, C>::from_inner(p),
        A::<B, C>::from_inner(m),
        A::<B, C>::from_inner(v),
    )
}

/// Autodiff tensors: the op on their inner values, returned as untracked tensors.
impl<B: Backend + FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn fused_adam(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: AdamParams,
        step: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        lift::<B, C>(B::fused_adam(
            Self::inner(p),
            Self::inner(g),
            Self::inner(m),
            Self::inner(v),
            params,
            step,
        ))
    }

    fn fused_lamb(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: LambParams,
        step: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        lift::<B, C>(B::fused_lamb(
            Self::inner(p),
            Self::inner(g),
            Self::inner(m),
            Self::inner(v),
            params,
            step,
        ))
    }

    fn quantize_groups(
        x: FloatTensor<Self>,
        quantizer: Quantizer,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (c, s, o) = B::quantize_groups(Self::inner(x), quantizer);
        (c, Self::from_inner(s), Self::from_inner(o))
    }

    fn dequantize_groups(
        codes: IntTensor<Self>,
        steps: FloatTensor<Self>,
        offsets: FloatTensor<Self>,
        quantizer: Quantizer,
        len: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::dequantize_groups(
            codes,
            Self::inner(steps),
            Self::inner(offsets),
            quantizer,
            len,
        ))
    }

    /// Inference: the product is a constant of the graph (no gradient flows to `x`).
    fn dequant_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        steps: FloatTensor<Self>,
        offsets: FloatTensor<Self>,
        quantizer: Quantizer,
        k: usize,
        n: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::dequant_matmul(
            Self::inner(x),
            codes,
            Self::inner(steps),
            Self::inner(offsets),
            quantizer,
            k,
            n,
        ))
    }

    fn onebit_compress(
        x: FloatTensor<Self>,
        error: FloatTensor<Self>,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (w, s, e) = B::onebit_compress(Self::inner(x), Self::inner(error));
        (w, Self::from_inner(s), Self::from_inner(e))
    }

    fn unpack_signs(packed: IntTensor<Self>, scale: f32, len: usize) -> FloatTensor<Self> {
        Self::from_inner(B::unpack_signs(packed, scale, len))
    }
}

use burn::backend::Dispatch;

fn check(ok: bool, op: &'static str, detail: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(KernelError::Arguments {
            op,
            detail: detail(),
        })
    }
}

/// One fused Adam/AdamW step (the `step`-th, from 1) on a parameter tensor: `p` and `g` in
/// f32, bf16 or f16, the moments `m` and `v` in f32, all of one shape. Returns the new
/// (p, m, v); the inputs' buffers are reused when nothing else holds them.
///
/// # Errors
/// [`KernelError::Arguments`] on other dtypes or differing shapes.
#[allow(clippy::type_complexity)]
pub fn fused_adam<const D: usize>(
    p: Tensor<D>,
    g: Tensor<D>,
    m: Tensor<D>,
    v: Tensor<D>,
    params: &AdamParams,
    step: u32,
) -> Result<(Tensor<D>, Tensor<D>, Tensor<D>), KernelError> {
    let shape = p.shape();
    check(
        [&g, &m, &v].iter().all(|t| t.shape() == shape),
        "fused_adam",
        || {
            format!(
                "shapes p {:?}, g {:?}, m {:?}, v {:?}",
                shape,
                g.shape(),
                m.shape(),
                v.shape()
            )
        },
    )?;
    let dtype = p.dtype();
    check(
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && g.dtype() == dtype,
        "fused_adam",
        || {
            format!(
                "p and g must share f32, bf16 or f16; got {dtype:?} and {:?}",
                g.dtype()
            )
        },
    )?;
    check(
        m.dtype() == DType::F32 && v.dtype() == DType::F32,
        "fused_adam",
        || {
            format!(
                "moments must be f32; got {:?} and {:?}",
                m.dtype(),
                v.dtype()
            )
        },
    )?;
    let (p, m, v) = <Dispatch as FusedOps>::fused_adam(
        p.into_dispatch(),
        g.into_dispatch(),
        m.into_dispatch(),
        v.into_dispatch(),
        *params,
        step,
    );
    Ok((
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    ))
}

/// One fused LAMB step on a whole f32 tensor; returns the new (p, m, v).
///
/// # Errors
/// [`KernelError::Arguments`] on a dtype other than f32 or differing shapes.
#[allow(clippy::type_complexity)]
pub fn fused_lamb<const D: usize>(
    p: Tensor<D>,
    g: Tensor<D>,
    m: Tensor<D>,
    v: Tensor<D>,
    params: &LambParams,
    step: u32,
) -> Result<(Tensor<D>, Tensor<D>, Tensor<D>), KernelError> {
    let shape = p.shape();
    check(
        [&g, &m, &v].iter().all(|t| t.shape() == shape),
        "fused_lamb",
        || {
            format!(
                "shapes p {:?}, g {:?}, m {:?}, v {:?}",
                shape,
                g.shape(),
                m.shape(),
                v.shape()
            )
        },
    )?;
    check(
        [&p, &g, &m, &v].iter().all(|t| t.dtype() == DType::F32),
        "fused_lamb",
        || "p, g, m and v must be f32".to_string(),
    )?;
    let (p, m, v) = <Dispatch as FusedOps>::fused_lamb(
        p.into_dispatch(),
        g.into_dispatch(),
        m.into_dispatch(),
        v.into_dispatch(),
        *params,
        step,
    );
    Ok((
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    ))
}

/// Quantized values as tensors on the input's device.
#[derive(Debug, Clone)]
pub struct QuantizedTensor {
    /// The quantizer.
    pub quantizer: Quantizer,
    /// Number of values.
    pub len: usize,
    /// Codes packed in u32 words (little-endian bytes: the CPU layout).
    pub codes: Tensor<1, Int>,
    /// Per group, `1/scale`.
    pub steps: Tensor<1>,
    /// Per group, the offset (zeros when symmetric).
    pub offsets: Tensor<1>,
}

/// Quantizes a flat f32 tensor group-wise.
///
/// # Errors
/// [`KernelError::Arguments`] when `x` is not f32.
pub fn quantize_groups(
    x: Tensor<1>,
    quantizer: &Quantizer,
) -> Result<QuantizedTensor, KernelError> {
    check(x.dtype() == DType::F32, "quantize_groups", || {
        format!("values must be f32; got {:?}", x.dtype())
    })?;
    let len = x.shape().num_elements();
    let (codes, steps, offsets) =
        <Dispatch as FusedOps>::quantize_groups(x.into_dispatch(), *quantizer);
    Ok(QuantizedTensor {
        quantizer: *quantizer,
        len,
        codes: Tensor::from_dispatch(codes),
        steps: Tensor::from_dispatch(steps),
        offsets: Tensor::from_dispatch(offsets),
    })
}

impl QuantizedTensor {
    /// Refuses fields that do not fit together: fewer code words than `len` values need,
    /// fewer steps or offsets than groups, or other dtypes than u32 words and f32.
    fn check_buffers(&self, op: &'static str) -> Result<(), KernelError> {
        let groups = self.len.div_ceil(self.quantizer.group());
        let words = self.quantizer.bits().words_for(self.len);
        let (have_codes, have_steps, have_offsets) = (
            self.codes.shape().num_elements(),
            self.steps.shape().num_elements(),
            self.offsets.shape().num_elements(),
        );
        check(
            have_codes >= words && have_steps >= groups && have_offsets >= groups,
            op,
            || {
                format!(
                    "{} values need {words} code words and {groups} steps and offsets; got \
                     {have_codes}, {have_steps} and {have_offsets}",
                    self.len
                )
            },
        )?;
        check(
            self.codes.dtype() == DType::U32
                && self.steps.dtype() == DType::F32
                && self.offsets.dtype() == DType::F32,
            op,
            || "codes must be u32 words, steps and offsets f32".into(),
        )?;
        Ok(())
    }

    /// The dequantized values.
    ///
    /// # Errors
    /// [`KernelError::Arguments`] when the fields do not fit together: fewer code words than
    /// `len` values need, or fewer steps or offsets than groups.
    pub fn dequantize(&self) -> Result<Tensor<1>, KernelError> {
        self.check_buffers("dequantize")?;
        Ok(Tensor::from_dispatch(
            <Dispatch as FusedOps>::dequantize_groups(
                self.codes.clone().into_dispatch(),
                self.steps.clone().into_dispatch(),
                self.offsets.clone().into_dispatch(),
                self.quantizer,
                self.len,
            ),
        ))
    }
}

impl QuantizedTensor {
    /// `x · W` (`[m, n]`) for an f32 `x` `[m, k]` and this tensor as the row-major `[k, n]`
    /// weight, dequantized as it is loaded: the CPU's blocked kernel on Flex, the CubeCL
    /// kernel on wgpu and CUDA (`cube::qmatmul`); the weight is never whole in f32.
    /// For inference: under autodiff no gradient flows.
    ///
    /// # Errors
    /// [`KernelError::Arguments`] when `x` is not f32, `k · n` is not this tensor's length,
    /// or the buffers are short (as [`dequantize`](Self::dequantize)).
    pub fn matmul(&self, x: Tensor<2>, n: usize) -> Result<Tensor<2>, KernelError> {
        let [_, k] = x.dims();
        check(
            x.dtype() == DType::F32 && k * n == self.len,
            "dequant_matmul",
            || {
                format!(
                    "x must be f32 [m, k] with k · {n} = {} values; got {:?} {:?}",
                    self.len,
                    x.dtype(),
                    x.dims()
                )
            },
        )?;
        self.check_buffers("dequant_matmul")?;
        Ok(Tensor::from_dispatch(
            <Dispatch as FusedOps>::dequant_matmul(
                x.into_dispatch(),
                self.codes.clone().into_dispatch(),
                self.steps.clone().into_dispatch(),
                self.offsets.clone().into_dispatch(),
                self.quantizer,
                k,
                n,
            ),
        ))
    }
}

/// Error-feedback 1-bit compression of a flat f32 tensor: returns the sign words (u32, the
/// CPU byte layout), the scale `‖x + error‖/√n` and the new error.
///
/// # Errors
/// [`KernelError::Arguments`] when the tensors are not f32 of one length.
pub fn onebit_compress(
    x: Tensor<1>,
    error: Tensor<1>,
) -> Result<(Tensor<1, Int>, f32, Tensor<1>), KernelError> {
    check(
        x.dtype() == DType::F32 && error.dtype() == DType::F32 && x.shape() == error.shape(),
        "onebit_compress",
        || {
            format!(
                "x {:?} {:?} and error {:?} {:?} must be f32 of one length",
                x.dtype(),
                x.shape(),
                error.dtype(),
                error.shape()
            )
        },
    )?;
    let (w, s, e) =
        <Dispatch as FusedOps>::onebit_compress(x.into_dispatch(), error.into_dispatch());
    let scale: Tensor<1> = Tensor::from_dispatch(s);
    let scale = scale
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| KernelError::Arguments {
            op: "onebit_compress",
            detail: format!("reading the scale: {e:?}"),
        })?[0];
    Ok((Tensor::from_dispatch(w), scale, Tensor::from_dispatch(e)))
}

/// `len` values of ±`scale` from sign words.
///
/// # Errors
/// [`KernelError::Arguments`] when `packed` has fewer than `⌈len/32⌉` words.
pub fn unpack_signs(
    packed: Tensor<1, Int>,
    scale: f32,
    len: usize,
) -> Result<Tensor<1>, KernelError> {
    let words = packed.shape().num_elements();
    check(
        words >= len.div_ceil(32) && packed.dtype() == DType::U32,
        "unpack_signs",
        || {
            format!(
                "{len} signs need {} u32 words; got {words} of {:?}",
                len.div_ceil(32),
                packed.dtype()
            )
        },
    )?;
    Ok(Tensor::from_dispatch(<Dispatch as FusedOps>::unpack_signs(
        packed.into_dispatch(),
        scale,
        len,
    )))
}
