//! Parallel-training strategies for burn-deepspeed: the [`Communicator`](comm::Communicator)
//! that SPMD ranks talk through, the gradient bucketing of data parallelism, pipeline plans,
//! the error-compensated 1-bit all-reduce and the 1-bit optimizers built on it, and the NVMe
//! swapper of ZeRO-Infinity.
//!
//! Ranks are SPMD, as in DeepSpeed: every rank runs the same program and calls the same
//! collectives in the same order. Two worlds implement [`comm::Communicator`]: in-process
//! threads ([`comm::ThreadWorld`], the default) and MPI (feature `mpi`, under `mpirun`); on
//! the model's device buffers, [`device::DeviceCollectives`] adds NCCL (feature `cuda`).
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod bucket;
pub mod comm;
pub mod compressed;
pub mod device;
mod error;
pub mod onebit;
pub mod pipe;
pub mod place;
pub mod swap;
pub mod zero;

pub use error::*;
