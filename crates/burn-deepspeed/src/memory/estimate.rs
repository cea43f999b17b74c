//! Model-state bytes per rank **by formula** (ZeRO, arXiv 1910.02054 §5): what `estimate-memory`
//! prints before a run, and what the measured figures ([`MemoryMeter`](super::MemoryMeter),
//! [`ModelStateBytes`](super::ModelStateBytes)) are compared with.

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

impl StatePrecision {
    /// The precision a config trains in: fp16 (16-bit gradients), bf16 (fp32 gradients) or
    /// fp32.
    pub fn of(config: &crate::DeepSpeedConfig) -> Self {
        if config.fp16.enabled {
            Self::Mixed
        } else if config.bf16.enabled {
            Self::MixedFp32Grads
        } else {
            Self::Fp32
        }
    }
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

/// One row of DeepSpeed's offload estimate (`estimate_zero2_model_states_mem_needs` and
/// `estimate_zero3_model_states_mem_needs`): per-process host ("CPU") and per-device ("GPU")
/// bytes of model state for a model of Ψ parameters, by DeepSpeed's formulas (fp16 mixed
/// precision with Adam), not measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OffloadEstimate {
    /// ZeRO stage (2 or 3).
    pub stage: u8,
    /// `offload_optimizer` is `cpu`.
    pub offload_optimizer: bool,
    /// `offload_param` is `cpu` (stage 3).
    pub offload_param: bool,
    /// Parameters created already partitioned (`zero.Init`; stage 3).
    pub zero_init: bool,
    /// Host bytes per node, as DeepSpeed prints "per CPU".
    pub host_bytes: u64,
    /// Bytes per device, as DeepSpeed prints "per GPU".
    pub device_bytes: u64,
}

/// DeepSpeed's ZeRO-2 estimate for Ψ = `params` over `gpus_per_node` × `nodes` devices, with
/// `buffer_factor` (DeepSpeed's `additional_buffer_factor`, 1.5) on host memory.
pub fn zero2_offload_estimate(
    params: u64,
    gpus_per_node: u64,
    nodes: u64,
    offload_optimizer: bool,
    buffer_factor: f64,
) -> OffloadEstimate {
    let (p, gpus) = (params as f64, (gpus_per_node * nodes).max(1) as f64);
    let (host, device) = if offload_optimizer {
        (p * (4.0 * gpus).max(16.0) * buffer_factor, 2.0 * p)
    } else {
        (
            p * 4.0 * gpus_per_node as f64 * buffer_factor,
            4.0 * p + (16.0 * p / gpus).floor(),
        )
    };
    OffloadEstimate {
        stage: 2,
        offload_optimizer,
        offload_param: false,
        zero_init: false,
        host_bytes: host as u64,
        device_bytes: device as u64,
    }
}

/// DeepSpeed's ZeRO-3 estimate for Ψ = `params` whose largest layer has `largest_layer`
/// parameters, over `gpus_per_node` × `nodes` devices.
#[allow(clippy::too_many_arguments)]
pub fn zero3_offload_estimate(
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    offload_optimizer: bool,
    offload_param: bool,
    zero_init: bool,
    buffer_factor: f64,
) -> OffloadEstimate {
    let p = params as f64;
    let gpus = (gpus_per_node * nodes).max(1) as f64;
    let per_node = 1.0 / nodes.max(1) as f64;
    let local = gpus_per_node as f64;
    let largest = 4.0 * largest_layer as f64;
    let (host, device) = match (offload_optimizer, offload_param) {
        (true, true) => (
            match zero_init {
                true => p * 18.0 * per_node,
                false => p * (4.0 * local).max(18.0 * per_node),
            } * buffer_factor,
            largest,
        ),
        (true, false) => (
            match zero_init {
                true => p * 16.0 * per_node,
                false => p * (4.0 * local).max(16.0 * per_node),
            } * buffer_factor,
            largest + (2.0 * p / gpus).floor(),
        ),
        (false, _) => (
            match zero_init {
                true => largest_layer as f64 * 4.0 * local,
                false => p * 4.0 * local,
            } * buffer_factor,
            largest + (18.0 * p / gpus).floor(),
        ),
    };
    OffloadEstimate {
        stage: 3,
        offload_optimizer,
        offload_param: offload_param && offload_optimizer,
        zero_init,
        host_bytes: host as u64,
        device_bytes: device as u64,
    }
}

/// Every row DeepSpeed's `estimate_zero2_model_states_mem_needs_all_cold` and
/// `estimate_zero3_model_states_mem_needs_all_cold` print, in their order.
pub fn offload_estimates(
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    buffer_factor: f64,
) -> Vec<OffloadEstimate> {
    let mut rows = vec![
        zero2_offload_estimate(params, gpus_per_node, nodes, true, buffer_factor),
        zero2_offload_estimate(params, gpus_per_node, nodes, false, buffer_factor),
    ];
    for (optimizer, param) in [(true, true), (true, false), (false, false)] {
        for init in [true, false] {
            rows.push(zero3_offload_estimate(
                params,
                largest_layer,
                gpus_per_node,
                nodes,
                optimizer,
                param,
                init,
                buffer_factor,
            ));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSpeed's documented example (its "Memory Requirements" page): t5-3b, 2,851,598,336
    /// parameters, largest layer the 32,128 x 1,024 embedding, one node of 8 GPUs. The
    /// printed GiB figures, rounded to two places as DeepSpeed prints them.
    #[test]
    fn deepspeeds_documented_offload_table() {
        let rows = offload_estimates(2_851_598_336, 32_128 * 1024, 8, 1, 1.5);
        let gib = |b: u64| format!("{:.2}", b as f64 / (1u64 << 30) as f64);
        let got: Vec<(String, String)> = rows
            .iter()
            .map(|r| (gib(r.host_bytes), gib(r.device_bytes)))
            .collect();
        let want = [
            ("127.48", "5.31"),
            ("127.48", "15.93"),
            ("71.71", "0.12"),
            ("127.48", "0.12"),
            ("63.74", "0.79"),
            ("127.48", "0.79"),
            ("1.47", "6.10"),
            ("127.48", "6.10"),
        ];
        for (row, (g, w)) in rows.iter().zip(got.iter().zip(want)) {
            assert_eq!((g.0.as_str(), g.1.as_str()), w, "{row:?}");
        }
    }

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
