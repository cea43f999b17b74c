//! The process heap, measured: a counting global allocator that a binary may install, and the
//! window the engine reads activation memory through.
//!
//! Burn's CPU backend keeps activations on the heap, so the heap a forward and backward add
//! above what was live before them is the memory activation checkpointing saves. The engine
//! reads it when [`CountingAllocator`] is the global allocator, and reports nothing otherwise:
//!
//! ```
//! use burn_deepspeed::memory::heap::CountingAllocator;
//!
//! #[global_allocator]
//! static HEAP: CountingAllocator = CountingAllocator(std::alloc::System);
//! # fn main() {
//! let bytes = vec![0u8; 1 << 20];
//! assert!(burn_deepspeed::memory::heap::live_bytes().unwrap() >= bytes.len() as u64);
//! # }
//! ```
//!
//! The counters are the process's: ranks that run as threads of one process share them, so
//! their windows overlap and count each other's activations (run one rank, or one rank per
//! process under MPI, for a per-rank figure).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// An allocator (the system's, or [`CachingAllocator`](super::caching::CachingAllocator)),
/// counting the bytes the program holds and their peak.
pub struct CountingAllocator<A: GlobalAlloc = System>(pub A);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Ordering::Relaxed);
}

// SAFETY: every call forwards to the inner allocator with the caller's arguments; the
// counters are atomics and never allocate.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is the inner allocator's.
        let ptr = unsafe { self.0.alloc(layout) };
        if !ptr.is_null() {
            if !INSTALLED.load(Ordering::Relaxed) {
                INSTALLED.store(true, Ordering::Relaxed);
            }
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let ptr = unsafe { self.0.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from the inner one, with `layout`.
        unsafe { self.0.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, and `new_size` is the caller's.
        let new = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        new
    }
}

/// Bytes live on the heap now; `None` when [`CountingAllocator`] is not the global allocator.
pub fn live_bytes() -> Option<u64> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed))
}

/// The most heap a stretch of work held above what was live when it started.
#[derive(Debug)]
pub struct HeapWindow {
    start: u64,
}

impl HeapWindow {
    /// Starts a window (resets the process's peak to what is live now); `None` when the
    /// counting allocator is not installed.
    pub fn open() -> Option<Self> {
        let start = live_bytes()?;
        PEAK.store(start, Ordering::Relaxed);
        Some(Self { start })
    }

    /// The peak since [`open`](Self::open), above the live bytes then.
    pub fn peak_above_start(&self) -> u64 {
        PEAK.load(Ordering::Relaxed).saturating_sub(self.start)
    }
}
