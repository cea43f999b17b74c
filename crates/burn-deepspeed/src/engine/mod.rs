//! The training engine: data parallelism over a
//! [`Communicator`](burn_deepspeed_strategies::comm::Communicator), with the gradient regime
//! of [`crate::sync`].

mod base;
mod breakdown;
pub mod checkpoint;
pub mod estimate;
pub mod flat;
pub mod heap;
pub mod memory;
mod onebit;
mod optim;
pub mod primitive;
mod report;
pub mod transfer;

pub use base::*;
pub use breakdown::*;
pub use estimate::*;
pub use memory::{MemoryMeter, ModelStateBytes};
pub use onebit::*;
pub use optim::*;
pub use report::*;
