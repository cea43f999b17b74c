//! Engine checkpoints: the file format ([`format`]) and the collective protocol that writes and
//! reads it ([`protocol`]): which rank writes what, how ranks agree, and how a checkpoint of one
//! world size is cut again for another. [`consolidate`] turns one into a single safetensors
//! file that plain Burn loads.

mod consolidate;
pub mod format;
mod protocol;

pub use consolidate::*;
pub use format::*;
pub use protocol::*;
