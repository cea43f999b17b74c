//! [`ParamStore`]: where a ZeRO-3 rank's parameter pieces live under `offload_param`
//! (ZeRO-Infinity, arXiv 2104.07857 §5): host memory (`device: "cpu"`), or a swap file
//! (`device: "nvme"`) whose pieces a background thread reads ahead of their gathers, so that
//! the disk works while the model computes.
//!
//! The module keeps an empty placeholder for each partitioned parameter; the
//! [`GatherGroup`](super::GatherGroup) reads the rank's piece from here when it gathers the
//! tensor, and the engine writes the stepped pieces back after each step. Pieces are f32 (the
//! values the optimizer stepped; a 16-bit model's gathers round them to its dtype, as they
//! would round its own chunks).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use burn_deepspeed_strategies::swap::{
    ALIGN, AlignedBuf, SwapFile, SwapOptions, SwapSummary, TransferCounters, ensure_space,
};
use burn_deepspeed_strategies::{CommError, Result};

/// Where one tensor's piece is.
#[derive(Debug)]
enum Place {
    /// Not held here: a persistent tensor, which the module keeps whole.
    Module,
    /// In host memory (`cpu`, or within `max_in_cpu` under `nvme`).
    Host(Mutex<Vec<f32>>),
    /// In the swap file.
    Disk { offset: u64, len: usize },
}

/// How an NVMe parameter store reads ahead (`offload_param`'s `buffer_count` and
/// `buffer_size`) and how much it keeps in memory (`max_in_cpu`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamSwapOptions {
    /// Pieces read ahead at once, at most (`buffer_count`).
    pub buffer_count: usize,
    /// Elements read ahead at once, at most (`buffer_count` × `buffer_size`).
    pub buffer_elems: usize,
    /// Elements of the first pieces (layout order) kept in host memory instead of the file.
    pub max_in_cpu: usize,
    /// How the file is read and written.
    pub swap: SwapOptions,
}

/// What a parameter store holds and moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamStoreSummary {
    /// Bytes of pieces in host memory.
    pub host_bytes: u64,
    /// The swap file (`None` when every piece is in host memory).
    pub swap: Option<SwapSummary>,
    /// Pieces a gather found read ahead.
    pub read_ahead_hits: u64,
    /// Pieces a gather had to read itself (not read ahead).
    pub reads_on_demand: u64,
    /// Most bytes of pieces read ahead and not yet taken, at once (measured).
    pub peak_ahead_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    io: TransferCounters,
    hits: AtomicU64,
    on_demand: AtomicU64,
    ahead_bytes: AtomicUsize,
    peak_ahead_bytes: AtomicUsize,
}

/// A piece read ahead: still in flight, or done.
enum Ahead {
    Pending,
    Ready(Result<Vec<f32>>),
}

#[derive(Default)]
struct Shared {
    pieces: Mutex<HashMap<usize, Ahead>>,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<usize, Ahead>> {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The background reader of an NVMe store.
struct ReadAhead {
    queue: Mutex<Option<Sender<(usize, u64, usize)>>>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

/// One rank's parameter pieces (see the module docs).
pub struct ParamStore {
    places: Vec<Place>,
    file: Option<Arc<SwapFile>>,
    ahead: Option<ReadAhead>,
    options: Option<ParamSwapOptions>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamStore")
            .field("tensors", &self.places.len())
            .field("file", &self.file.as_ref().map(|f| f.path().to_path_buf()))
            .finish()
    }
}

fn padded(len: usize) -> usize {
    (len * 4).div_ceil(ALIGN) * ALIGN
}

impl ParamStore {
    /// A store in host memory (`offload_param.device: "cpu"`) for pieces of `lens[t]`
    /// elements (`None`: tensor `t` stays in the module), zeroed.
    pub fn host(lens: &[Option<usize>]) -> Self {
        let places = lens
            .iter()
            .map(|l| match l {
                Some(n) => Place::Host(Mutex::new(vec![0.0; *n])),
                None => Place::Module,
            })
            .collect();
        Self {
            places,
            file: None,
            ahead: None,
            options: None,
            counters: Arc::default(),
        }
    }

    /// A store in the swap file `path` (`offload_param.device: "nvme"`) for pieces of
    /// `lens[t]` elements, each at a 4 KiB-aligned offset, except the first `max_in_cpu`
    /// elements' worth, kept in memory. Refused up front when the folder has less free space
    /// than the file needs.
    pub fn nvme(path: &Path, lens: &[Option<usize>], options: ParamSwapOptions) -> Result<Self> {
        let mut in_cpu = 0usize;
        let mut bytes = 0u64;
        let places: Vec<Place> = lens
            .iter()
            .map(|l| match *l {
                None => Place::Module,
                Some(n) if n == 0 || in_cpu + n <= options.max_in_cpu => {
                    in_cpu += n;
                    Place::Host(Mutex::new(vec![0.0; n]))
                }
                Some(n) => {
                    let offset = bytes;
                    bytes += padded(n) as u64;
                    Place::Disk { offset, len: n }
                }
            })
            .collect();
        let dir = path.parent().unwrap_or(Path::new("."));
        ensure_space(dir, bytes)?;
        let file = Arc::new(SwapFile::create(
            path,
            bytes,
            options.swap.engine,
            options.swap.aio,
        )?);
        let counters = Arc::<Counters>::default();
        let ahead = ReadAhead::start(file.clone(), counters.clone());
        Ok(Self {
            places,
            file: Some(file),
            ahead: Some(ahead),
            options: Some(options),
            counters,
        })
    }

    /// Whether tensor `t`'s piece is held here (it is partitioned) rather than by the module.
    pub fn holds(&self, t: usize) -> bool {
        !matches!(self.places.get(t), Some(Place::Module) | None)
    }

    /// The swap file's path, if any.
    pub fn path(&self) -> Option<PathBuf> {
        self.file.as_ref().map(|f| f.path().to_path_buf())
    }

    /// Tensor `t`'s piece, read ahead or read now.
    pub fn read(&self, t: usize) -> Result<Vec<f32>> {
        match &self.places[t] {
            Place::Module => Err(not_held(t)),
            Place::Host(values) => Ok(values.lock().unwrap_or_else(|e| e.into_inner()).clone()),
            &Place::Disk { offset, len } => {
                if let Some(ahead) = &self.ahead
                    && let Some(values) = ahead.take(t, &self.counters)
                {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    return values;
                }
                self.counters.on_demand.fetch_add(1, Ordering::Relaxed);
                read_disk(self.file(), &self.counters, offset, len)
            }
        }
    }

    /// Tensor `t`'s piece, zero-padded to `chunk` elements (the shape a gather sends).
    pub fn read_chunk(&self, t: usize, chunk: usize) -> Result<Vec<f32>> {
        let mut values = self.read(t)?;
        values.resize(chunk, 0.0);
        Ok(values)
    }

    /// Replaces tensor `t`'s piece by `values` (its length). A read-ahead of the old piece is
    /// waited for and dropped first.
    pub fn write(&self, t: usize, values: &[f32]) -> Result<()> {
        match &self.places[t] {
            Place::Module => Err(not_held(t)),
            Place::Host(held) => {
                let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
                if held.len() != values.len() {
                    return Err(wrong_length(t, values.len(), held.len()));
                }
                held.copy_from_slice(values);
                Ok(())
            }
            &Place::Disk { offset, len } => {
                if values.len() != len {
                    return Err(wrong_length(t, values.len(), len));
                }
                if let Some(ahead) = &self.ahead {
                    ahead.drop_piece(t, &self.counters);
                }
                let mut buf = AlignedBuf::new(padded(len));
                buf.floats_mut()[..len].copy_from_slice(values);
                let bytes = &buf.bytes()[..padded(len)];
                self.counters.io.write(self.file(), offset, bytes)
            }
        }
    }

    /// Starts reading the pieces of `tensors` (in order) in the background, as far as the
    /// read-ahead budget allows; pieces in memory or already under way are skipped.
    pub fn read_ahead(&self, tensors: &[usize]) {
        let (Some(ahead), Some(o)) = (&self.ahead, &self.options) else {
            return;
        };
        let mut pieces = ahead.shared.lock();
        let mut count = pieces.len();
        let mut elems = self.counters.ahead_bytes.load(Ordering::Relaxed) / 4;
        for &t in tensors {
            let Some(&Place::Disk { offset, len }) = self.places.get(t) else {
                continue;
            };
            if pieces.contains_key(&t) {
                continue;
            }
            if count + 1 > o.buffer_count || elems + len > o.buffer_elems {
                break;
            }
            let queue = ahead.queue.lock().unwrap_or_else(|e| e.into_inner());
            let Some(queue) = queue.as_ref() else {
                return;
            };
            if queue.send((t, offset, len)).is_err() {
                return;
            }
            pieces.insert(t, Ahead::Pending);
            count += 1;
            elems += len;
            let held = self
                .counters
                .ahead_bytes
                .fetch_add(4 * len, Ordering::Relaxed)
                + 4 * len;
            self.counters
                .peak_ahead_bytes
                .fetch_max(held, Ordering::Relaxed);
        }
    }

    /// Whether tensor `t`'s piece is read ahead (in flight or done) or in host memory, so
    /// that reading it now does not wait for the disk from scratch.
    pub fn is_at_hand(&self, t: usize) -> bool {
        match &self.places[t] {
            Place::Module => false,
            Place::Host(_) => true,
            Place::Disk { .. } => self
                .ahead
                .as_ref()
                .is_some_and(|a| a.shared.lock().contains_key(&t)),
        }
    }

    /// Drops every piece read ahead (waiting for reads in flight): the pass that asked for
    /// them is over.
    pub fn forget_read_ahead(&self) {
        if let Some(ahead) = &self.ahead {
            let shared = &ahead.shared;
            let mut pieces = shared
                .done
                .wait_while(shared.lock(), |p| {
                    p.values().any(|a| matches!(a, Ahead::Pending))
                })
                .unwrap_or_else(|e| e.into_inner());
            pieces.clear();
            self.counters.ahead_bytes.store(0, Ordering::Relaxed);
        }
    }

    /// Bytes of pieces in host memory.
    pub fn host_bytes(&self) -> u64 {
        self.places
            .iter()
            .map(|p| match p {
                Place::Host(v) => 4 * v.lock().unwrap_or_else(|e| e.into_inner()).len() as u64,
                _ => 0,
            })
            .sum()
    }

    /// Bytes of the swap file.
    pub fn disk_bytes(&self) -> u64 {
        self.places
            .iter()
            .map(|p| match p {
                Place::Disk { len, .. } => padded(*len) as u64,
                _ => 0,
            })
            .sum()
    }

    /// What the store holds and moved so far.
    pub fn summary(&self) -> ParamStoreSummary {
        let c = &self.counters;
        let swap = self.file.as_ref().map(|f| SwapSummary {
            engine: f.engine(),
            direct: f.is_direct(),
            disk_bytes: self.disk_bytes(),
            buffer_bytes: c.peak_ahead_bytes.load(Ordering::Relaxed) as u64,
            stats: c.io.stats(),
        });
        ParamStoreSummary {
            host_bytes: self.host_bytes(),
            swap,
            read_ahead_hits: c.hits.load(Ordering::Relaxed),
            reads_on_demand: c.on_demand.load(Ordering::Relaxed),
            peak_ahead_bytes: c.peak_ahead_bytes.load(Ordering::Relaxed) as u64,
        }
    }

    fn file(&self) -> &SwapFile {
        self.file
            .as_deref()
            .expect("a store with pieces on disk has a file")
    }
}

impl Drop for ParamStore {
    fn drop(&mut self) {
        if let Some(ahead) = &mut self.ahead {
            // Closing the queue ends the worker.
            ahead.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(worker) = ahead.worker.take() {
                let _ = worker.join();
            }
        }
    }
}

impl ReadAhead {
    fn start(file: Arc<SwapFile>, counters: Arc<Counters>) -> Self {
        let (queue, requests) = channel::<(usize, u64, usize)>();
        let shared = Arc::<Shared>::default();
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("zero3-param-read-ahead".into())
                .spawn(move || {
                    for (t, offset, len) in requests {
                        let values = read_disk(&file, &counters, offset, len);
                        let mut pieces = shared.lock();
                        // A piece dropped meanwhile (its pass ended) is not kept.
                        if let Some(slot) = pieces.get_mut(&t) {
                            *slot = Ahead::Ready(values);
                        }
                        shared.done.notify_all();
                    }
                })
                .ok()
        };
        Self {
            queue: Mutex::new(worker.is_some().then_some(queue)),
            shared,
            worker,
        }
    }

    /// The piece of `t` if it was read ahead (waiting for it while in flight).
    fn take(&self, t: usize, c: &Counters) -> Option<Result<Vec<f32>>> {
        let shared = &self.shared;
        let mut pieces = shared
            .done
            .wait_while(shared.lock(), |p| matches!(p.get(&t), Some(Ahead::Pending)))
            .unwrap_or_else(|e| e.into_inner());
        match pieces.remove(&t)? {
            Ahead::Ready(values) => {
                if let Ok(v) = &values {
                    c.ahead_bytes.fetch_sub(4 * v.len(), Ordering::Relaxed);
                }
                Some(values)
            }
            Ahead::Pending => None,
        }
    }

    /// Waits for a read of `t` in flight, and drops it.
    fn drop_piece(&self, t: usize, c: &Counters) {
        if let Some(Ok(values)) = self.take(t, c) {
            drop(values);
        }
    }
}

fn read_disk(file: &SwapFile, c: &Counters, offset: u64, len: usize) -> Result<Vec<f32>> {
    let bytes = padded(len);
    let mut buf = AlignedBuf::new(bytes);
    c.io.read(file, offset, &mut buf.bytes_mut()[..bytes])?;
    Ok(buf.floats()[..len].to_vec())
}

fn not_held(t: usize) -> CommError {
    CommError::InvalidArgument {
        rank: 0,
        op: "parameter store",
        detail: format!("tensor {t} is persistent: the module holds it, not the store"),
    }
}

fn wrong_length(t: usize, got: usize, held: usize) -> CommError {
    CommError::InvalidArgument {
        rank: 0,
        op: "parameter store",
        detail: format!("tensor {t}: a piece of {got} elements for one of {held}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::swap::{AioOptions, IoEngine};

    fn options(engine: IoEngine, max_in_cpu: usize, count: usize) -> ParamSwapOptions {
        ParamSwapOptions {
            buffer_count: count,
            buffer_elems: 1 << 20,
            max_in_cpu,
            swap: SwapOptions {
                aio: AioOptions {
                    block_size: 8192,
                    ..AioOptions::default()
                },
                engine,
                pipeline_read: false,
                pipeline_write: false,
            },
        }
    }

    fn piece(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (i * 7 + seed) as f32 * 0.25).collect()
    }

    /// What is written is what is read, in memory and on disk, read ahead or not; a write
    /// after a read-ahead is not shadowed by the stale piece.
    #[test]
    fn pieces_round_trip_and_writes_beat_stale_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let lens = [Some(3000), None, Some(1), Some(5000), Some(0), Some(1024)];
        let engines = [IoEngine::Pread].into_iter().chain(
            burn_deepspeed_strategies::swap::io_uring_available().then_some(IoEngine::Uring),
        );
        for engine in engines {
            for max_in_cpu in [0, 3001, usize::MAX] {
                let path = dir.path().join("params.swp");
                let store = ParamStore::nvme(&path, &lens, options(engine, max_in_cpu, 2)).unwrap();
                assert!(!store.holds(1) && store.holds(0) && store.holds(4));
                for (t, l) in lens.iter().enumerate() {
                    if let Some(n) = l {
                        store.write(t, &piece(*n, t)).unwrap();
                    }
                }
                store.read_ahead(&[3, 5, 0]);
                assert_eq!(store.read(3).unwrap(), piece(5000, 3));
                // 5 was read ahead with the old value; the write wins.
                store.write(5, &piece(1024, 99)).unwrap();
                assert_eq!(store.read_chunk(5, 1030).unwrap()[..1024], piece(1024, 99));
                assert_eq!(store.read_chunk(2, 4).unwrap(), vec![0.5, 0.0, 0.0, 0.0]);
                store.read_ahead(&[0]);
                store.forget_read_ahead();
                assert_eq!(store.read(0).unwrap(), piece(3000, 0));
                assert!(store.read(1).is_err());
                assert!(
                    store
                        .write(0, &[1.0])
                        .unwrap_err()
                        .to_string()
                        .contains("3000")
                );
                let s = store.summary();
                let on_disk = match max_in_cpu {
                    0 => padded(3000) + padded(1) + padded(5000) + padded(1024),
                    3001 => padded(5000) + padded(1024),
                    _ => 0,
                };
                assert_eq!(store.disk_bytes(), on_disk as u64, "{max_in_cpu}");
                if max_in_cpu == 0 {
                    assert!(s.read_ahead_hits >= 1, "{s:?}");
                    assert!(s.peak_ahead_bytes > 0 && s.peak_ahead_bytes <= 4 * 8000);
                }
            }
        }
        let host = ParamStore::host(&lens);
        host.write(3, &piece(5000, 1)).unwrap();
        assert_eq!(host.read(3).unwrap(), piece(5000, 1));
        assert_eq!(host.host_bytes(), 4 * (3000 + 1 + 5000 + 1024));
        assert!(host.summary().swap.is_none());
    }

    #[test]
    fn a_store_larger_than_the_free_space_is_refused_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let free = burn_deepspeed_strategies::swap::free_bytes(dir.path()).unwrap();
        let lens = [Some((free / 4) as usize + 1_000_000)];
        let path = dir.path().join("p.swp");
        let e = ParamStore::nvme(&path, &lens, options(IoEngine::Pread, 0, 2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("free") && e.contains("needs"), "{e}");
        assert!(!path.exists());
    }
}
