//! Pipeline parallelism as plain data: schedules, stage partitions, the pp x dp grid and the
//! pp x dp x tp grid of 3D parallelism.

mod grid;
mod partition;
mod schedule;
mod topology;

pub use grid::*;
pub use partition::*;
pub use schedule::*;
pub use topology::*;

#[cfg(test)]
mod tests;
