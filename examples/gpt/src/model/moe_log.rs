//! What a GPT-MoE's routers did in a step ([`MoeLog`]), read by the report.

use std::sync::{Arc, Mutex};

use burn::tensor::{FloatDType, Tensor};
use burn_deepspeed::moe::MoeStats;

/// The MoE blocks' figures summed over their forwards since the log was last drained (a
/// bounded tally, whether or not anyone drains it; the `l_aux` values stay on the device
/// until then).
#[derive(Debug, Clone, Default)]
pub struct MoeLog(Arc<Mutex<Pending>>);

/// The log's running sums; `l_aux` as a detached tensor, read once per drain.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub(crate) l_aux: Option<Tensor<1>>,
    pub(crate) tally: MoeTally,
}

/// MoE block forwards on this rank, summed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeTally {
    /// MoE block forwards.
    pub forwards: usize,
    /// Their load-balancing losses, summed.
    pub l_aux_sum: f64,
    /// Tokens routed.
    pub tokens: usize,
    /// Tokens dropped by every choice.
    pub dropped: usize,
    /// Tokens each expert was chosen by, before drops, summed by expert index.
    pub counts: Vec<usize>,
    /// Each forward's busiest expert's count over its mean count (1 is even), summed: layers
    /// of different numbers of experts (a pyramid) are each judged on their own.
    pub balance_sum: f64,
}

impl MoeLog {
    pub(crate) fn add(&self, l_aux: Tensor<1>, stats: MoeStats) {
        let mut pending = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let l_aux = l_aux.detach().cast(FloatDType::F32);
        pending.l_aux = Some(match pending.l_aux.take() {
            Some(sum) => sum + l_aux,
            None => l_aux,
        });
        let tally = &mut pending.tally;
        tally.forwards += 1;
        tally.tokens += stats.tokens;
        tally.dropped += stats.dropped;
        tally
            .counts
            .resize(tally.counts.len().max(stats.counts.len()), 0);
        for (c, n) in tally.counts.iter_mut().zip(&stats.counts) {
            *c += n;
        }
        let mean = stats.counts.iter().sum::<usize>() as f64 / stats.counts.len().max(1) as f64;
        let most = stats.counts.iter().copied().max().unwrap_or(0) as f64;
        tally.balance_sum += if mean > 0.0 { most / mean } else { 1.0 };
    }

    /// The tally since the last drain, and a fresh one from here.
    pub fn drain(&self) -> MoeTally {
        let pending = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        MoeTally {
            l_aux_sum: pending
                .l_aux
                .map_or(0.0, |sum| sum.into_scalar::<f32>() as f64),
            ..pending.tally
        }
    }
}
