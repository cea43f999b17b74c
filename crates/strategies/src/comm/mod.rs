//! The communicator: one trait, an in-process thread world and an MPI world, and the
//! logger that can wrap either.

mod agree;
mod communicator;
pub mod conformance;
mod element;
mod logger;
#[cfg(feature = "mpi")]
mod mpi;
mod stats;
mod thread;
mod worker;

pub use agree::*;
pub use communicator::*;
pub use element::*;
pub use logger::*;
#[cfg(feature = "mpi")]
pub use mpi::*;
pub use stats::*;
pub use thread::*;
pub use worker::*;

#[cfg(test)]
mod tests;
