//! [`DeepSpeedStrategy`]: data-parallel training inside Burn's `SupervisedTraining`.

mod base;
mod prepare;

pub use base::*;
