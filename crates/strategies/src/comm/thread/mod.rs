//! The in-process world: one thread per rank, the default on one machine.

mod rank;
mod round;
mod world;

pub use rank::ThreadCommunicator;
pub use world::{ThreadWorld, ThreadWorldOptions};
