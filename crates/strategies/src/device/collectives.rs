//! The [`DeviceCollectives`] trait: the collectives of [`Communicator`](crate::comm::Communicator)
//! on flat buffers that live on the model's device (rank-1 Burn tensors), and the argument
//! checks every implementation shares.

use std::fmt::Debug;

use burn::tensor::{DType as TensorDType, Int, Tensor, TensorData};
use half::{bf16, f16};

use crate::comm::{Buf, BufMut, ReduceOp};
use crate::{CommError, Result};

/// Bytes a device collective copied between host and device memory, counted where the copies
/// happen (zero for buffers that already live in host memory, as Flex's do, and for NCCL,
/// which moves device memory directly).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceTraffic {
    /// Bytes read from device buffers into host memory.
    pub device_to_host: u64,
    /// Bytes written from host memory into device buffers.
    pub host_to_device: u64,
}

impl DeviceTraffic {
    /// Both directions together.
    pub fn total(&self) -> u64 {
        self.device_to_host + self.host_to_device
    }
}

/// Collectives on rank-1 tensors of the model's device (f32, f16 or bf16), with the
/// semantics of the host [`Communicator`](crate::comm::Communicator): SPMD, every rank calls
/// the same collectives in the same order, a failed rank makes the others return an error.
///
/// Each method consumes its input and returns the result as a new tensor on the input's
/// device and dtype, so that an implementation may reuse the input's memory (Flex's host
/// buffers are reduced in place when the tensor owns them alone). Three implementations
/// exist: [`HostCollectives`](super::HostCollectives) (Flex in place; any other device staged
/// through host memory and counted as such) and, with feature `cuda`, `NcclCollectives`
/// (NCCL on the CUDA buffers themselves).
pub trait DeviceCollectives: Send + Sync + Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// What moves the bytes: `"host"` (the host communicator) or `"nccl"`.
    fn kind(&self) -> &'static str;
    /// Element-wise reduction over every rank; every rank gets the result.
    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>>;
    /// Sums over every rank and returns this rank's `counts[rank]` elements of the sum (the
    /// input has `counts.iter().sum()` elements).
    fn reduce_scatter(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>>;
    /// Joins every rank's `counts[r]` elements in rank order (the input has `counts[rank]`).
    fn all_gather(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>>;
    /// Every rank gets `root`'s values (every input has the same length).
    fn broadcast(&self, t: Tensor<1>, root: usize) -> Result<Tensor<1>>;
    /// Chunk `j` of rank `i`'s input becomes chunk `i` of rank `j`'s output (equal chunks).
    fn all_to_all(&self, t: Tensor<1>) -> Result<Tensor<1>>;
    /// Sends `t` to rank `dst` (`tag` pairs it with the matching receive where the transport
    /// has tags; NCCL pairs sends and receives in order).
    fn send(&self, t: Tensor<1>, dst: usize, tag: u16) -> Result<()>;
    /// Receives into a buffer shaped, typed and placed like `like` from rank `src`.
    fn recv(&self, like: Tensor<1>, src: usize, tag: u16) -> Result<Tensor<1>>;
    /// [`all_to_all`](Self::all_to_all) of u32 words (packed signs, the 1-bit all-reduce's
    /// payload): chunk `j` of this rank's words becomes chunk `rank` of rank `j`'s output.
    fn all_to_all_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>>;
    /// Joins every rank's u32 words in rank order (every rank gives the same number).
    fn all_gather_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<()>;
    /// Fails every rank's pending and next collectives at once, with `reason` (the host
    /// communicator's [`abort`](crate::comm::Communicator::abort)): for a rank that failed
    /// inside an op that cannot return the error, so that its peers do not wait for it.
    fn abort(&self, reason: &str);
    /// Host/device bytes copied so far by this rank's collectives.
    fn traffic(&self) -> DeviceTraffic;
}

/// The dtypes the device collectives move.
pub(crate) fn check_dtype(rank: usize, op: &'static str, dtype: TensorDType) -> Result<()> {
    match dtype {
        TensorDType::F32 | TensorDType::F16 | TensorDType::BF16 => Ok(()),
        other => Err(CommError::InvalidArgument {
            rank,
            op,
            detail: format!("device collectives move f32, f16 or bf16 tensors, not {other:?}"),
        }),
    }
}

/// The word collectives move u32 tensors only.
pub(crate) fn check_words(rank: usize, op: &'static str, dtype: TensorDType) -> Result<()> {
    match dtype {
        TensorDType::U32 => Ok(()),
        other => Err(CommError::InvalidArgument {
            rank,
            op,
            detail: format!("word collectives move u32 tensors, not {other:?}"),
        }),
    }
}

/// `counts` has one entry per rank and, for a reduce-scatter, sums to the input's length, or,
/// for an all-gather, gives this rank the input's length.
pub(crate) fn check_counts(
    rank: usize,
    world: usize,
    op: &'static str,
    counts: &[usize],
    len: usize,
) -> Result<()> {
    let bad = |detail: String| Err(CommError::InvalidArgument { rank, op, detail });
    if counts.len() != world {
        return bad(format!(
            "{} counts for a world of {world} ranks",
            counts.len()
        ));
    }
    match op {
        "reduce_scatter" if counts.iter().sum::<usize>() != len => bad(format!(
            "the counts sum to {}, the input has {len} elements",
            counts.iter().sum::<usize>()
        )),
        "all_gather" if counts[rank] != len => bad(format!(
            "this rank's count is {}, its input has {len} elements",
            counts[rank]
        )),
        _ => Ok(()),
    }
}

/// `peer` names a rank of the world (and, for point-to-point, not this one).
pub(crate) fn check_peer(
    rank: usize,
    world: usize,
    op: &'static str,
    peer: usize,
    self_ok: bool,
) -> Result<()> {
    if peer >= world || (!self_ok && peer == rank) {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            detail: format!("rank {peer} is not a peer of rank {rank} in a world of {world}"),
        });
    }
    Ok(())
}

/// The input of an all-to-all splits into `world` equal chunks.
pub(crate) fn check_equal_chunks(rank: usize, world: usize, len: usize) -> Result<()> {
    if !len.is_multiple_of(world) {
        return Err(CommError::InvalidArgument {
            rank,
            op: "all_to_all",
            detail: format!("{len} elements do not split into {world} equal chunks"),
        });
    }
    Ok(())
}

/// Host values of `dtype`, zeroed.
pub(crate) fn host_zeros(dtype: TensorDType, n: usize) -> TensorData {
    match dtype {
        TensorDType::F16 => TensorData::zeros::<f16, _>([n]),
        TensorDType::BF16 => TensorData::zeros::<bf16, _>([n]),
        _ => TensorData::zeros::<f32, _>([n]),
    }
}

/// Host values as the communicator's read-only buffer.
pub(crate) fn as_buf(data: &TensorData) -> std::result::Result<Buf<'_>, String> {
    let e = |e| format!("{e:?}");
    Ok(match data.dtype() {
        TensorDType::F32 => Buf::F32(data.as_slice::<f32>().map_err(e)?),
        TensorDType::F16 => Buf::F16(data.as_slice::<f16>().map_err(e)?),
        TensorDType::BF16 => Buf::BF16(data.as_slice::<bf16>().map_err(e)?),
        other => return Err(format!("unsupported dtype {other:?}")),
    })
}

/// Host values as the communicator's writable buffer.
pub(crate) fn as_buf_mut(data: &mut TensorData) -> std::result::Result<BufMut<'_>, String> {
    let e = |e| format!("{e:?}");
    Ok(match data.dtype() {
        TensorDType::F32 => BufMut::F32(data.as_mut_slice::<f32>().map_err(e)?),
        TensorDType::F16 => BufMut::F16(data.as_mut_slice::<f16>().map_err(e)?),
        TensorDType::BF16 => BufMut::BF16(data.as_mut_slice::<bf16>().map_err(e)?),
        other => return Err(format!("unsupported dtype {other:?}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_checked_per_operation() {
        assert!(check_counts(0, 2, "reduce_scatter", &[3, 2], 5).is_ok());
        assert!(check_counts(1, 2, "all_gather", &[3, 2], 2).is_ok());
        let e = check_counts(0, 2, "reduce_scatter", &[3, 3], 5).unwrap_err();
        assert!(e.to_string().contains("sum to 6"), "{e}");
        let e = check_counts(0, 3, "all_gather", &[3, 3], 3).unwrap_err();
        assert!(e.to_string().contains("2 counts for a world of 3"), "{e}");
        let e = check_counts(1, 2, "all_gather", &[3, 2], 3).unwrap_err();
        assert!(e.to_string().contains("count is 2"), "{e}");
    }

    #[test]
    fn peers_dtypes_and_chunks_are_checked() {
        assert!(check_peer(0, 2, "send", 1, false).is_ok());
        assert!(check_peer(0, 2, "send", 0, false).is_err());
        assert!(check_peer(0, 2, "broadcast", 0, true).is_ok());
        assert!(check_peer(0, 2, "broadcast", 2, true).is_err());
        assert!(check_dtype(0, "all_reduce", TensorDType::BF16).is_ok());
        let e = check_dtype(0, "all_reduce", TensorDType::I64).unwrap_err();
        assert!(e.to_string().contains("I64"), "{e}");
        assert!(check_words(0, "all_gather_words", TensorDType::U32).is_ok());
        let e = check_words(0, "all_gather_words", TensorDType::F32).unwrap_err();
        assert!(e.to_string().contains("u32 tensors, not F32"), "{e}");
        assert!(check_equal_chunks(0, 2, 6).is_ok());
        assert!(check_equal_chunks(0, 4, 6).is_err());
    }

    #[test]
    fn host_buffers_view_every_float_dtype() {
        for dtype in [TensorDType::F32, TensorDType::F16, TensorDType::BF16] {
            let mut data = host_zeros(dtype, 5);
            assert_eq!(as_buf(&data).unwrap().len(), 5);
            assert_eq!(as_buf_mut(&mut data).unwrap().len(), 5);
        }
    }
}
