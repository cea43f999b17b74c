//! The communicator: one trait, an in-process thread world and an MPI world, and the two
//! decorators that can wrap either: the logger (DeepSpeed's `comms_logger`) and the flight
//! recorder (the last collectives of every rank, to name the one out of step).

/// The [`Communicator`] methods a decorator (the logger, the flight recorder) hands to the
/// communicator it wraps, `self.inner`, unchanged: who this rank is, its counters, aborting,
/// labels and solo phases.
macro_rules! delegate_to_inner {
    () => {
        fn rank(&self) -> usize {
            self.inner.rank()
        }

        fn world_size(&self) -> usize {
            self.inner.world_size()
        }

        fn backend(&self) -> &'static str {
            self.inner.backend()
        }

        fn stats(&self) -> CommStats {
            self.inner.stats()
        }

        fn abort(&self, reason: &str) {
            self.inner.abort(reason)
        }

        fn label_next(&self, key: u64) {
            self.inner.label_next(key)
        }

        fn begin_solo(&self, what: &'static str) {
            self.inner.begin_solo(what)
        }

        fn end_solo(&self) {
            self.inner.end_solo()
        }
    };
}

mod agree;
mod communicator;
pub mod conformance;
mod element;
mod flight;
mod logger;
#[cfg(feature = "mpi")]
mod mpi;
mod panics;
mod recorder;
mod stats;
mod thread;
mod worker;

pub use agree::*;
pub use communicator::*;
pub use element::*;
pub use flight::*;
pub use logger::*;
#[cfg(feature = "mpi")]
pub use mpi::*;
pub use panics::*;
pub use recorder::*;
pub use stats::*;
pub use thread::*;
pub use worker::*;

#[cfg(test)]
mod tests;
