//! Mixture of Experts (DeepSpeed-MoE, arXiv 2201.05596): DeepSpeed's gating, as plain-data
//! routing decisions and as the differentiable combine weights a layer uses.

pub mod gating;
pub mod routing;

pub use gating::{Gating, top1_gating, top2_gating};
pub use routing::{RouteOptions, Routing, capacity};
