//! Per-module forward latency: [`scope`] marks a submodule's forward in a model's code, and
//! [`get_model_profile`](super::get_model_profile) times the marked forwards on the model's
//! device.
//!
//! DeepSpeed times every module through PyTorch's forward hooks. Burn 0.22 calls a module's
//! `forward` as a plain method, with nothing in between to hook, so a model says where its
//! submodules' forwards are instead. Outside a profile a scope costs one thread-local read.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Display;
use std::time::{Duration, Instant};

use burn::tensor::Device;

/// The scopes entered on this thread while a profile times a forward.
#[derive(Debug, Default)]
struct Timings {
    /// The paths of the scopes entered and not yet left, outermost first.
    open: Vec<String>,
    /// Time per module path, summed over the calls (a module run twice counts twice).
    took: HashMap<String, Duration>,
}

thread_local! {
    static TIMINGS: RefCell<Option<Timings>> = const { RefCell::new(None) };
}

/// Runs `forward`, a submodule's forward, as the module `name` of its caller's tree.
///
/// `name` is the submodule's field in its parent (`"embed"`, or `"blocks.3"` for the fourth
/// element of a `Vec` field `blocks`); a scope inside another scope is that scope's child,
/// so the paths match the module tree of the profile. While
/// [`get_model_profile`](super::get_model_profile) times the forward, the scope
/// synchronises `device` before and after (as DeepSpeed's hooks synchronise the
/// accelerator) and the profile reports the time and achieved FLOPS of that module; at any
/// other time it only runs `forward`.
pub fn scope<R>(name: impl Display, device: &Device, forward: impl FnOnce() -> R) -> R {
    let path = TIMINGS.with(|t| {
        let mut t = t.borrow_mut();
        let t = t.as_mut()?;
        let path = match t.open.last() {
            Some(parent) => format!("{parent}.{name}"),
            None => name.to_string(),
        };
        t.open.push(path.clone());
        Some(path)
    });
    let Some(path) = path else {
        return forward();
    };
    // A failing device fails the profile's own synchronisation after the forward.
    let _ = device.sync();
    let start = Instant::now();
    let out = forward();
    let _ = device.sync();
    let took = start.elapsed();
    TIMINGS.with(|t| {
        if let Some(t) = t.borrow_mut().as_mut() {
            t.open.pop();
            *t.took.entry(path).or_default() += took;
        }
    });
    out
}

/// Runs `f` with the scopes of this thread timed; returns its result and the time per path.
pub(crate) fn timed_scopes<R>(f: impl FnOnce() -> R) -> (R, HashMap<String, Duration>) {
    /// Ends the timing even when `f` panics.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            TIMINGS.with(|t| t.borrow_mut().take());
        }
    }
    TIMINGS.with(|t| *t.borrow_mut() = Some(Timings::default()));
    let reset = Reset;
    let out = f();
    let took = TIMINGS
        .with(|t| t.borrow_mut().take())
        .map(|t| t.took)
        .unwrap_or_default();
    drop(reset);
    (out, took)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_into_paths_and_only_time_inside_a_profile() {
        let device = Device::flex();
        // Outside a profile: nothing is recorded, the forward still runs.
        assert_eq!(scope("outside", &device, || 7), 7);
        let ((), took) = timed_scopes(|| {
            for i in 0..2 {
                scope(format_args!("blocks.{i}"), &device, || {
                    scope("attn", &device, || {
                        std::thread::sleep(Duration::from_millis(2))
                    });
                });
            }
            // The same module run twice: the times add up.
            for _ in 0..2 {
                scope("head", &device, || {
                    std::thread::sleep(Duration::from_millis(1))
                });
            }
        });
        let mut paths: Vec<&str> = took.keys().map(String::as_str).collect();
        paths.sort();
        assert_eq!(
            paths,
            [
                "blocks.0",
                "blocks.0.attn",
                "blocks.1",
                "blocks.1.attn",
                "head"
            ]
        );
        assert!(took["blocks.0"] >= took["blocks.0.attn"]);
        assert!(took["blocks.0.attn"] >= Duration::from_millis(2));
        assert!(took["head"] >= Duration::from_millis(2));
        // Timing ended with the profile, and after a panic inside it too.
        assert!(timed_scopes(|| ()).1.is_empty());
        let panicked = std::panic::catch_unwind(|| {
            timed_scopes(|| scope("boom", &Device::flex(), || panic!("forward failed")))
        });
        assert!(panicked.is_err());
        assert_eq!(scope("after", &device, || 1), 1);
        TIMINGS.with(|t| assert!(t.borrow().is_none()));
    }
}
