//! [`SwapStore`]: a flat state of several fields kept in a [`SwapFile`] and visited tile by
//! tile, with the read of tile i+1 and the write of tile i-1 overlapping the work on tile i
//! (DeepSpeed's `pipeline_read` and `pipeline_write`).

use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::{AioOptions, AlignedBuf, IoEngine, SwapFile, TilePlan, ensure_space};
use crate::{CommError, Result};

/// How a [`SwapStore`] moves its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapOptions {
    /// Request size and queueing.
    pub aio: AioOptions,
    /// The system calls.
    pub engine: IoEngine,
    /// Read the next tile while the current one is worked on (one more tile buffer).
    pub pipeline_read: bool,
    /// Write the previous tile while the current one is worked on (one more tile buffer).
    pub pipeline_write: bool,
}

/// Bytes moved and time spent in transfers, measured where they happen.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SwapStats {
    /// Bytes read from the file.
    pub bytes_read: u64,
    /// Bytes written to the file.
    pub bytes_written: u64,
    /// Seconds spent in reads (summed over transfers, overlapped or not).
    pub read_secs: f64,
    /// Seconds spent in writes.
    pub write_secs: f64,
}

/// What a swapped state looks like from outside: where its bytes go and how fast they moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwapSummary {
    /// The engine moving the bytes.
    pub engine: IoEngine,
    /// Whether transfers bypass the page cache (`O_DIRECT`).
    pub direct: bool,
    /// Bytes of the swap file.
    pub disk_bytes: u64,
    /// Bytes of host memory the tile buffers hold.
    pub buffer_bytes: u64,
    /// Transfers so far.
    pub stats: SwapStats,
}

/// Timed transfers on a [`SwapFile`]: the bytes moved and the time spent, counted where each
/// transfer happens (shared by threads transferring at once).
#[derive(Debug, Default)]
pub struct TransferCounters {
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    read_ns: AtomicU64,
    write_ns: AtomicU64,
}

impl TransferCounters {
    /// Reads `buf.len()` bytes at `offset` of `file` into `buf`, counted.
    pub fn read(&self, file: &SwapFile, offset: u64, buf: &mut [u8]) -> Result<()> {
        let start = Instant::now();
        file.read(offset, buf)?;
        self.read_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.bytes_read
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `buf` at `offset` of `file`, counted.
    pub fn write(&self, file: &SwapFile, offset: u64, buf: &[u8]) -> Result<()> {
        let start = Instant::now();
        file.write(offset, buf)?;
        self.write_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.bytes_written
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The transfers so far.
    pub fn stats(&self) -> SwapStats {
        SwapStats {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            read_secs: self.read_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            write_secs: self.write_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// A state of [`TilePlan::fields`] `f32` fields of [`TilePlan::len`] elements each, in a
/// swap file. Memory held: one tile record, or up to three (one per tile) when reads or writes
/// are pipelined.
#[derive(Debug)]
pub struct SwapStore {
    file: SwapFile,
    plan: TilePlan,
    options: SwapOptions,
    bufs: [AlignedBuf; 3],
    counters: TransferCounters,
    /// Why the state in the file is no longer one state: a pass that writes tiles stopped
    /// part way (some tiles new, the rest old). Every later read or update is refused until a
    /// whole new state is written ([`fill`](Self::fill), [`write_all`](Self::write_all)).
    broken: Option<String>,
}

impl SwapStore {
    /// Creates the swap file `path` for `plan`, zeroed. Refused, naming the folder, when the
    /// folder is missing or not writable, or has less free space than the file needs.
    pub fn create(path: &Path, plan: TilePlan, options: SwapOptions) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let needed = plan.file_bytes();
        ensure_space(dir, needed)?;
        let file = SwapFile::create(path, needed, options.engine, options.aio)?;
        let record = plan.record_bytes();
        // Pipelining cycles through three buffers, of which a state of one or two tiles
        // touches only as many.
        let pipelined = options.pipeline_read || options.pipeline_write;
        let spare = |k: usize| {
            AlignedBuf::new(if pipelined && plan.count() > k {
                record
            } else {
                0
            })
        };
        Ok(Self {
            file,
            plan,
            options,
            bufs: [AlignedBuf::new(record), spare(1), spare(2)],
            counters: TransferCounters::default(),
            broken: None,
        })
    }

    /// The layout.
    pub fn plan(&self) -> TilePlan {
        self.plan
    }

    /// The file.
    pub fn file(&self) -> &SwapFile {
        &self.file
    }

    /// Bytes the state occupies on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.plan.file_bytes()
    }

    /// Bytes of host memory held (the tile buffers).
    pub fn buffer_bytes(&self) -> u64 {
        self.bufs.iter().map(|b| b.len() as u64).sum()
    }

    /// Its size, engine and transfers so far.
    pub fn summary(&self) -> SwapSummary {
        SwapSummary {
            engine: self.file.engine(),
            direct: self.file.is_direct(),
            disk_bytes: self.disk_bytes(),
            buffer_bytes: self.buffer_bytes(),
            stats: self.stats(),
        }
    }

    /// Transfers so far.
    pub fn stats(&self) -> SwapStats {
        self.counters.stats()
    }

    /// Writes whole fields: `fields[f]` holds [`TilePlan::len`] elements, or is `None` for
    /// zeros.
    pub fn write_all(&mut self, fields: &[Option<&[f32]>]) -> Result<()> {
        let plan = self.plan;
        for (f, values) in fields.iter().enumerate() {
            if let Some(v) = values
                && (v.len() != plan.len() || f >= plan.fields())
            {
                return Err(CommError::InvalidArgument {
                    rank: 0,
                    op: "swap write",
                    detail: format!(
                        "field {f} of {} elements; the store has {} fields of {}",
                        v.len(),
                        plan.fields(),
                        plan.len()
                    ),
                });
            }
        }
        self.fill(|_, range, out| {
            for (f, values) in fields.iter().enumerate() {
                if let Some(v) = values {
                    out[f].copy_from_slice(&v[range.clone()]);
                }
            }
            Ok(())
        })
    }

    /// Writes every tile in order: `fill(i, elements, fields)` gets the tile's fields, zeroed,
    /// to fill (each `elements.len()` long). Nothing is read, and only one tile's record is
    /// in memory: a state larger than RAM is written from a source read piece by piece.
    /// A pass that stops part way leaves the store refusing reads and updates until a whole
    /// state is written again.
    pub fn fill(
        &mut self,
        fill: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<()>,
    ) -> Result<()> {
        let filled = self.fill_tiles(fill);
        self.broken = filled.as_ref().err().map(ToString::to_string);
        filled
    }

    fn fill_tiles(
        &mut self,
        mut fill: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<()>,
    ) -> Result<()> {
        let plan = self.plan;
        for i in 0..plan.count() {
            let range = plan.range(i);
            let buf = &mut self.bufs[0];
            buf.floats_mut().fill(0.0);
            let mut fields = fields_of(plan, buf, range.len());
            fill(i, range, &mut fields)?;
            write(&self.file, &self.counters, plan, i, &self.bufs[0])?;
        }
        Ok(())
    }

    /// Reads the fields `which` whole, one pass over the file.
    pub fn read_fields(&self, which: &[usize]) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Vec<f32>> = which
            .iter()
            .map(|_| Vec::with_capacity(self.plan.len()))
            .collect();
        self.read_tiles(which, |_, fields| {
            out.iter_mut()
                .zip(fields)
                .for_each(|(o, f)| o.extend_from_slice(f));
            Ok::<(), CommError>(())
        })?;
        Ok(out)
    }

    /// Reads every tile in order, one pass over the file, and hands `visit(elements, fields)`
    /// the tile's fields `which` (each `elements.len()` long): only one tile is in memory.
    pub fn read_tiles<E: From<CommError>>(
        &self,
        which: &[usize],
        mut visit: impl FnMut(Range<usize>, &[&[f32]]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.check_whole()?;
        let plan = self.plan;
        let mut buf = AlignedBuf::new(plan.record_bytes());
        for i in 0..plan.count() {
            read(&self.file, &self.counters, plan, i, &mut buf)?;
            let range = plan.range(i);
            let n = range.len();
            let fields: Vec<&[f32]> = which
                .iter()
                .map(|&f| &buf.floats()[plan.at(f, 0)..plan.at(f, n)])
                .collect();
            visit(range, &fields)?;
        }
        Ok(())
    }

    /// Visits every tile in order: `work(i, elements, fields)` gets the tile's fields (each
    /// `elements.len()` long) to read and update, and the tile is written back. With
    /// pipelining, the next tile is read and the previous one written while `work` runs.
    /// Stops at the first error; tiles before it are written back, and the store then refuses
    /// every read and update until a whole state is written again (the file holds part of
    /// two states).
    pub fn update(
        &mut self,
        work: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<()>,
    ) -> Result<()> {
        self.check_whole()?;
        let updated = self.update_tiles(work);
        if let Err(e) = &updated {
            self.broken = Some(e.to_string());
        }
        updated
    }

    /// Refuses, with [`CommError::SwapInconsistent`], a state that a failed pass left part
    /// old, part new.
    pub fn check_whole(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(cause) => Err(CommError::SwapInconsistent {
                path: self.file.path().to_path_buf(),
                cause: cause.clone(),
            }),
        }
    }

    /// Whether a failed pass left the file part old, part new (see [`update`](Self::update)).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn update_tiles(
        &mut self,
        mut work: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<()>,
    ) -> Result<()> {
        let plan = self.plan;
        let n = plan.count();
        let (pr, pw) = (self.options.pipeline_read, self.options.pipeline_write);
        let (file, counters) = (&self.file, &self.counters);
        if n == 0 {
            return Ok(());
        }
        read(file, counters, plan, 0, &mut self.bufs[0])?;
        for i in 0..n {
            // Without pipelining every tile goes through the one full-sized buffer.
            let (cur, next, prev) = pick(&mut self.bufs, if pr || pw { i } else { 0 });
            if i > 0 && !pr {
                read(file, counters, plan, i, cur)?;
            }
            let range = plan.range(i);
            std::thread::scope(|s| {
                let reader =
                    (pr && i + 1 < n).then(|| s.spawn(|| read(file, counters, plan, i + 1, next)));
                let writer =
                    (pw && i > 0).then(|| s.spawn(|| write(file, counters, plan, i - 1, prev)));
                let worked = {
                    let mut fields = fields_of(plan, cur, range.len());
                    work(i, range.clone(), &mut fields)
                };
                let joined = [reader, writer].into_iter().flatten().map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CommError::Swap {
                            path: file.path().to_path_buf(),
                            op: "transfer (thread panicked)",
                            source: io::Error::other("panicked"),
                        })
                    })
                });
                joined.fold(worked, |acc, r| acc.and(r))
            })?;
            if !pw {
                write(file, counters, plan, i, cur)?;
            }
        }
        if pw {
            let (last, _, _) = pick(&mut self.bufs, n - 1);
            write(file, counters, plan, n - 1, last)?;
        }
        Ok(())
    }
}

/// Tile `i`'s buffer, the next tile's and the previous tile's: three distinct buffers.
fn pick(b: &mut [AlignedBuf; 3], i: usize) -> (&mut AlignedBuf, &mut AlignedBuf, &mut AlignedBuf) {
    let [x, y, z] = b;
    match i % 3 {
        0 => (x, y, z),
        1 => (y, z, x),
        _ => (z, x, y),
    }
}

/// The fields of a record holding `n` elements.
fn fields_of(plan: TilePlan, buf: &mut AlignedBuf, n: usize) -> Vec<&mut [f32]> {
    let stride = plan.field_bytes() / 4;
    buf.floats_mut()
        .chunks_mut(stride)
        .take(plan.fields())
        .map(|c| &mut c[..n])
        .collect()
}

fn read(
    file: &SwapFile,
    c: &TransferCounters,
    plan: TilePlan,
    i: usize,
    buf: &mut AlignedBuf,
) -> Result<()> {
    c.read(
        file,
        plan.offset(i),
        &mut buf.bytes_mut()[..plan.record_bytes()],
    )
}

fn write(
    file: &SwapFile,
    c: &TransferCounters,
    plan: TilePlan,
    i: usize,
    buf: &AlignedBuf,
) -> Result<()> {
    c.write(file, plan.offset(i), &buf.bytes()[..plan.record_bytes()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swap::ALIGN;

    fn options(engine: IoEngine, pr: bool, pw: bool) -> SwapOptions {
        SwapOptions {
            aio: AioOptions {
                block_size: 8192,
                ..AioOptions::default()
            },
            engine,
            pipeline_read: pr,
            pipeline_write: pw,
        }
    }

    /// An update visits every element once, in order, whatever the tiling and pipelining,
    /// and what it writes is what the next pass reads.
    #[test]
    fn updates_see_every_tile_once_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let len = 5000;
        let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
        for engine in crate::swap::engines_here() {
            for tile in [13, 1024, 1999, 5000, 9000] {
                for (pr, pw) in [(false, false), (true, false), (false, true), (true, true)] {
                    let plan = TilePlan::new(len, tile, 3);
                    let path = dir.path().join("state.swp");
                    let mut store =
                        SwapStore::create(&path, plan, options(engine, pr, pw)).unwrap();
                    store.write_all(&[Some(&a), None, Some(&a)]).unwrap();
                    let mut seen = Vec::new();
                    for pass in 0..2 {
                        store
                            .update(|i, r, f| {
                                assert_eq!(r, plan.range(i));
                                if pass == 0 {
                                    seen.extend(r.clone());
                                }
                                for (k, e) in r.enumerate() {
                                    assert_eq!(f[0][k], e as f32);
                                    assert_eq!(f[1][k], pass as f32);
                                    f[1][k] += 1.0;
                                    f[2][k] *= 2.0;
                                }
                                Ok(())
                            })
                            .unwrap();
                    }
                    assert_eq!(seen, (0..len).collect::<Vec<_>>());
                    let back = store.read_fields(&[1, 2]).unwrap();
                    assert!(back[0].iter().all(|&x| x == 2.0));
                    let quad: Vec<f32> = a.iter().map(|x| 4.0 * x).collect();
                    assert_eq!(back[1], quad, "{engine:?} tile {tile} {pr} {pw}");
                    let s = store.stats();
                    let record = plan.record_bytes() as u64;
                    assert_eq!(s.bytes_written, record * plan.count() as u64 * 3);
                    assert_eq!(s.bytes_read, record * plan.count() as u64 * 3);
                    let records = if pr || pw { plan.count().min(3) } else { 1 };
                    let small = (3 - records) * ALIGN;
                    let expect = plan.record_bytes() * records + small;
                    assert_eq!(store.buffer_bytes(), expect as u64, "{tile} {pr} {pw}");
                }
            }
        }
    }

    #[test]
    fn a_state_larger_than_the_free_space_is_refused_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let free = crate::swap::free_bytes(dir.path()).unwrap();
        let len = (free / 4 + 1_000_000) as usize;
        let plan = TilePlan::new(len, 1 << 20, 3);
        let e = SwapStore::create(
            &dir.path().join("x"),
            plan,
            options(IoEngine::Pread, false, false),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("free") && e.contains("needs"), "{e}");
        assert!(!dir.path().join("x").exists());
    }

    #[test]
    fn a_failing_update_reports_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let plan = TilePlan::new(100, 10, 1);
        let mut store = SwapStore::create(
            &dir.path().join("s"),
            plan,
            options(IoEngine::Pread, true, true),
        )
        .unwrap();
        let e = store.update(|i, _, _| {
            if i == 4 {
                Err(CommError::Pipeline("stop".into()))
            } else {
                Ok(())
            }
        });
        assert!(e.unwrap_err().to_string().contains("stop"));
    }
}
