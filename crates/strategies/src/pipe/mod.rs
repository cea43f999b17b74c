//! Pipeline parallelism: schedules as plain data.

mod schedule;

pub use schedule::*;

#[cfg(test)]
mod tests;
