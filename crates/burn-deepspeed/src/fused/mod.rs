//! Fused transformer ops for training: DeepSpeed's transformer kernels (its fused softmax,
//! layer norm and GELU) for Burn models under autodiff.
//!
//! Burn 0.22's backends already compute a softmax or a layer norm in one fused pass (Flex
//! row by row, the Cube backends through their fusion), but under `Autodiff` both run as
//! their decompositions: five tracked operations for a softmax, about ten for a layer norm,
//! each with its own intermediate tensor kept for the backward. The ops here run the
//! backend's fused forward and a hand-written backward instead. Without autodiff (inference,
//! evaluation, the flops profiler's capture) they are Burn's own ops. The GELU is one op under
//! autodiff already, but Flex evaluates its `erf` and `exp` one scalar libm call at a time:
//! [`gelu`] brings vectorized passes for its forward and backward on the CPU. [`blockwise_attention`]
//! keeps memory linear in the sequence by computing the scores one block of queries at a
//! time, in the forward and again in the backward. [`linear`] multiplies through OpenBLAS on the
//! CPU under the `blas` feature.

mod attention;
mod gelu;
mod layer_norm;
mod linear;
mod softmax;

pub use attention::*;
pub use gelu::*;
pub use layer_norm::*;
pub use linear::*;
pub use softmax::*;
