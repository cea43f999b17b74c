//! ZeRO stage 3 (arXiv 1910.02054 §5.3) on Burn modules: parameters stored as per-rank
//! chunks ([`shard_module`]), gathered whole for use by a custom op ([`zero3_gather`])
//! whose backward reduce-scatters the gradient, through a per-rank [`GatherGroup`] that
//! traces and prefetches. Under `offload_param` the pieces live in a [`ParamStore`] (host
//! memory or a swap file) and the module keeps empty placeholders.

mod chunks;
mod coordinator;
mod group;
mod op;
mod quantized_grads;
mod registry;
mod reparam;
mod secondary;
mod store;
mod wire;

pub use group::*;
pub use op::*;
pub(crate) use quantized_grads::Hierarchy;
pub use registry::*;
pub use reparam::*;
pub use store::*;
