//! Panics the library catches itself. Under MPI a panic aborts the job from the panic hook
//! (a rank that unwinds out of its collectives would leave the others waiting forever), but a
//! panic the library catches on purpose (a forward the flops profiler cannot capture, a job of
//! a rank's communication thread) is turned into an error and must not end the job:
//! [`catch_panic`] marks those places for the hook.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// How many [`catch_panic`] calls this thread is inside.
    static CATCHING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` and catches its panic, as `catch_unwind` does; meanwhile the MPI abort-on-panic
/// hook lets a panic of this thread unwind to here instead of aborting the job.
pub fn catch_panic<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            CATCHING.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    CATCHING.with(|c| c.set(c.get() + 1));
    let _leave = Leave;
    catch_unwind(AssertUnwindSafe(f))
}

/// Whether a panic of this thread now would be caught by a [`catch_panic`].
pub fn panic_is_caught() -> bool {
    CATCHING.with(|c| c.get() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_panic_is_known_to_the_hook_only_inside() {
        assert!(!panic_is_caught());
        let inside = catch_panic(panic_is_caught).expect("no panic");
        assert!(inside);
        let caught = catch_panic(|| {
            assert!(panic_is_caught());
            panic!("expected")
        });
        assert!(caught.is_err());
        assert!(
            !panic_is_caught(),
            "the mark ends with the catch, panic or not"
        );
    }
}
