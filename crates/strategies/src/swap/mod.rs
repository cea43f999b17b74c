//! ZeRO-Infinity's swapping (arXiv 2104.07857): state that does not fit in memory lives in
//! files on a fast disk, read and written in aligned tiles with `O_DIRECT` (so that it never
//! fills the page cache) through io_uring, or `pread`/`pwrite` where io_uring is unavailable.
//!
//! - [`disk_baseline`]: the disk's own `O_DIRECT` bandwidth, to judge a swapper against.
//! - [`AioOptions`]: DeepSpeed's `aio` section (block size, queue depth, threads).
//! - [`IoEngine`]: which system calls move the bytes, chosen once per process.
//! - [`AlignedBuf`]: the page-aligned host buffers `O_DIRECT` needs.
//! - [`fresh_dir`]: a new folder for one store's swap files, never shared with another.
//! - [`SwapFile`]: one file read and written in blocks, many in flight, created where no file
//!   was (never truncating or following a link to another's).
//! - [`TilePlan`]: how a flat state of several fields is cut into tiles (plain data).
//! - `SwapFault` (the `fault-injection` feature): makes a swap file's k-th read or write fail,
//!   for tests.
//! - [`SwapStore`]: a swapped state, visited tile by tile with the next read and the previous
//!   write overlapping the work on the current tile.

mod aio;
mod baseline;
mod buffer;
#[cfg(all(target_os = "linux", any(test, feature = "fault-injection")))]
mod fault;
mod file;
mod run_dir;
mod store;
mod tiles;

pub use aio::*;
pub use baseline::*;
pub use buffer::*;
#[cfg(all(target_os = "linux", any(test, feature = "fault-injection")))]
pub use fault::*;
pub use file::*;
pub use run_dir::fresh_dir;
pub use store::*;
pub use tiles::*;

/// The engines the tests run here: `pread` always, io_uring where the kernel allows it.
#[cfg(test)]
pub(crate) fn engines_here() -> Vec<IoEngine> {
    if io_uring_available() {
        vec![IoEngine::Pread, IoEngine::Uring]
    } else {
        eprintln!("io_uring is not available here: only the pread engine is tested");
        vec![IoEngine::Pread]
    }
}
