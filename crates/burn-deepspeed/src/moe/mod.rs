//! Mixture of Experts (DeepSpeed-MoE, arXiv 2201.05596): DeepSpeed's gating, as plain-data
//! routing decisions and as the differentiable combine weights a layer uses; the [`MoE`]
//! layer; and expert parallelism ([`ExpertParallel`]), whose token exchange is an all-to-all
//! with its own backward.

mod config;
mod expert;
pub mod gating;
mod group;
mod layer;
mod op;
pub mod routing;

pub use config::*;
pub use expert::*;
pub use gating::{Gating, top1_gating, top2_gating};
pub(crate) use group::is_expert_anywhere;
pub use group::{ExpertLayer, ExpertParallel};
pub use layer::*;
pub use op::ExpertParallelOps;
pub(crate) use op::ep_all_to_all;
pub use routing::{RouteOptions, Routing, capacity};
