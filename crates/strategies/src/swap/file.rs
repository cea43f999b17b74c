//! [`SwapFile`]: one swap file, read and written in [`AioOptions::block_size`] requests with
//! `O_DIRECT`, through io_uring (`queue_depth` in flight) or `pread`/`pwrite`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{ALIGN, AioOptions, IoEngine};
use crate::{CommError, Result};

/// A file of swapped state. Offsets, lengths and buffers are [`ALIGN`]ed; a transfer is cut
/// into [`AioOptions::block_size`] requests, spread over `intra_op_parallelism` threads.
/// The file is removed when this is dropped (with its folder, when [`fresh_dir`](super::fresh_dir)
/// made it and it is empty then).
#[derive(Debug)]
pub struct SwapFile {
    file: File,
    path: PathBuf,
    engine: IoEngine,
    aio: AioOptions,
    direct: bool,
    /// The fault a test armed for this file (see [`inject_swap_fault`](super::inject_swap_fault)).
    #[cfg(all(target_os = "linux", any(test, feature = "fault-injection")))]
    faults: super::fault::FaultCounter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Read => "read",
            Dir::Write => "write",
        }
    }
}

/// A region of a caller's buffer and where it goes in the file.
#[derive(Clone, Copy)]
struct Span {
    ptr: *mut u8,
    len: usize,
    offset: u64,
}

// SAFETY: a span is only used while the buffer it points into is borrowed by the transfer
// that made it, and parts of one transfer never overlap.
unsafe impl Send for Span {}

impl SwapFile {
    /// Creates `path` with `bytes` bytes reserved on the disk, opened with `O_DIRECT` where
    /// the filesystem accepts it (tmpfs does not: there it is opened buffered, and
    /// [`is_direct`](Self::is_direct) says so). The file must not exist: an existing file
    /// (another store's) or a link is an error, never truncated or followed.
    pub fn create(path: &Path, bytes: u64, engine: IoEngine, aio: AioOptions) -> Result<Self> {
        let err = |op: &'static str| {
            move |source: io::Error| CommError::Swap {
                path: path.to_path_buf(),
                op,
                source,
            }
        };
        let (file, direct) = open(path).map_err(err("create"))?;
        reserve(&file, bytes).map_err(err("reserve space for"))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            engine,
            aio,
            direct,
            #[cfg(all(target_os = "linux", any(test, feature = "fault-injection")))]
            faults: super::fault::FaultCounter::for_path(path),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether transfers bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The engine moving the bytes.
    pub fn engine(&self) -> IoEngine {
        self.engine
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let span = Span {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            offset,
        };
        self.transfer(Dir::Read, span)
    }

    /// Writes `buf` at `offset`.
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let span = Span {
            ptr: buf.as_ptr().cast_mut(),
            len: buf.len(),
            offset,
        };
        self.transfer(Dir::Write, span)
    }

    fn transfer(&self, dir: Dir, span: Span) -> Result<()> {
        #[cfg(all(target_os = "linux", any(test, feature = "fault-injection")))]
        {
            let on = match dir {
                Dir::Read => super::fault::FaultOn::Read,
                Dir::Write => super::fault::FaultOn::Write,
            };
            self.faults.count(on).map_err(|source| CommError::Swap {
                path: self.path.clone(),
                op: dir.name(),
                source,
            })?;
        }
        if !span.offset.is_multiple_of(ALIGN as u64)
            || !span.len.is_multiple_of(ALIGN)
            || !(span.ptr as usize).is_multiple_of(ALIGN)
        {
            return Err(CommError::InvalidArgument {
                rank: 0,
                op: "swap transfer",
                detail: format!(
                    "{} of {} bytes at offset {} from {:p}: offsets, lengths and buffers must \
                     be {ALIGN}-byte aligned",
                    dir.name(),
                    span.len,
                    span.offset,
                    span.ptr
                ),
            });
        }
        let block = self.aio.block_bytes();
        let threads = self.aio.intra_op_parallelism.max(1);
        let part = span.len.div_ceil(threads).div_ceil(block).max(1) * block;
        let parts: Vec<Span> = (0..span.len)
            .step_by(part)
            .map(|at| Span {
                // SAFETY: `at < span.len`, inside the caller's buffer.
                ptr: unsafe { span.ptr.add(at) },
                len: part.min(span.len - at),
                offset: span.offset + at as u64,
            })
            .collect();
        let result = if parts.len() <= 1 {
            parts.iter().try_for_each(|&p| self.run(dir, p))
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = parts
                    .iter()
                    .map(|&p| s.spawn(move || self.run(dir, p)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(io::Error::other("panicked")))
                    })
                    .collect::<io::Result<Vec<()>>>()
                    .map(drop)
            })
        };
        result.map_err(|source| CommError::Swap {
            path: self.path.clone(),
            op: dir.name(),
            source,
        })
    }

    fn run(&self, dir: Dir, span: Span) -> io::Result<()> {
        match self.engine {
            #[cfg(target_os = "linux")]
            IoEngine::Uring => self.uring(dir, span),
            #[cfg(not(target_os = "linux"))]
            IoEngine::Uring => Err(io::Error::other("io_uring needs Linux")),
            IoEngine::Pread => self.pread(dir, span),
        }
    }

    /// One block at a time with `pread`/`pwrite`.
    fn pread(&self, dir: Dir, span: Span) -> io::Result<()> {
        let block = self.aio.block_bytes();
        for at in (0..span.len).step_by(block) {
            let n = block.min(span.len - at);
            let offset = span.offset + at as u64;
            // SAFETY: `at + n <= span.len`, inside the buffer the transfer borrows.
            match dir {
                Dir::Read => self.file.read_exact_at(
                    unsafe { std::slice::from_raw_parts_mut(span.ptr.add(at), n) },
                    offset,
                )?,
                Dir::Write => self.file.write_all_at(
                    unsafe { std::slice::from_raw_parts(span.ptr.add(at), n) },
                    offset,
                )?,
            }
        }
        Ok(())
    }

    /// Up to `queue_depth` blocks in flight on a ring of this thread's own, refilled per
    /// completion (`overlap_events`) or per batch, submitted per request (`single_submit`) or
    /// per batch. Every request in flight completes before this returns, error or not, so the
    /// kernel never writes into a buffer the caller has got back.
    #[cfg(target_os = "linux")]
    fn uring(&self, dir: Dir, span: Span) -> io::Result<()> {
        use io_uring::{IoUring, opcode, types};
        use std::os::fd::AsRawFd;

        let depth = self.aio.queue_depth.clamp(1, 1024);
        let mut ring = IoUring::new((depth as u32).next_power_of_two())?;
        let fd = types::Fd(self.file.as_raw_fd());
        let block = self.aio.block_bytes();
        let blocks = span.len.div_ceil(block);
        let len_of = |i: usize| block.min(span.len - i * block);
        let (mut next, mut inflight, mut done) = (0usize, 0usize, 0usize);
        let mut failure: Option<io::Error> = None;
        while done < blocks && (failure.is_none() || inflight > 0) {
            while failure.is_none() && inflight < depth && next < blocks {
                let at = next * block;
                // SAFETY: `at < span.len`: inside the buffer.
                let ptr = unsafe { span.ptr.add(at) };
                let n = len_of(next) as u32;
                let offset = span.offset + at as u64;
                let entry = match dir {
                    Dir::Read => opcode::Read::new(fd, ptr, n).offset(offset).build(),
                    Dir::Write => opcode::Write::new(fd, ptr, n).offset(offset).build(),
                }
                .user_data(next as u64);
                // SAFETY: the buffer outlives the request: we wait for every completion.
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    break;
                }
                next += 1;
                inflight += 1;
                if self.aio.single_submit
                    && let Err(e) = ring.submit()
                {
                    failure.get_or_insert(e);
                }
            }
            if inflight == 0 {
                break;
            }
            let want = if self.aio.overlap_events { 1 } else { inflight };
            if let Err(e) = ring.submit_and_wait(want) {
                match e.raw_os_error() {
                    Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN) => continue,
                    // The requests in flight still point into the caller's buffer, and there
                    // is no way left to wait for them: returning would be unsound.
                    _ => {
                        // `eprintln!` panics when stderr is gone, and a panic would unwind
                        // with the requests still writing into the buffer: write or not, then
                        // abort.
                        use std::io::Write;
                        let _ = writeln!(
                            std::io::stderr(),
                            "io_uring wait failed with {inflight} requests in flight: {e}"
                        );
                        std::process::abort();
                    }
                }
            }
            for cqe in ring.completion() {
                inflight -= 1;
                done += 1;
                let expected = len_of(cqe.user_data() as usize);
                let got = cqe.result();
                if got < 0 {
                    failure.get_or_insert(io::Error::from_raw_os_error(-got));
                } else if got as usize != expected {
                    failure.get_or_insert(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "short {}: {got} of {expected} bytes at offset {}",
                            dir.name(),
                            span.offset + cqe.user_data() * block as u64
                        ),
                    ));
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            super::run_dir::release_dir(dir);
        }
    }
}

/// Creates `path` for swapping, where nothing was (`O_EXCL`, and `O_NOFOLLOW`: a link in its
/// place is not followed), then turns `O_DIRECT` on where the filesystem accepts it.
fn open(path: &Path) -> io::Result<(File, bool)> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create_new(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW);
        let file = options.open(path)?;
        let fd = file.as_raw_fd();
        // SAFETY: plain system calls on a descriptor this function owns.
        let direct = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) == 0
        };
        Ok((file, direct))
    }
    #[cfg(not(target_os = "linux"))]
    options.open(path).map(|f| (f, false))
}

/// Sizes the file to `bytes` and reserves its blocks, so that a full disk is found now and
/// not in the middle of a step.
fn reserve(file: &File, bytes: u64) -> io::Result<()> {
    file.set_len(bytes)?;
    #[cfg(target_os = "linux")]
    if bytes > 0 {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(bytes).map_err(io::Error::other)?;
        // SAFETY: a plain system call on an open descriptor.
        let code = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        if code != 0 && code != libc::EOPNOTSUPP {
            return Err(io::Error::from_raw_os_error(code));
        }
    }
    Ok(())
}

/// Refuses, naming `dir` and both sizes, a swap file of `needed` bytes in a folder with less
/// free space (checked up front, before anything is written).
pub fn ensure_space(dir: &Path, needed: u64) -> Result<()> {
    let free = free_bytes(dir)?;
    if needed <= free {
        return Ok(());
    }
    Err(CommError::Swap {
        path: dir.to_path_buf(),
        op: "reserve space in",
        source: io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "the swapped state needs {needed} bytes ({:.2} GB) and the disk has {free} \
                 bytes ({:.2} GB) free",
                needed as f64 / 1e9,
                free as f64 / 1e9
            ),
        ),
    })
}

/// Bytes free for an unprivileged user on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    let err = |source| CommError::Swap {
        path: dir.to_path_buf(),
        op: "measure free space of",
        source,
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(io::Error::other);
        let c = c.map_err(err)?;
        // SAFETY: `stat` is plain old data, filled by the call; `c` is NUL-terminated.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
            return Err(err(io::Error::last_os_error()));
        }
        Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = dir;
        Ok(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swap::AlignedBuf;

    /// Every engine and queue setting writes and reads back the same bytes, in blocks that do
    /// not divide the transfer, on one or several threads.
    #[test]
    fn bytes_round_trip_on_every_engine_and_setting() {
        let dir = tempfile::tempdir().unwrap();
        for engine in crate::swap::engines_here() {
            for (block, depth, threads, single, overlap) in [
                (4096, 1, 1, false, true),
                (8192, 3, 1, true, false),
                (4096, 8, 3, false, true),
                (1 << 20, 8, 2, false, false),
            ] {
                let aio = AioOptions {
                    block_size: block,
                    queue_depth: depth,
                    intra_op_parallelism: threads,
                    single_submit: single,
                    overlap_events: overlap,
                };
                let path = dir
                    .path()
                    .join(format!("{}-{block}-{threads}", engine.name()));
                let bytes = 11 * ALIGN;
                let file = SwapFile::create(&path, 2 * bytes as u64, engine, aio).unwrap();
                let mut out = AlignedBuf::new(bytes);
                for (i, b) in out.bytes_mut().iter_mut().enumerate() {
                    *b = (i * 7 + 3) as u8;
                }
                file.write(bytes as u64, out.bytes()).unwrap();
                let mut back = AlignedBuf::new(bytes);
                file.read(bytes as u64, back.bytes_mut()).unwrap();
                assert_eq!(back.bytes(), out.bytes(), "{engine:?} {aio:?}");
                let mut head = AlignedBuf::new(ALIGN);
                file.read(0, head.bytes_mut()).unwrap();
                assert!(head.bytes().iter().all(|&b| b == 0));
                drop(file);
                assert!(!path.exists(), "the swap file is removed with its owner");
            }
        }
    }

    #[test]
    fn unaligned_transfers_and_reads_past_the_end_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for engine in crate::swap::engines_here() {
            let path = dir.path().join(engine.name());
            let file =
                SwapFile::create(&path, ALIGN as u64, engine, AioOptions::default()).unwrap();
            let mut buf = AlignedBuf::new(2 * ALIGN);
            let e = file.read(100, buf.bytes_mut()).unwrap_err().to_string();
            assert!(e.contains("aligned"), "{e}");
            let e = file
                .read(0, &mut buf.bytes_mut()[..100])
                .unwrap_err()
                .to_string();
            assert!(e.contains("aligned"), "{e}");
            let e = file.read(0, buf.bytes_mut()).unwrap_err().to_string();
            assert!(e.contains("read failed"), "{engine:?}: {e}");
        }
    }

    /// A swap file is made where nothing was: an existing file (another store's) or a link
    /// in its place is an error, and the other file keeps its bytes.
    #[test]
    fn an_existing_file_or_link_is_never_truncated_or_followed() {
        let dir = tempfile::tempdir().unwrap();
        let theirs = dir.path().join("rank0.swp");
        std::fs::write(&theirs, b"another job's state").unwrap();
        let e = SwapFile::create(&theirs, 4096, IoEngine::Pread, AioOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank0.swp") && e.contains("create"), "{e}");
        let link = dir.path().join("link.swp");
        std::os::unix::fs::symlink(&theirs, &link).unwrap();
        assert!(SwapFile::create(&link, 4096, IoEngine::Pread, AioOptions::default()).is_err());
        assert_eq!(std::fs::read(&theirs).unwrap(), b"another job's state");
    }

    #[test]
    fn a_missing_folder_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/folder/swap");
        let e = SwapFile::create(&path, 4096, IoEngine::Pread, AioOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no/such/folder") && e.contains("create"), "{e}");
        assert!(free_bytes(dir.path()).unwrap() > 0);
    }
}
