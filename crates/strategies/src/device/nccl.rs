//! [`NcclCollectives`]: the device collectives on CUDA buffers through NCCL (`cudarc`, loaded
//! at run time), bootstrapped over the host communicator.
//!
//! NCCL reads and writes the Burn tensors' own device memory: a tensor's CubeCL handle gives
//! its buffer's device pointer (held, so that the allocator neither frees nor moves it while
//! NCCL runs), the pointer is lent to `cudarc` as a slice that is never freed, Burn's queued
//! work is synchronised before the collective is posted on this rank's NCCL stream, and that
//! stream is synchronised before the result is handed back. Nothing is copied to the host.
//! At one rank every collective is the identity and returns its input at once.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use burn::backend::Cube;
use burn::tensor::{DType, Device, Int, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, NcclType};

use super::bootstrap::bootstrap_id;
use super::collectives::{
    DeviceCollectives, DeviceTraffic, check_counts, check_dtype, check_equal_chunks, check_peer,
    check_words,
};
use crate::comm::{Communicator, ReduceOp};
use crate::{CommError, Result};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// Whether the CUDA driver and NCCL libraries can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: these only try to open the shared libraries.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

/// The NCCL communicator, used by one thread at a time.
struct Shared(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; every use goes through the mutex of `NcclCollectives`.
unsafe impl Send for Shared {}

/// Device collectives through NCCL on CUDA tensors (feature `cuda`).
pub struct NcclCollectives {
    host: Arc<dyn Communicator>,
    comm: Mutex<Shared>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    /// Whether a world of one rank skips NCCL (the default; off for the conformance test,
    /// which exercises NCCL itself on a machine with one GPU).
    shortcut: bool,
}

impl std::fmt::Debug for NcclCollectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollectives")
            .field("rank", &self.host.rank())
            .field("world", &self.host.world_size())
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

/// A device buffer lent to NCCL: the tensor, its held allocation and its address.
struct Lent {
    tensor: CubeTensor,
    /// The allocation's binding: while it lives the buffer is neither freed nor moved.
    _held: Box<dyn std::any::Any>,
    ptr: u64,
    len: usize,
}

impl NcclCollectives {
    /// Joins the ranks of `host` in an NCCL communicator on CUDA device `ordinal` (the GPU
    /// this rank's model lives on): rank 0 makes NCCL's unique id and broadcasts it over
    /// `host`. A collective: every rank of `host` calls it. Fails on every rank, with the
    /// reason, when rank 0 cannot load NCCL; a rank that cannot fails alone and its peers
    /// learn it from their next host collective.
    pub fn new(host: Arc<dyn Communicator>, ordinal: usize) -> Result<Self> {
        let rank = host.rank();
        let err = |detail: String| CommError::Device {
            rank,
            op: "nccl init",
            detail,
        };
        let id = bootstrap_id::<128>(host.as_ref(), || {
            if !nccl_available() {
                return Err("the CUDA driver or libnccl cannot be loaded on this machine".into());
            }
            let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
            Ok(id.internal().map(|c| c as u8))
        })?;
        if !nccl_available() {
            return Err(err(
                "the CUDA driver or libnccl cannot be loaded on this machine".into(),
            ));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| err(format!("CUDA device {ordinal}: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| err(format!("a stream on CUDA device {ordinal}: {e:?}")))?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, host.world_size(), id)
            .map_err(|e| err(format!("ncclCommInitRank: {e:?}")))?;
        Ok(Self {
            host,
            comm: Mutex::new(Shared(comm)),
            stream,
            ordinal,
            shortcut: true,
        })
    }

    /// Runs every collective through NCCL, also at one rank (for tests of NCCL itself).
    pub fn without_shortcut(mut self) -> Self {
        self.shortcut = false;
        self
    }

    /// A world of one rank: every collective is the identity on its input (after the argument
    /// checks), with no synchronisation of Burn's queue or the NCCL stream.
    fn alone(&self) -> bool {
        self.shortcut && self.host.world_size() == 1
    }

    fn error(&self, op: &'static str, detail: String) -> CommError {
        CommError::Device {
            rank: self.host.rank(),
            op,
            detail,
        }
    }

    /// The tensor's buffer, contiguous, on this rank's CUDA device, with Burn's work on it
    /// finished.
    fn lend(&self, op: &'static str, t: Tensor<1>) -> Result<Lent> {
        check_dtype(self.host.rank(), op, t.dtype())?;
        let (len, device) = (t.dims()[0], t.device());
        let prim = t.try_into_primitive::<Cube>().map_err(|e| {
            self.error(
                op,
                format!("NCCL moves CUDA tensors without autodiff: {e:?}"),
            )
        })?;
        self.lend_primitive(op, prim, &device, len)
    }

    /// A u32 word tensor's buffer, as [`lend`](Self::lend).
    fn lend_words(&self, op: &'static str, t: Tensor<1, Int>) -> Result<Lent> {
        check_words(self.host.rank(), op, t.dtype())?;
        let (len, device) = (t.dims()[0], t.device());
        let prim = t
            .try_into_primitive::<Cube>()
            .map_err(|e| self.error(op, format!("NCCL moves CUDA tensors: {e:?}")))?;
        self.lend_primitive(op, prim, &device, len)
    }

    fn lend_primitive(
        &self,
        op: &'static str,
        prim: CubeTensor,
        device: &Device,
        len: usize,
    ) -> Result<Lent> {
        let tensor = into_contiguous(prim);
        device
            .sync()
            .map_err(|e| self.error(op, format!("finishing Burn's queued work: {e:?}")))?;
        let held = tensor
            .client
            .get_resource::<CudaServer>(tensor.handle.clone())
            .map_err(|e| self.error(op, format!("not a CUDA buffer: {e:?}")))?;
        let ptr = held.resource().ptr;
        Ok(Lent {
            tensor,
            _held: Box::new(held),
            ptr,
            len,
        })
    }

    /// A new buffer of `n` elements like `like`, lent.
    fn output(&self, op: &'static str, dtype: DType, device: &Device, n: usize) -> Result<Lent> {
        self.lend(op, Tensor::<1>::empty([n], (device, dtype)))
    }

    /// Runs `f` on the NCCL communicator and waits for the stream.
    fn post(
        &self,
        op: &'static str,
        f: impl FnOnce(&Comm) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let comm = self
            .comm
            .lock()
            .map_err(|_| self.error(op, "a previous collective panicked".into()))?;
        f(&comm.0).map_err(|e| self.error(op, e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.error(op, format!("waiting for the NCCL stream: {e:?}")))
    }

    /// A lent buffer as a cudarc slice that is never freed (the memory is Burn's).
    ///
    /// # Safety
    /// `ptr` holds `len` elements of `T` on this rank's device, and stays allocated while the
    /// slice is used.
    unsafe fn slice<T>(&self, ptr: u64, len: usize) -> ManuallyDrop<CudaSlice<T>> {
        // SAFETY: the caller's contract.
        ManuallyDrop::new(unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) })
    }

    fn typed<T: NcclType>(
        &self,
        bufs: &[(u64, usize)],
        f: impl FnOnce(&Comm, &mut [ManuallyDrop<CudaSlice<T>>]) -> std::result::Result<(), String>,
        comm: &Comm,
    ) -> std::result::Result<(), String> {
        // SAFETY: every (ptr, len) comes from a `Lent` alive in the caller.
        let mut slices: Vec<_> = bufs
            .iter()
            .map(|&(p, n)| unsafe { self.slice::<T>(p, n) })
            .collect();
        let result = f(comm, &mut slices);
        for s in slices {
            // Hands the address back without freeing it.
            ManuallyDrop::into_inner(s).leak();
        }
        result
    }

    /// Posts `f` with the lent buffers as slices of their dtype.
    fn run(
        &self,
        op: &'static str,
        dtype: DType,
        raw: &[(u64, usize)],
        f: impl Fn(&Comm, &mut [ManuallyDrop<CudaSlice<f32>>]) -> std::result::Result<(), String> + Copy,
        f16: impl Fn(
            &Comm,
            &mut [ManuallyDrop<CudaSlice<half::f16>>],
        ) -> std::result::Result<(), String>
        + Copy,
        bf16: impl Fn(
            &Comm,
            &mut [ManuallyDrop<CudaSlice<half::bf16>>],
        ) -> std::result::Result<(), String>
        + Copy,
    ) -> Result<()> {
        self.post(op, |comm| match dtype {
            DType::F16 => self.typed(raw, f16, comm),
            DType::BF16 => self.typed(raw, bf16, comm),
            _ => self.typed(raw, f, comm),
        })
    }

    /// The buffer's address and length.
    fn raw(lent: &Lent) -> (u64, usize) {
        (lent.ptr, lent.len)
    }

    fn back(lent: Lent) -> Tensor<1> {
        Tensor::from_primitive::<Cube>(lent.tensor)
    }

    fn back_words(lent: Lent) -> Tensor<1, Int> {
        Tensor::<1, Int>::from_primitive::<Cube>(lent.tensor)
    }

    /// A new u32 buffer of `n` words on `device`, lent.
    fn output_words(&self, op: &'static str, device: &Device, n: usize) -> Result<Lent> {
        self.lend_words(op, Tensor::<1, Int>::empty([n], (device, DType::U32)))
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Mean => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

/// The views of an all-to-all: `world` chunks of `chunk` elements of `width` bytes of the
/// input, then of the output.
fn chunk_views(
    input: &Lent,
    out: &Lent,
    world: usize,
    chunk: usize,
    width: u64,
) -> Vec<(u64, usize)> {
    let chunks = |ptr: u64| (0..world).map(move |j| (ptr + (j * chunk) as u64 * width, chunk));
    chunks(input.ptr).chain(chunks(out.ptr)).collect()
}

/// One group of sends and receives, one pair per rank (this rank's own included), on the
/// disjoint chunk views of [`chunk_views`]: the first `world` are sent, the rest received.
fn exchange_chunks<T: NcclType>(
    comm: &Comm,
    s: &mut [ManuallyDrop<CudaSlice<T>>],
    world: usize,
) -> std::result::Result<(), String> {
    let (srcs, dsts) = s.split_at_mut(world);
    let mut group = comm.group();
    for (peer, (src, dst)) in srcs.iter().zip(dsts.iter_mut()).enumerate() {
        group.send(src.slice(..), peer as i32).map_err(e)?;
        group
            .recv(dst.slice_mut(..), peer as i32)
            .map(drop)
            .map_err(e)?;
    }
    drop(group);
    Ok(())
}

fn e<E: std::fmt::Debug>(x: E) -> String {
    format!("{x:?}")
}

/// The same closure for every element type.
macro_rules! each_dtype {
    (|$c:ident, $s:ident| $body:expr) => {
        (
            |$c: &Comm, $s: &mut [ManuallyDrop<CudaSlice<f32>>]| $body,
            |$c: &Comm, $s: &mut [ManuallyDrop<CudaSlice<half::f16>>]| $body,
            |$c: &Comm, $s: &mut [ManuallyDrop<CudaSlice<half::bf16>>]| $body,
        )
    };
}

impl DeviceCollectives for NcclCollectives {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn kind(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
        if self.alone() {
            check_dtype(self.rank(), "all_reduce", t.dtype())?;
            return Ok(t);
        }
        let (dtype, device, n) = (t.dtype(), t.device(), t.dims()[0]);
        let input = self.lend("all_reduce", t)?;
        let out = self.output("all_reduce", dtype, &device, n)?;
        let nop = nccl_op(op);
        let (a, b, c) = each_dtype!(|comm, s| {
            let (src, dst) = s.split_at_mut(1);
            comm.all_reduce(&*src[0], &mut *dst[0], &nop)
                .map(drop)
                .map_err(e)
        });
        self.run(
            "all_reduce",
            dtype,
            &[Self::raw(&input), Self::raw(&out)],
            a,
            b,
            c,
        )?;
        Ok(Self::back(out))
    }

    fn reduce_scatter(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        let (rank, world) = (self.rank(), self.world_size());
        check_counts(rank, world, "reduce_scatter", counts, t.dims()[0])?;
        if self.alone() {
            check_dtype(rank, "reduce_scatter", t.dtype())?;
            return Ok(t);
        }
        let (dtype, device) = (t.dtype(), t.device());
        let m = counts.iter().copied().max().unwrap_or(0);
        // NCCL splits evenly: uneven chunks are padded to the largest on the device.
        let padded = if counts.iter().all(|&c| c == m) {
            t
        } else {
            let mut start = 0;
            let parts = counts
                .iter()
                .map(|&c| {
                    let part = t.clone().slice(start..start + c);
                    start += c;
                    if c == m {
                        part
                    } else {
                        Tensor::cat(vec![part, Tensor::zeros([m - c], (&device, dtype))], 0)
                    }
                })
                .collect();
            Tensor::cat(parts, 0)
        };
        let input = self.lend("reduce_scatter", padded)?;
        let out = self.output("reduce_scatter", dtype, &device, m)?;
        let sum = cudarc::nccl::ReduceOp::Sum;
        let (a, b, c) = each_dtype!(|comm, s| {
            let (src, dst) = s.split_at_mut(1);
            comm.reduce_scatter(&*src[0], &mut *dst[0], &sum)
                .map(drop)
                .map_err(e)
        });
        self.run(
            "reduce_scatter",
            dtype,
            &[Self::raw(&input), Self::raw(&out)],
            a,
            b,
            c,
        )?;
        Ok(Self::back(out).slice(0..counts[rank]))
    }

    fn all_gather(&self, t: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        let (rank, world) = (self.rank(), self.world_size());
        check_counts(rank, world, "all_gather", counts, t.dims()[0])?;
        if self.alone() {
            check_dtype(rank, "all_gather", t.dtype())?;
            return Ok(t);
        }
        let (dtype, device) = (t.dtype(), t.device());
        let m = counts.iter().copied().max().unwrap_or(0);
        let even = counts.iter().all(|&c| c == m);
        let mine = if counts[rank] == m {
            t
        } else {
            Tensor::cat(
                vec![t, Tensor::zeros([m - counts[rank]], (&device, dtype))],
                0,
            )
        };
        let input = self.lend("all_gather", mine)?;
        let out = self.output("all_gather", dtype, &device, m * world)?;
        let (a, b, c) = each_dtype!(|comm, s| {
            let (src, dst) = s.split_at_mut(1);
            comm.all_gather(&*src[0], &mut *dst[0]).map(drop).map_err(e)
        });
        self.run(
            "all_gather",
            dtype,
            &[Self::raw(&input), Self::raw(&out)],
            a,
            b,
            c,
        )?;
        let whole = Self::back(out);
        if even {
            return Ok(whole);
        }
        let parts = counts
            .iter()
            .enumerate()
            .map(|(r, &c)| whole.clone().slice(r * m..r * m + c))
            .collect();
        Ok(Tensor::cat(parts, 0))
    }

    fn broadcast(&self, t: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        check_peer(self.rank(), self.world_size(), "broadcast", root, true)?;
        if self.alone() {
            check_dtype(self.rank(), "broadcast", t.dtype())?;
            return Ok(t);
        }
        let (dtype, device, n) = (t.dtype(), t.device(), t.dims()[0]);
        let input = self.lend("broadcast", t)?;
        let out = self.output("broadcast", dtype, &device, n)?;
        let root = root as i32;
        let (a, b, c) = each_dtype!(|comm, s| {
            let (src, dst) = s.split_at_mut(1);
            comm.broadcast(Some(&*src[0]), &mut *dst[0], root)
                .map(drop)
                .map_err(e)
        });
        self.run(
            "broadcast",
            dtype,
            &[Self::raw(&input), Self::raw(&out)],
            a,
            b,
            c,
        )?;
        Ok(Self::back(out))
    }

    fn all_to_all(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let (rank, world) = (self.rank(), self.world_size());
        let n = t.dims()[0];
        check_equal_chunks(rank, world, n)?;
        if self.alone() {
            check_dtype(rank, "all_to_all", t.dtype())?;
            return Ok(t);
        }
        let (dtype, device) = (t.dtype(), t.device());
        let chunk = n / world;
        let input = self.lend("all_to_all", t)?;
        let out = self.output("all_to_all", dtype, &device, n)?;
        let width = if dtype == DType::F32 { 4 } else { 2 };
        let raw = chunk_views(&input, &out, world, chunk, width);
        let (a, b, c) = each_dtype!(|comm, s| exchange_chunks(comm, s, world));
        self.run("all_to_all", dtype, &raw, a, b, c)?;
        Ok(Self::back(out))
    }

    fn send(&self, t: Tensor<1>, dst: usize, _tag: u16) -> Result<()> {
        check_peer(self.rank(), self.world_size(), "send", dst, false)?;
        let dtype = t.dtype();
        let input = self.lend("send", t)?;
        let peer = dst as i32;
        let (a, b, c) = each_dtype!(|comm, s| comm.send(&*s[0], peer).map_err(e));
        self.run("send", dtype, &[Self::raw(&input)], a, b, c)
    }

    fn recv(&self, like: Tensor<1>, src: usize, _tag: u16) -> Result<Tensor<1>> {
        check_peer(self.rank(), self.world_size(), "recv", src, false)?;
        let (dtype, device, n) = (like.dtype(), like.device(), like.dims()[0]);
        let out = self.output("recv", dtype, &device, n)?;
        let peer = src as i32;
        let (a, b, c) = each_dtype!(|comm, s| comm.recv(&mut *s[0], peer).map(drop).map_err(e));
        self.run("recv", dtype, &[Self::raw(&out)], a, b, c)?;
        Ok(Self::back(out))
    }

    fn all_to_all_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        let (rank, world) = (self.rank(), self.world_size());
        let n = t.dims()[0];
        check_equal_chunks(rank, world, n)?;
        if self.alone() {
            check_words(rank, "all_to_all_words", t.dtype())?;
            return Ok(t);
        }
        let device = t.device();
        let chunk = n / world;
        let input = self.lend_words("all_to_all_words", t)?;
        let out = self.output_words("all_to_all_words", &device, n)?;
        let raw = chunk_views(&input, &out, world, chunk, 4);
        self.post("all_to_all_words", |comm| {
            self.typed::<u32>(&raw, |comm, s| exchange_chunks(comm, s, world), comm)
        })?;
        Ok(Self::back_words(out))
    }

    fn all_gather_words(&self, t: Tensor<1, Int>) -> Result<Tensor<1, Int>> {
        if self.alone() {
            check_words(self.rank(), "all_gather_words", t.dtype())?;
            return Ok(t);
        }
        let (n, device) = (t.dims()[0], t.device());
        let input = self.lend_words("all_gather_words", t)?;
        let out = self.output_words("all_gather_words", &device, n * self.world_size())?;
        let raw = [Self::raw(&input), Self::raw(&out)];
        self.post("all_gather_words", |comm| {
            self.typed::<u32>(
                &raw,
                |comm, s| {
                    let (src, dst) = s.split_at_mut(1);
                    comm.all_gather(&*src[0], &mut *dst[0]).map(drop).map_err(e)
                },
                comm,
            )
        })?;
        Ok(Self::back_words(out))
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn abort(&self, reason: &str) {
        self.host.abort(reason);
    }

    fn traffic(&self) -> DeviceTraffic {
        DeviceTraffic::default()
    }
}
