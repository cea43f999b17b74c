//! Model-state accounting: bytes of parameters, gradients and optimizer state that a rank
//! holds, now and at its peak during a step.

use serde::Serialize;

/// Bytes of model state one rank holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ModelStateBytes {
    /// Parameters.
    pub params: u64,
    /// Gradients: the accumulation buffer plus any gradient tensors alive.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
}

impl ModelStateBytes {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// Tracks [`ModelStateBytes`] through a step and remembers the largest total.
#[derive(Debug, Clone, Default)]
pub struct MemoryLedger {
    current: ModelStateBytes,
    peak: u64,
}

impl MemoryLedger {
    /// Current holdings.
    pub fn current(&self) -> ModelStateBytes {
        self.current
    }
    /// Largest total seen.
    pub fn peak(&self) -> u64 {
        self.peak
    }
    /// Updates the holdings with `f` and the peak.
    pub fn update(&mut self, f: impl FnOnce(&mut ModelStateBytes)) {
        f(&mut self.current);
        self.peak = self.peak.max(self.current.total());
    }
    /// Records a transient extra of `grads` bytes (e.g. gradient tensors alive while they are
    /// copied) without keeping it.
    pub fn transient_grads(&mut self, bytes: u64) {
        self.peak = self.peak.max(self.current.total() + bytes);
    }
}
