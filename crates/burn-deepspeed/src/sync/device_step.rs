//! The optimizer step of the device-resident regimes (the device place's
//! [`DeviceFlatOptimizer`](super::DeviceFlatOptimizer) at stages 0-2,
//! [`ShardedSync`](super::ShardedSync) over the device place at stage 3) on a rank's flat fp32 buffer, and the
//! count of the bytes their collectives stage through host memory.
//!
//! - **Adam/AdamW**: the fused kernel (`burn-deepspeed-cubecl-kernels`: CubeCL on wgpu and
//!   CUDA), one launch over the whole buffer.
//! - **LAMB** (arXiv 1904.00962): the moments and the update `u` by element-wise device ops
//!   over the buffer, each tensor's ‖p‖² and ‖u‖² reduced on the device (summed over the ranks
//!   through the [`DeviceCollectives`] where the tensors are cut, stages 1-3), the trust ratios
//!   computed there too, and `p ← p − lr·ratio·u` per tensor. The CubeCL `fused_lamb` takes
//!   the ratio from the tensor it is given, which a tensor cut across ranks is not, so it is
//!   not used here. Nothing is read by the host.

use std::ops::Range;

use burn::tensor::{Device, Tensor};
use burn_deepspeed_cubecl_kernels::adam::AdamParams;
use burn_deepspeed_cubecl_kernels::ext::fused_adam;
use burn_deepspeed_cubecl_kernels::lamb::LambParams;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;

use crate::{DeepSpeedError, Result};

/// The optimizer a device-resident regime steps (its `lr` is replaced by each step's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceOptimizer {
    /// Adam or AdamW, by the fused kernel.
    Adam(AdamParams),
    /// LAMB, by device ops.
    Lamb(LambParams),
}

pub(super) use crate::transfer::staged_collective as staged;

/// The state one step updates beside the parameters: m and v (the buffer's length), each
/// tensor's step count, and which tensors have a gradient this step.
pub(super) struct StepState<'a> {
    pub m: &'a mut Tensor<1>,
    pub v: &'a mut Tensor<1>,
    pub steps: &'a mut [u32],
    pub present: &'a [u8],
}

/// One optimizer step of a rank's flat fp32 buffer `params` with its reduced gradient `grads`
/// at `lr`. `pieces` gives each tensor's range in the buffer, in buffer order, covering it;
/// tensors without a gradient keep their values and state. `across`: the ranks the tensors
/// are cut over (stages 1-3), for LAMB's norms; `None` when every rank holds whole tensors.
#[allow(clippy::too_many_arguments)]
pub(super) fn device_step(
    optimizer: &DeviceOptimizer,
    lr: f64,
    params: Tensor<1>,
    grads: &Tensor<1>,
    state: StepState<'_>,
    pieces: &[(usize, Range<usize>)],
    across: Option<&dyn DeviceCollectives>,
    device: &Device,
) -> Result<Tensor<1>> {
    // A rank whose slice is empty (more ranks than elements) only counts the step, but joins
    // LAMB's norm all-reduce as every rank must.
    if params.dims()[0] == 0 && !matches!(optimizer, DeviceOptimizer::Lamb(_) if across.is_some()) {
        count_steps(state.steps, state.present);
        return Ok(params);
    }
    match optimizer {
        DeviceOptimizer::Adam(adam) => fused_adam_step(adam, lr, params, grads, state, pieces),
        DeviceOptimizer::Lamb(lamb) => {
            let hyper = LambParams {
                lr: lr as f32,
                ..*lamb
            };
            lamb_step(&hyper, params, grads, state, pieces, across, device)
        }
    }
}

/// Adam/AdamW: one launch over the whole buffer when every tensor has a gradient and the same
/// step count; otherwise one launch per piece of a tensor that has a gradient, at that
/// tensor's own count.
fn fused_adam_step(
    adam: &AdamParams,
    lr: f64,
    mut params: Tensor<1>,
    grads: &Tensor<1>,
    st: StepState<'_>,
    pieces: &[(usize, Range<usize>)],
) -> Result<Tensor<1>> {
    let hyper = AdamParams {
        lr: lr as f32,
        ..*adam
    };
    let launch = |range: Range<usize>, params: &Tensor<1>, m: &Tensor<1>, v: &Tensor<1>, step| {
        let slice = |t: &Tensor<1>| t.clone().slice(range.clone());
        fused_adam(
            slice(params),
            slice(grads),
            slice(m),
            slice(v),
            &hyper,
            step,
        )
        .map_err(|e| DeepSpeedError::Regime(format!("fused Adam on the device: {e}")))
    };
    let StepState {
        m,
        v,
        steps,
        present,
    } = st;
    if let Some(step) = uniform_step(steps, present) {
        let (p, new_m, new_v) = launch(0..params.dims()[0], &params, m, v, step)?;
        (*m, *v) = (new_m, new_v);
        steps.iter_mut().for_each(|s| *s = s.saturating_add(1));
        return Ok(p);
    }
    count_steps(steps, present);
    for (i, range) in pieces {
        if present[*i] == 0 {
            continue;
        }
        let (p, new_m, new_v) = launch(range.clone(), &params, m, v, steps[*i])?;
        params = params.slice_assign(range.clone(), p);
        *m = m.clone().slice_assign(range.clone(), new_m);
        *v = v.clone().slice_assign(range.clone(), new_v);
    }
    Ok(params)
}

/// The step every tensor takes when all have a gradient and the same count.
fn uniform_step(steps: &[u32], present: &[u8]) -> Option<u32> {
    let step = steps.first().copied().unwrap_or(0) + 1;
    let uniform = present.iter().all(|&p| p != 0) && steps.iter().all(|&s| s + 1 == step);
    uniform.then_some(step)
}

/// Counts a step for every tensor with a gradient.
fn count_steps(steps: &mut [u32], present: &[u8]) {
    for (s, &p) in steps.iter_mut().zip(present) {
        if p != 0 {
            *s = s.saturating_add(1);
        }
    }
}

/// LAMB's moments and update of one range at step `step`: the new (m, v, u).
fn lamb_moments(
    h: &LambParams,
    step: u32,
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let (bc1, bc2) = match h.bias_correction {
        true => {
            let t = step.max(1) as i32;
            (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t))
        }
        false => (1.0, 1.0),
    };
    let m = m.mul_scalar(h.beta1) + g.clone().mul_scalar(1.0 - h.beta1);
    let v = v.mul_scalar(h.beta2) + g.powi_scalar(2).mul_scalar(1.0 - h.beta2);
    let u = m.clone().div_scalar(bc1) / (v.clone().div_scalar(bc2).sqrt().add_scalar(h.eps));
    let u = match h.weight_decay {
        0.0 => u,
        wd => u + p.mul_scalar(wd),
    };
    (m, v, u)
}

/// LAMB over the buffer: moments and updates (over the whole buffer when every tensor has a
/// gradient and the same count, else per piece), each tensor's squared norms of p and u
/// (summed `across` the ranks), the trust ratios ‖p‖/‖u‖ (1 when either is 0, clipped to
/// `trust_clip`), and `p ← p − lr·ratio·u` per piece.
fn lamb_step(
    h: &LambParams,
    params: Tensor<1>,
    grads: &Tensor<1>,
    st: StepState<'_>,
    pieces: &[(usize, Range<usize>)],
    across: Option<&dyn DeviceCollectives>,
    device: &Device,
) -> Result<Tensor<1>> {
    let StepState {
        m,
        v,
        steps,
        present,
    } = st;
    let slice = |t: &Tensor<1>, r: &Range<usize>| t.clone().slice(r.clone());
    // The update u of each piece that steps.
    let mut updates: Vec<Option<Tensor<1>>> = vec![None; pieces.len()];
    let uniform = uniform_step(steps, present).filter(|_| params.dims()[0] > 0);
    if let Some(step) = uniform {
        let (new_m, new_v, u) =
            lamb_moments(h, step, params.clone(), grads.clone(), m.clone(), v.clone());
        (*m, *v) = (new_m, new_v);
        for (k, (_, r)) in pieces.iter().enumerate() {
            updates[k] = Some(slice(&u, r));
        }
        steps.iter_mut().for_each(|s| *s = s.saturating_add(1));
    } else {
        count_steps(steps, present);
        for (k, (t, r)) in pieces.iter().enumerate() {
            if present[*t] == 0 {
                continue;
            }
            let (new_m, new_v, u) = lamb_moments(
                h,
                steps[*t],
                slice(&params, r),
                slice(grads, r),
                slice(m, r),
                slice(v, r),
            );
            *m = m.clone().slice_assign(r.clone(), new_m);
            *v = v.clone().slice_assign(r.clone(), new_v);
            updates[k] = Some(u);
        }
    }
    // ‖p‖² of every tensor, then ‖u‖², zero where this rank holds no stepping piece.
    let tensors = steps.len();
    let zero = || Tensor::<1>::zeros([1], device);
    let mut sq: Vec<Tensor<1>> = (0..2 * tensors).map(|_| zero()).collect();
    for (k, (t, r)) in pieces.iter().enumerate() {
        if let Some(u) = &updates[k] {
            sq[*t] = sq[*t].clone() + slice(&params, r).powi_scalar(2).sum();
            sq[tensors + *t] = sq[tensors + *t].clone() + u.clone().powi_scalar(2).sum();
        }
    }
    let mut sq = Tensor::cat(sq, 0);
    if let Some(coll) = across.filter(|c| c.world_size() > 1) {
        sq = staged(coll, device, |c| c.all_reduce(sq, ReduceOp::Sum))?;
    }
    let (wp, wu) = (
        sq.clone().slice(0..tensors).sqrt(),
        sq.slice(tensors..2 * tensors).sqrt(),
    );
    let valid = wp
        .clone()
        .greater_elem(0.0)
        .bool_and(wu.clone().greater_elem(0.0));
    let ratio = wp / wu;
    let ratio = match h.trust_clip {
        Some((lo, hi)) => ratio.clamp(lo, hi),
        None => ratio,
    };
    let ratio = Tensor::<1>::ones([tensors], device).mask_where(valid, ratio);
    let parts = pieces
        .iter()
        .zip(updates)
        .map(|((t, r), u)| match u {
            Some(u) => {
                let scale = ratio.clone().slice(*t..*t + 1).mul_scalar(h.lr);
                slice(&params, r) - u * scale
            }
            None => slice(&params, r),
        })
        .collect::<Vec<_>>();
    Ok(match parts.is_empty() {
        true => params,
        false => Tensor::cat(parts, 0),
    })
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_deepspeed_cubecl_kernels::lamb::lamb_step as cpu_lamb;

    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|j| (((j * 7 + seed * 13) % 17) as f32 - 8.0) / 4.0)
            .collect()
    }

    fn tensor(v: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Device::flex())
    }

    fn read(t: &Tensor<1>) -> Vec<f32> {
        t.clone().into_data().try_to_vec::<f32>().expect("f32")
    }

    /// Three LAMB steps over a buffer of two tensors, the second without a gradient at step
    /// 2 (so the per-piece path runs), against the CPU kernel stepping each tensor alone.
    #[test]
    fn lamb_on_the_device_matches_the_cpu_kernel_per_tensor() {
        let h = LambParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            bias_correction: true,
            trust_clip: Some((0.0, 10.0)),
        };
        let pieces = [(0usize, 0..5), (1usize, 5..12)];
        let device = Device::flex();
        let mut p = tensor(&values(12, 1));
        let (mut m, mut v) = (tensor(&[0.0; 12]), tensor(&[0.0; 12]));
        let mut steps = vec![0u32; 2];
        let mut cpu: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = pieces
            .iter()
            .map(|(_, r)| {
                (
                    values(12, 1)[r.clone()].to_vec(),
                    vec![0.0; r.len()],
                    vec![0.0; r.len()],
                )
            })
            .collect();
        let mut cpu_steps = [0u32; 2];
        for step in 0..3 {
            let g = values(12, 2 + step);
            let present = [1u8, u8::from(step != 1)];
            let state = StepState {
                m: &mut m,
                v: &mut v,
                steps: &mut steps,
                present: &present,
            };
            p = lamb_step(&h, p, &tensor(&g), state, &pieces, None, &device).expect("a step");
            for (k, (t, r)) in pieces.iter().enumerate() {
                if present[*t] == 0 {
                    continue;
                }
                cpu_steps[k] = cpu_steps[k].saturating_add(1);
                let (cp, cm, cv) = &mut cpu[k];
                cpu_lamb(&h, cpu_steps[k], cp, &g[r.clone()], cm, cv);
            }
        }
        assert_eq!(steps, vec![3, 2]);
        let (p, m) = (read(&p), read(&m));
        for (k, (_, r)) in pieces.iter().enumerate() {
            for (a, b) in p[r.clone()].iter().zip(&cpu[k].0) {
                assert!((a - b).abs() <= 1e-5, "p of tensor {k}: {a} vs {b}");
            }
            for (a, b) in m[r.clone()].iter().zip(&cpu[k].1) {
                assert!((a - b).abs() <= 1e-6, "m of tensor {k}: {a} vs {b}");
            }
        }
    }
}
