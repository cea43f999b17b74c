//! The blockwise attention's memory, measured by the counting allocator: the heap one
//! forward and backward hold grows linearly with the sequence (doubling it doubles the
//! heap), where the decomposition that keeps every score grows with its square.
//!
//! The heap counters are the process's, and a second test running beside this one would count
//! into them: it holds `process.rs`'s lock.

use burn::tensor::{Device, Distribution, Tensor};
use burn_deepspeed::fused::{attention_keeping_scores, blockwise_attention};
use burn_deepspeed::memory::heap::HeapWindow;

/// The most heap a causal attention's forward and backward over `t` positions (1 sequence,
/// 2 heads of 16) hold above what was live before, fused or not.
fn peak(t: usize, fused: bool) -> u64 {
    let device = Device::flex().autodiff();
    let x = || Tensor::<4>::random([1, 2, t, 16], Distribution::Normal(0.0, 1.0), &device);
    let [q, k, v] = [x(), x(), x()].map(|t| t.require_grad());
    let window = HeapWindow::open().expect("the counting allocator is installed");
    let y = match fused {
        true => blockwise_attention(q.clone(), k.clone(), v.clone(), true),
        false => attention_keeping_scores(q.clone(), k.clone(), v.clone(), true),
    };
    let grads = y.sum().backward();
    assert!(q.grad(&grads).is_some());
    window.peak_above_start()
}

#[test]
fn blockwise_attention_memory_grows_linearly() {
    let _alone = crate::alone();
    // Once first, so that what the first call allocates for good (thread pools) counts in
    // neither measure.
    peak(256, true);
    peak(256, false);
    // The least of three: now and then (about one run in ten at 2,048 positions) a window also
    // counts one allocation of exactly 2 MiB that comes and goes with the thread pool's timing,
    // not with the attention.
    let least = |t, fused| (0..3).map(|_| peak(t, fused)).min().unwrap_or(u64::MAX);
    let [fused_1k, fused_2k] = [1024, 2048].map(|t| least(t, true));
    let [plain_1k, plain_2k] = [1024, 2048].map(|t| least(t, false));
    println!(
        "heap of a causal attention's forward and backward: blockwise {fused_1k} B (1024 \
         positions), {fused_2k} B (2048); keeping the scores {plain_1k} B, {plain_2k} B"
    );
    // Doubling the sequence: about twice the heap blockwise, about four times otherwise.
    let (fused_growth, plain_growth) = (
        fused_2k as f64 / fused_1k as f64,
        plain_2k as f64 / plain_1k as f64,
    );
    assert!(fused_growth < 2.5, "blockwise grew {fused_growth:.2}x");
    assert!(
        plain_growth > 3.0,
        "the decomposition grew {plain_growth:.2}x"
    );
    assert!(
        fused_2k * 8 < plain_2k,
        "{fused_2k} B against {plain_2k} B at 2048 positions"
    );
}
