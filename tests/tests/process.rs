//! The integration tests that use process-wide state, in a binary of their own: the heap's
//! counters (the counting allocator is this binary's global allocator, so that the engine and
//! the tests measure activations and gathered weights), the environment, and the global
//! `tracing` subscriber. Each test holds
//! [`alone`] throughout, so that none runs beside another even under a plain `cargo test`;
//! `scripts/test.sh` also runs each module in a process of its own.

use std::sync::{Mutex, MutexGuard};

use burn_deepspeed::memory::heap::CountingAllocator;

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator(std::alloc::System);

static ALONE: Mutex<()> = Mutex::new(());

/// Keeps every other test of this binary from running until the guard drops (a test that
/// failed while holding it leaves the lock usable).
fn alone() -> MutexGuard<'static, ()> {
    ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

mod common;

mod activation;
mod attention_memory;
mod offload_pread;
// The trace installs the process's global `tracing` subscriber, which only one caller may
// (Burn's Learner installs its application logger there too).
mod trace;
mod zero3_memory;
