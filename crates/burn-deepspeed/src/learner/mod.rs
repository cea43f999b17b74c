//! [`DeepSpeedStrategy`]: data-parallel training inside Burn's `SupervisedTraining`.

mod base;
mod checkpoint;
mod chunked;
mod leader;
mod masters;
mod prepare;
mod reader;
mod schedule;
mod settings;

pub use base::*;
pub use schedule::*;
