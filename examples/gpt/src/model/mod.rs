//! A byte-level GPT: pre-LN transformer blocks, learned positions, an untied head; also as a
//! sequence of pipeline layers, and sliced across a tensor-parallel group (Megatron-LM's
//! split: attention heads and the MLP's hidden features cut across the ranks, the vocabulary
//! of the embedding and of the head too).

mod batch;
mod gpt;
mod init;
mod layers;
mod moe_log;
mod shape;

pub use batch::*;
pub use gpt::*;
pub use init::*;
pub use layers::*;
pub use moe_log::*;
pub use shape::*;
