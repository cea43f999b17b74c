//! The flops profiler (DeepSpeed's `flops_profiler` and `get_model_profile`): a module's
//! forward flops, MACs and parameters per module, by DeepSpeed's counting rules, with the
//! measured forward latency (the whole forward's, and each [`scope`]d module's).

mod base;
mod graph;
mod report;
pub mod rules;
mod scope;
mod tree;

pub use base::*;
pub use report::*;
pub use scope::scope;
pub use tree::ModuleProfile;
