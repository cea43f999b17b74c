//! The training engine: data parallelism over a
//! [`Communicator`](burn_deepspeed_strategies::comm::Communicator), with the gradient regime
//! of [`crate::sync`] and the step protocol of [`crate::step`].

mod base;
mod build;
mod checkpoint;
mod inspect;
mod profile;

pub use crate::step::{BreakdownWindow, StepLoss, StepReport};
pub use base::*;
