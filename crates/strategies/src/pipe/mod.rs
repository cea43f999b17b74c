//! Pipeline parallelism as plain data: schedules, stage partitions and the pp x dp grid.

mod partition;
mod schedule;
mod topology;

pub use partition::*;
pub use schedule::*;
pub use topology::*;

#[cfg(test)]
mod tests;
