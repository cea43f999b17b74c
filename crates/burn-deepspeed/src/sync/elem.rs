//! [`GradElem`]: the element type of a regime's flat gradient buffers. fp32 and bf16 runs keep
//! fp32 buffers (DeepSpeed's bf16 optimizer accumulates in fp32 too); fp16 runs keep fp16
//! buffers, the paper's 2Ψ of gradients (ZeRO, arXiv 1910.02054 §3.1), accumulated, reduced
//! and clipped in fp16 as DeepSpeed's fp16 optimizers do. Arithmetic on one element widens it
//! to f32, computes, and rounds back once.

use std::borrow::Cow;

use burn_deepspeed_strategies::comm::CommElement;
use half::f16;

/// An element of a flat gradient buffer: `f32`, or `f16` under fp16.
pub trait GradElem: CommElement + Copy + Default {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// `v` rounded to this type (to nearest even; out of range becomes ±inf, which the
    /// overflow check then sees).
    fn narrow(v: f32) -> Self;
    /// A whole buffer as f32: borrowed when it already is, else a widened copy (the transient
    /// fp32 gradient of the optimizer step, as DeepSpeed's fp16 stage 1-2 optimizer makes
    /// for its partition).
    fn widen_all(values: &[Self]) -> Cow<'_, [f32]>;
    /// A buffer of f32 values in this type (moved as is when it is f32).
    fn from_f32_vec(values: Vec<f32>) -> Vec<Self>;
    /// A buffer as f32 (moved as is when it is f32).
    fn into_f32_vec(values: Vec<Self>) -> Vec<f32>;
}

impl GradElem for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(v: f32) -> Self {
        v
    }
    fn widen_all(values: &[Self]) -> Cow<'_, [f32]> {
        Cow::Borrowed(values)
    }
    fn from_f32_vec(values: Vec<f32>) -> Vec<Self> {
        values
    }
    fn into_f32_vec(values: Vec<Self>) -> Vec<f32> {
        values
    }
}

impl GradElem for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn widen_all(values: &[Self]) -> Cow<'_, [f32]> {
        Cow::Owned(values.iter().map(|v| v.to_f32()).collect())
    }
    fn from_f32_vec(values: Vec<f32>) -> Vec<Self> {
        values.into_iter().map(f16::from_f32).collect()
    }
    fn into_f32_vec(values: Vec<Self>) -> Vec<f32> {
        values.into_iter().map(f16::to_f32).collect()
    }
}

/// Adds `values` element-wise into `dst` (one rounding per element).
pub fn add_into<G: GradElem>(dst: &mut [G], values: &[f32]) {
    dst.iter_mut()
        .zip(values)
        .for_each(|(d, &v)| *d = G::narrow(d.widen() + v));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_once_per_operation_and_overflows_to_inf() {
        let mut dst = vec![f16::from_f32(1.0), f16::from_f32(60000.0)];
        add_into(&mut dst, &[1.0 / 4096.0, 10000.0]);
        // 1 + 2^-12 is below half an f16 ulp at 1 (2^-11): it rounds back to 1.
        assert_eq!(dst[0], f16::from_f32(1.0));
        assert!(dst[1].to_f32().is_infinite(), "past f16's max (65504)");
        let mut exact = vec![0.5f32];
        add_into(&mut exact, &[1.0 / 4096.0]);
        assert_eq!(exact[0], 0.5 + 1.0 / 4096.0);
        assert!(matches!(f32::widen_all(&exact), Cow::Borrowed(_)));
        assert_eq!(f16::widen_all(&dst[..1]).as_ref(), &[1.0]);
    }
}
