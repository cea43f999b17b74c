//! Engine checkpoints: the files on disk ([`files`]: atomic writes; moving a staged
//! checkpoint into place, `commit`; checked reads, `read`), what
//! `meta.json` holds ([`meta`]), how state is serialized in the files ([`state`]), and the
//! collective protocol that writes and reads them (`protocol`): which rank writes what, how
//! ranks agree, and how a checkpoint of one world size is cut again for another.
//! [`consolidate`] turns one into a single safetensors file that plain Burn loads.

mod commit;
mod consolidate;
pub mod files;
mod loaded;
pub mod meta;
mod protocol;
mod read;
pub mod state;

pub use commit::*;
pub use consolidate::*;
pub use files::*;
pub use loaded::*;
pub use meta::*;
pub use protocol::*;
pub use read::*;
pub use state::*;
