//! One optimizer step's protocol, shared by every driver (the data-parallel engine, the
//! pipeline engine and the Learner strategy): the [`StepReport`] it returns, the
//! `wall_clock_breakdown` window, and the core that keeps the loss scale, the step counters
//! and the monitor.

mod breakdown;
pub(crate) mod core;
mod report;

pub use breakdown::*;
pub use report::*;
