//! Fused kernels for burn-deepspeed, each with a CPU path and a CubeCL kernel.
//!
//! The CPU paths (rayon over chunks the compiler vectorizes): fused Adam/AdamW ([`adam`]) and
//! LAMB ([`lamb`]) steps, which the ZeRO stages use on their partitions, group-wise int8/int4
//! quantization ([`quantize`]), and 1-bit sign compression with error feedback ([`sign`]).
//! The `cube` module (features `wgpu`, `cuda`) holds the same ops as CubeCL kernels, and
//! [`ext`] brings both to Burn tensors through a `#[backend_extension]`.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adam;
pub mod attention;
#[cfg(feature = "blas")]
pub mod blas;
#[cfg(feature = "cube")]
pub mod cube;
pub mod ext;
pub mod fill;
pub mod lamb;
pub mod qmatmul;
pub mod quantize;
pub mod sign;
pub mod words;

/// Errors of this crate: arguments a kernel cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A quantization group size the packing cannot hold.
    #[error(
        "quantization group of {group} values: it must be at least 1, and even with {bits}-bit \
         codes (two share a byte)"
    )]
    GroupSize {
        /// The group size asked for.
        group: usize,
        /// The code width.
        bits: u32,
    },
    /// Tensors a fused op cannot take: wrong dtypes or shapes.
    #[error("{op}: {detail}")]
    Arguments {
        /// The op.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
}
