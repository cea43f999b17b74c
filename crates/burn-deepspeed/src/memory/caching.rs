//! A caching global allocator for the host: large blocks a step frees are kept and handed to
//! the next step's allocations of the same size, instead of going back to the kernel.
//!
//! Burn's CPU backend makes a fresh buffer for every tensor an op produces. Above glibc's
//! mmap threshold (at most 32 MiB, often far less) each one is mapped on allocation and
//! unmapped on free, so every step faults in and zeroes its activations' pages again: on a
//! small VM that was a quarter of a GPT step (the kernel's `clear_page` and page faults in the
//! profile). A training step allocates the same sizes step after step, so a cache keyed by
//! size serves nearly all of them, as PyTorch's CUDA caching allocator does on the device.
//!
//! Install it (with or without [`CountingAllocator`](super::heap::CountingAllocator) on top):
//!
//! ```
//! use burn_deepspeed::memory::caching::{self, CachingAllocator};
//!
//! #[global_allocator]
//! static HEAP: CachingAllocator = CachingAllocator;
//! # fn main() {
//! drop(vec![0u8; 8 << 20]);
//! let again = vec![1u8; 8 << 20]; // the same block, its pages already mapped
//! assert!(caching::stats().hits >= 1);
//! # drop(again);
//! # }
//! ```
//!
//! Blocks of at least [`MIN_BLOCK`] are cached, up to [`capacity`] bytes in all (by default
//! [`DEFAULT_CAPACITY`]); smaller ones and what does not fit go to the system allocator.
//! [`release`] hands every cached block back, [`set_enabled`] turns the cache off and on at run
//! time (for measuring what it buys in one process).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// The smallest block cached: below it glibc's heap already reuses memory without the kernel.
pub const MIN_BLOCK: usize = 1 << 20;

/// The most bytes held in the cache by default (2 GiB).
pub const DEFAULT_CAPACITY: usize = 2 << 30;

/// Blocks the cache holds at most.
const SLOTS: usize = 1024;

/// Cached blocks are page-aligned and a whole number of pages long.
const PAGE: usize = 4096;

/// A free block: its rounded size and address (0: an empty slot).
#[derive(Clone, Copy)]
struct Block {
    size: usize,
    addr: usize,
}

struct Cache {
    blocks: [Block; SLOTS],
    bytes: usize,
}

static CACHE: Mutex<Cache> = Mutex::new(Cache {
    blocks: [Block { size: 0, addr: 0 }; SLOTS],
    bytes: 0,
});
static ENABLED: AtomicBool = AtomicBool::new(true);
static CAPACITY: AtomicUsize = AtomicUsize::new(DEFAULT_CAPACITY);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

/// The system allocator, with a cache of large freed blocks (see the [module](self)).
pub struct CachingAllocator;

/// The cache's counters since the process started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Large allocations served from the cache.
    pub hits: u64,
    /// Large allocations that went to the system allocator.
    pub misses: u64,
    /// Bytes held in the cache now.
    pub cached_bytes: usize,
}

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The layout a cacheable request is served with: whole pages, page-aligned.
fn block_layout(layout: Layout) -> Option<Layout> {
    if layout.size() < MIN_BLOCK || layout.align() > PAGE {
        return None;
    }
    Layout::from_size_align(layout.size().checked_next_multiple_of(PAGE)?, PAGE).ok()
}

impl Cache {
    /// Takes a free block of exactly `size` bytes.
    fn take(&mut self, size: usize) -> Option<*mut u8> {
        let slot = self.blocks.iter_mut().find(|b| b.size == size)?;
        let addr = slot.addr;
        *slot = Block { size: 0, addr: 0 };
        self.bytes -= size;
        Some(addr as *mut u8)
    }

    /// Keeps a block; `false` when it would exceed the capacity or every slot is full.
    fn keep(&mut self, ptr: *mut u8, size: usize) -> bool {
        if self.bytes + size > CAPACITY.load(Ordering::Relaxed) {
            return false;
        }
        match self.blocks.iter_mut().find(|b| b.size == 0) {
            Some(slot) => {
                *slot = Block {
                    size,
                    addr: ptr as usize,
                };
                self.bytes += size;
                true
            }
            None => false,
        }
    }

    /// Every cached block, emptied out of the cache.
    fn drain(&mut self) -> Vec<Block> {
        let mut out = Vec::new();
        for b in self.blocks.iter_mut().filter(|b| b.size != 0) {
            out.push(*b);
            *b = Block { size: 0, addr: 0 };
        }
        self.bytes = 0;
        out
    }
}

/// A cached block for a large request, counted as a hit or a miss.
fn cached(block: Layout) -> Option<*mut u8> {
    let hit = match ENABLED.load(Ordering::Relaxed) {
        true => cache().take(block.size()),
        false => None,
    };
    match hit {
        Some(_) => HITS.fetch_add(1, Ordering::Relaxed),
        None => MISSES.fetch_add(1, Ordering::Relaxed),
    };
    hit
}

// SAFETY: small requests forward to `System` unchanged. A large one is served with a
// page-aligned, page-rounded layout that `System` allocated (directly or earlier, for a block
// of exactly that rounded size that the program has since freed and nothing else holds), so
// the block is at least as large and as aligned as asked; it is freed or cached with that same
// rounded layout. The cache's lock never allocates (a fixed array; `drain`'s `Vec` is made
// outside `GlobalAlloc`'s calls).
unsafe impl GlobalAlloc for CachingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(block) = block_layout(layout) else {
            // SAFETY: the caller's contract is `System::alloc`'s.
            return unsafe { System.alloc(layout) };
        };
        if let Some(ptr) = cached(block) {
            return ptr;
        }
        // SAFETY: `block` has a non-zero size.
        unsafe { System.alloc(block) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some(block) = block_layout(layout) else {
            // SAFETY: as `alloc`.
            return unsafe { System.alloc_zeroed(layout) };
        };
        if let Some(ptr) = cached(block) {
            // SAFETY: the block holds `block.size() >= layout.size()` writable bytes.
            unsafe { ptr.write_bytes(0, layout.size()) };
            return ptr;
        }
        // SAFETY: as `alloc`; fresh pages from the system are zero.
        unsafe { System.alloc_zeroed(block) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(block) = block_layout(layout) else {
            // SAFETY: `ptr` came from `System` with `layout` (small requests are forwarded).
            return unsafe { System.dealloc(ptr, layout) };
        };
        if ENABLED.load(Ordering::Relaxed) && cache().keep(ptr, block.size()) {
            return;
        }
        // SAFETY: large blocks are allocated with `block`.
        unsafe { System.dealloc(ptr, block) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if block_layout(layout).is_none() {
            // SAFETY: `layout` is valid with `new_size` (the caller's contract).
            let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
            if block_layout(new_layout).is_none() {
                // SAFETY: small before and after: `System` owns `ptr` with `layout`.
                return unsafe { System.realloc(ptr, layout, new_size) };
            }
        }
        // SAFETY: as `alloc` and `dealloc`; the copy moves the bytes both blocks hold.
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

/// The counters; all zero when the allocator is not installed.
pub fn stats() -> CacheStats {
    CacheStats {
        hits: HITS.load(Ordering::Relaxed),
        misses: MISSES.load(Ordering::Relaxed),
        cached_bytes: cache().bytes,
    }
}

/// The most bytes the cache holds.
pub fn capacity() -> usize {
    CAPACITY.load(Ordering::Relaxed)
}

/// Sets the most bytes the cache holds (blocks already held above it stay until taken or
/// [`release`]d).
pub fn set_capacity(bytes: usize) {
    CAPACITY.store(bytes, Ordering::Relaxed);
}

/// Turns caching on (the default) or off; off, large blocks go to and from the system
/// allocator and the cache is [`release`]d.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
    if !on {
        release();
    }
}

/// Hands every cached block back to the system allocator.
pub fn release() {
    let blocks = cache().drain();
    for b in blocks {
        // SAFETY: every cached block was allocated by `System` with this rounded size and the
        // page alignment, and is no longer in the cache.
        unsafe {
            System.dealloc(
                b.addr as *mut u8,
                Layout::from_size_align_unchecked(b.size, PAGE),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without being installed, the allocator still works when called directly: a freed
    /// block of the same rounded size comes back, zeroed when asked, and others do not.
    /// (One test: the cache is the process's.)
    #[test]
    fn serves_freed_blocks_of_the_same_size_and_keeps_to_its_capacity() {
        let a = CachingAllocator;
        let big = Layout::from_size_align(3 << 20, 64).expect("a layout");
        let same_pages = Layout::from_size_align((3 << 20) - 100, 8).expect("a layout");
        let other = Layout::from_size_align(5 << 20, 64).expect("a layout");
        let small = Layout::from_size_align(1000, 8).expect("a layout");
        // SAFETY: every pointer is used within its layout and freed with it.
        unsafe {
            let p = a.alloc(big);
            assert!(!p.is_null());
            assert_eq!(p as usize % PAGE, 0, "page-aligned");
            p.write_bytes(7, big.size());
            a.dealloc(p, big);
            let before = stats();
            assert_eq!(before.cached_bytes, 3 << 20);
            let q = a.alloc_zeroed(same_pages);
            assert_eq!(q, p, "the freed block of the same pages");
            assert!((0..same_pages.size()).all(|i| *q.add(i) == 0), "zeroed");
            assert_eq!(stats().hits, before.hits + 1);
            let r = a.alloc(other);
            assert_ne!(r, p);
            assert_eq!(stats().misses, before.misses + 1);
            let s = a.alloc(small);
            a.dealloc(s, small);
            assert_eq!(stats().cached_bytes, 0, "small blocks are not cached");
            // Over capacity: freed to the system.
            set_capacity(4 << 20);
            a.dealloc(q, same_pages);
            a.dealloc(r, other);
            assert_eq!(stats().cached_bytes, 3 << 20);
            set_capacity(DEFAULT_CAPACITY);
            // Growing a large block keeps its bytes.
            let g = a.alloc(big);
            g.write_bytes(9, big.size());
            let g = a.realloc(g, big, 6 << 20);
            assert_eq!(*g.add((3 << 20) - 1), 9);
            a.dealloc(g, Layout::from_size_align(6 << 20, 64).expect("a layout"));
            release();
            assert_eq!(stats().cached_bytes, 0);
            // Off: nothing is kept.
            set_enabled(false);
            let t = a.alloc(big);
            a.dealloc(t, big);
            assert_eq!(stats().cached_bytes, 0);
            set_enabled(true);
        }
    }
}
