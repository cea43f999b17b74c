//! [`gelu`]: the exact (erf) GELU with a vectorized CPU pass for its forward and backward.
//!
//! Burn's Flex backend evaluates the GELU's `erf` (and the backward's `exp`) with one scalar
//! libm call per element. Here both come from branch-free polynomials that the compiler
//! vectorizes: `erf` from Abramowitz and Stegun's 7.1.26 (absolute error at most 1.5e-7) on
//! an `exp` by range reduction to `2^k · e^r`, `|r| ≤ ln 2 / 2`, and a degree-6 Taylor
//! polynomial (relative error below 3e-7). This is DeepSpeed's fused GELU
//! (`deepspeed.ops.transformer`'s kernels) for the CPU; other backends use Burn's own.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::ActivationOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

/// Backends that run the fused GELU (use [`gelu`]).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FusedGeluOps: Backend {
    /// `x · Φ(x)`, Φ the standard normal CDF.
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `dy · (Φ(x) + x · φ(x))`, the GELU's input gradient.
    fn fused_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Values per rayon task.
const CHUNK: usize = 16_384;

/// `e^x` for `x` in [-87, 0]: `2^k · e^r` with `k = round(x / ln 2)` and a degree-6 Taylor
/// polynomial for `e^r`. Branch-free, so that loops over it vectorize.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let x = x.max(-87.0);
    // Rounding by adding and taking away 1.5·2²³ (exact for |y| < 2²², ties to even):
    // `f32::round` is a libm call on baseline x86-64 and kept this loop scalar. The sum's
    // low mantissa bits also hold k as an integer.
    const MAGIC: f32 = 12_582_912.0;
    let shifted = x * std::f32::consts::LOG2_E + MAGIC;
    let k = shifted - MAGIC;
    let k_int = shifted.to_bits() as i32 - MAGIC.to_bits() as i32;
    // ln 2 in two parts (Cody and Waite): k · LN2_HI is exact, so r keeps its precision.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^k by its exponent bits (k in [-126, 0]).
    p * f32::from_bits(((k_int + 127) << 23) as u32)
}

/// `(Φ(x), e^{-x²/2})`: the normal CDF through `erf(|x|/√2)` (Abramowitz and Stegun 7.1.26)
/// and the Gaussian factor it shares with the density.
#[inline(always)]
fn cdf_and_gauss(x: f32) -> (f32, f32) {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_72 + t * (1.421_413_8 + t * (-1.453_152 + t * 1.061_405_4))));
    let gauss = exp_nonpositive(-z * z);
    let erf = 1.0 - poly * gauss;
    let signed = if x < 0.0 { -erf } else { erf };
    (0.5 * (1.0 + signed), gauss)
}

/// `1/√(2π)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

fn gelu_slice(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = x * cdf_and_gauss(x).0;
            }
        });
    out
}

fn gelu_backward_slice(x: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
        .for_each(|(o, (x, dy))| {
            for ((o, &x), &dy) in o.iter_mut().zip(x).zip(dy) {
                let (cdf, gauss) = cdf_and_gauss(x);
                *o = dy * (cdf + x * INV_SQRT_2PI * gauss);
            }
        });
    out
}

/// The f32 values of a Flex tensor in order (copied only when strided).
pub(super) fn values(t: &FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) if v.len() == t.shape().num_elements() => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(
            t.to_contiguous()
                .as_slice::<f32>()
                .map_or_else(Vec::new, <[f32]>::to_vec),
        ),
    }
}

impl FusedGeluOps for Flex {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            return Flex::gelu(x);
        }
        let out = gelu_slice(&values(&x));
        FlexTensor::from_data(TensorData::new(out, x.shape()))
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 || dy.dtype() != DType::F32 || x.shape() != dy.shape() {
            return Flex::gelu_backward(x, dy);
        }
        let out = gelu_backward_slice(&values(&x), &values(&dy));
        FlexTensor::from_data(TensorData::new(out, x.shape()))
    }
}

#[cfg(feature = "cube")]
impl FusedGeluOps for burn::backend::Cube {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        burn::backend::Cube::gelu(x)
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        burn::backend::Cube::gelu_backward(x, dy)
    }
}

/// The GELU's backward: the input is retrieved through the checkpointer.
#[derive(Debug)]
struct GeluBackward;

impl<B: FusedGeluOps> Backward<B, 1> for GeluBackward {
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let x = checkpointer.retrieve_node_output(ops.state);
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            B::fused_gelu_backward(x, dy)
        });
    }
}

impl<B: FusedGeluOps, C: CheckpointStrategy> FusedGeluOps for Autodiff<B, C> {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, B::fused_gelu(x.into_primitive()))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu(x.into_primitive())),
        }
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        // The backward above runs on the inner values; called on autodiff tensors (a gradient
        // of the gradient), this is Burn's own differentiable formula.
        Self::gelu_backward(x, dy)
    }
}

/// The exact GELU, `x · Φ(x)`: Burn's [`gelu`](burn::tensor::activation::gelu), except that
/// under autodiff on Flex in f32 the forward and the backward are the vectorized passes of
/// this module (within 2e-7 of Burn's at every element, see the module docs).
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !x.is_autodiff() {
        return burn::tensor::activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedGeluOps>::fused_gelu(x.into_dispatch()))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::*;

    /// The polynomials against f64's exact functions: `exp` over its whole range (relative
    /// error), Φ over the range a GELU sees (absolute error: A&S's 1.5e-7 on erf is 7.5e-8 on
    /// Φ, the rest is f32 rounding).
    #[test]
    fn the_polynomials_are_within_their_bounds() {
        let (mut cdf_err, mut exp_err) = (0.0f64, 0.0f64);
        for i in -80_000..=80_000 {
            let x = i as f32 * 1e-4;
            let exact_cdf = 0.5 * (1.0 + erf_f64(x as f64 / std::f64::consts::SQRT_2));
            cdf_err = cdf_err.max((cdf_and_gauss(x).0 as f64 - exact_cdf).abs());
            let a = (i + 80_000) as f32 * (87.0 / 160_000.0) - 87.0;
            let exact = (a as f64).exp();
            exp_err = exp_err.max((exp_nonpositive(a) as f64 - exact).abs() / exact);
        }
        println!("max |Φ error| {cdf_err:.2e}, max relative exp error {exp_err:.2e}");
        assert!(cdf_err <= 3e-7, "{cdf_err}");
        assert!(exp_err <= 3e-7, "{exp_err}");
    }

    /// erf in f64 by its Taylor series (|x| ≤ 3) or continued fraction, for the reference.
    fn erf_f64(x: f64) -> f64 {
        let a = x.abs();
        let value = if a <= 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc by Lentz's continued fraction.
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
        };
        value.copysign(x)
    }

    /// Values and input gradients equal Burn's GELU under autodiff within 1e-6.
    #[test]
    fn matches_burns_gelu_and_its_gradient() {
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([37, 129], Distribution::Normal(0.0, 3.0), &device);
        let w = Tensor::<2>::random([37, 129], Distribution::Default, &device);
        let run = |fused: bool| {
            let x = x.clone().detach().require_grad();
            let y = match fused {
                true => gelu(x.clone()),
                false => burn::tensor::activation::gelu(x.clone()),
            };
            let grads = (y.clone() * w.clone()).sum().backward();
            (y.inner(), x.grad(&grads).expect("a gradient"))
        };
        let (y, g) = run(true);
        let (y_ref, g_ref) = run(false);
        let tol = Tolerance::absolute(1e-6);
        y.into_data()
            .assert_approx_eq::<f32>(&y_ref.into_data(), tol);
        g.into_data()
            .assert_approx_eq::<f32>(&g_ref.into_data(), tol);
    }

    /// A strided input (a transposed view) gives the values of its contiguous copy.
    #[test]
    fn strided_inputs_are_read_in_order() {
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([6, 5], Distribution::Normal(0.0, 1.0), &device);
        let strided = gelu(x.clone().transpose()).inner().into_data();
        let copy = Tensor::<2>::from_data(x.transpose().inner().into_data(), &device);
        assert_eq!(strided, gelu(copy).inner().into_data());
    }
}
