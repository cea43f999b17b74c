//! The training driver of the example: one call per rank (SPMD).

mod data_parallel;
mod figures;
mod pipelined;
mod report;
mod spec;

pub use data_parallel::*;
pub use figures::*;
pub use report::*;
pub use spec::*;
