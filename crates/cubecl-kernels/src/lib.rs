//! Fused kernels for burn-deepspeed, each with a CPU path.
//!
//! Today this crate holds the CPU paths: fused Adam/AdamW ([`adam`]) and LAMB ([`lamb`]) steps,
//! which the ZeRO stages use on their partitions, and 1-bit sign packing ([`sign`]). The CubeCL
//! kernels (and group-wise quantization) join them with the same signatures.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adam;
pub mod lamb;
pub mod sign;
