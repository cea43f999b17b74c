//! Compressors for communication-efficient training (no communication here).
//!
//! Today: the error-feedback 1-bit compressor of 1-bit Adam (arXiv 2102.02888), a plain-Rust
//! reference that the compressed all-reduce and the optimizers build on.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod onebit;
