//! The bootstrap of a device transport: rank 0 makes an identifier (NCCL's 128-byte unique
//! id) and every rank receives it over the host communicator, or rank 0's failure.

use crate::comm::{Communicator, CommunicatorExt};
use crate::{CommError, Result};

/// Rank 0 calls `make` and broadcasts its `N` bytes over `comm`; every rank returns them.
/// When `make` fails on rank 0, every rank returns an error that carries rank 0's reason
/// (the broadcast carries a flag and the reason instead of the identifier), so that no rank
/// goes on to initialise a transport the others never join.
pub fn bootstrap_id<const N: usize>(
    comm: &dyn Communicator,
    make: impl FnOnce() -> std::result::Result<[u8; N], String>,
) -> Result<[u8; N]> {
    // One flag byte, then the identifier or rank 0's reason (truncated to fit).
    let len = 1 + N.max(256);
    let mut buf = vec![0u8; len];
    if comm.rank() == 0 {
        match make() {
            Ok(id) => {
                buf[0] = 1;
                buf[1..1 + N].copy_from_slice(&id);
            }
            Err(reason) => {
                let bytes = reason.as_bytes();
                let n = bytes.len().min(len - 1);
                buf[1..1 + n].copy_from_slice(&bytes[..n]);
            }
        }
    }
    comm.broadcast(&mut buf, 0)?;
    if buf[0] != 1 {
        let end = buf[1..].iter().position(|&b| b == 0).map_or(len, |p| p + 1);
        return Err(CommError::Device {
            rank: comm.rank(),
            op: "bootstrap",
            detail: format!(
                "rank 0 could not create the transport's identifier: {}",
                String::from_utf8_lossy(&buf[1..end])
            ),
        });
    }
    let mut id = [0u8; N];
    id.copy_from_slice(&buf[1..1 + N]);
    Ok(id)
}
