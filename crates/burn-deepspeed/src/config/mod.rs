//! DeepSpeed's `ds_config.json`, typed, with DeepSpeed's defaults and errors that name the key.

mod base;
mod batch;
#[cfg(test)]
mod keys;
mod monitor;
mod offload_support;
mod optimizer;
mod quantize;
mod scheduler;
mod sections;
mod serde_util;
mod support;
mod warnings;
mod zero;

pub use base::*;
pub use batch::*;
pub use monitor::*;
pub use optimizer::*;
pub use quantize::*;
pub use scheduler::*;
pub use sections::*;
pub use support::*;
pub use warnings::ConfigWarning;
pub use zero::*;
