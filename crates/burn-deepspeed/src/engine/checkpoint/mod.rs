//! Engine checkpoints: the file format ([`format`]) and the collective protocol that writes and
//! reads it ([`protocol`]): which rank writes what, how ranks agree, and how a checkpoint of one
//! world size is cut again for another.

pub mod format;
mod protocol;

pub use format::*;
pub use protocol::*;
