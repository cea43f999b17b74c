//! Fused kernels for burn-deepspeed, each with a CPU path.
//!
//! Today this crate holds the CPU path of 1-bit sign packing ([`sign`]); the CubeCL kernels
//! (fused Adam/AdamW/LAMB, group-wise quantization, and the GPU sign packing) join it with the
//! same signatures.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod sign;
