//! DeepSpeed's monitor: each step's loss, learning rate, loss scale, gradient norm,
//! throughput and memory written as TensorBoard event files (`tensorboard`) and CSV
//! (`csv_monitor`).

mod base;
mod csv;
mod tensorboard;

pub use base::*;
pub use csv::*;
pub use tensorboard::*;
