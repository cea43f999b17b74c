//! Compressors for communication-efficient training (no communication here).
//!
//! The error-feedback 1-bit compressor of 1-bit Adam (arXiv 2102.02888), which the
//! compressed all-reduce and the 1-bit optimizers build on, the schedule of Progressive
//! Layer Dropping (arXiv 2010.13369), and MoQ's precision schedule and fake quantization.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod moq;
pub mod onebit;
pub mod pld;
