//! The training engine: data parallelism over a [`Communicator`](burn_deepspeed_strategies::comm::Communicator).

mod base;
pub mod checkpoint;
pub mod flat;
mod memory;
mod onebit;
mod optim;
pub mod reduce;
mod sync;
mod zero;
mod zero3;

pub use base::*;
pub use memory::*;
pub use onebit::*;
pub use optim::*;
pub use sync::*;
pub use zero::*;
pub use zero3::*;
