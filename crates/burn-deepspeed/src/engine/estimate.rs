//! Model-state bytes per rank **by formula** (ZeRO, arXiv 1910.02054 §5): what `estimate-memory`
//! prints before a run, and what the measured figures ([`super::memory`]) are compared with.

use serde::Serialize;

/// Per-rank model-state bytes that ZeRO's formulas predict (arXiv 1910.02054 §5), for Ψ
/// parameters over N data-parallel ranks, plus the transient buffers this implementation
/// stages during a step. Activations are not included.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryEstimate {
    /// Parameters held between steps.
    pub params: u64,
    /// Gradients held between steps.
    pub grads: u64,
    /// Optimizer state (with mixed precision: fp32 master weights, m and v).
    pub optimizer: u64,
    /// The sum: what the paper's formula gives.
    pub total: u64,
    /// Extra bytes alive at the peak of a step in this implementation (gradient tensors from
    /// backward, reduction buckets, the all-gathered parameters).
    pub step_overhead: u64,
}

/// Bytes per element of the states ZeRO counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatePrecision {
    /// fp32 parameters and gradients, m and v (16 bytes per parameter): what the engine
    /// trains today.
    Fp32,
    /// The paper's mixed precision: 16-bit parameters and gradients, fp32 master weights, m
    /// and v (2 + 2 + 12 bytes per parameter): what the engine keeps under fp16.
    Mixed,
    /// Mixed precision with fp32 gradient buffers (2 + 4 + 12 bytes per parameter): what the
    /// engine keeps under bf16, as DeepSpeed's bf16 optimizer does.
    MixedFp32Grads,
}

/// [`MemoryEstimate`] for `params` parameters on `world` ranks at ZeRO `stage` (0-3), with
/// `bucket` elements per reduction bucket (`reduce_bucket_size`) and, at stage 3,
/// `live_params` gathered elements alive at once (the largest layer, or
/// `stage3_max_live_parameters`).
pub fn estimate_model_states(
    params: u64,
    world: u64,
    stage: u8,
    precision: StatePrecision,
    bucket: u64,
    live_params: u64,
) -> MemoryEstimate {
    let n = world.max(1);
    let slice = params.div_ceil(n);
    let (p, g, k) = match precision {
        StatePrecision::Fp32 => (4, 4, 8),
        StatePrecision::Mixed => (2, 2, 12),
        StatePrecision::MixedFp32Grads => (2, 4, 12),
    };
    let (params_b, grads_b, optim_b) = match stage {
        0 => (p * params, g * params, k * params),
        1 => (p * params, g * params, k * slice),
        2 => (p * params, g * slice, k * slice),
        _ => (p * slice, g * slice, k * slice),
    };
    let bucket = bucket.min(params);
    let step_overhead = match stage {
        // Gradient tensors from backward while they are copied into the flat buffer.
        0 | 1 => g * params,
        // The same, plus one staged bucket.
        2 => g * (params + bucket),
        // Gathered weights alive at once, their gradients, and one bucket.
        _ => (p + g) * live_params.min(params) + g * bucket,
    };
    MemoryEstimate {
        params: params_b,
        grads: grads_b,
        optimizer: optim_b,
        total: params_b + grads_b + optim_b,
        step_overhead,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper's check value: Ψ = 7.5B, N = 64, mixed precision (K = 12).
    #[test]
    fn the_paper_s_example() {
        let psi = 7_500_000_000;
        let gb =
            |s| estimate_model_states(psi, 64, s, StatePrecision::Mixed, 0, 0).total as f64 / 1e9;
        assert_eq!(gb(0), 120.0);
        assert!((gb(1) - 31.40625).abs() < 1e-6);
        assert!((gb(2) - 16.640625).abs() < 1e-6);
        assert!((gb(3) - 1.875).abs() < 1e-6);
    }

    #[test]
    fn fp32_formulas() {
        let e = |s| estimate_model_states(1000, 4, s, StatePrecision::Fp32, 100, 10).total;
        assert_eq!(e(0), 16_000);
        assert_eq!(e(1), 8_000 + 2_000);
        assert_eq!(e(2), 4_000 + 3_000);
        assert_eq!(e(3), 4_000);
    }
}
