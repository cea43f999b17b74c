//! Fused Adam / AdamW step on the CPU: one pass over the parameter, gradient and both moments,
//! in parallel chunks (rayon) that the compiler vectorizes.
//!
//! The math is DeepSpeed's FusedAdam/CPUAdam (`adam_w_mode` true or false, bias correction
//! on or off), written in the operation order of Burn's `Adam`/`AdamW`, so that an engine that
//! partitions the optimizer (ZeRO, arXiv 1910.02054) reproduces Burn's trajectory:
//!
//! ```text
//! L2    : g ← g + wd·p
//! m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²
//! δ ← (m / bc1) / (√(v / bc2) + ε)          bc_i = 1 − β_i^t, or 1 without bias correction
//! AdamW : p ← p·(1 − lr·wd) − lr·δ
//! L2    : p ← p − lr·δ
//! ```

use rayon::prelude::*;

/// A parameter (and gradient) element type of the fused step; the moments stay f32, as in
/// DeepSpeed's mixed-precision optimizers.
pub trait ParamElement: Copy + Send + Sync + 'static {
    /// Widens to f32 (exact for every implementor).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (to nearest, ties to even).
    fn from_f32(value: f32) -> Self;
}

impl ParamElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl ParamElement for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        half::bf16::from_f32(value)
    }
}

impl ParamElement for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        half::f16::from_f32(value)
    }
}

/// Elements per parallel task: below this a step runs on the calling thread.
pub const CHUNK: usize = 1 << 15;

/// Hyper-parameters of an Adam step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay β1.
    pub beta1: f32,
    /// Second-moment decay β2.
    pub beta2: f32,
    /// ε added to √v̂.
    pub eps: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// `true`: decoupled weight decay (AdamW, DeepSpeed's `adam_w_mode`); `false`: L2 added
    /// to the gradient.
    pub decoupled: bool,
    /// Divide the moments by `1 − β^t`.
    pub bias_correction: bool,
}

impl AdamParams {
    /// AdamW with DeepSpeed's defaults otherwise: β = (0.9, 0.999), ε = 1e-8, decoupled
    /// weight decay, bias correction.
    pub fn adamw(lr: f32, weight_decay: f32) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decoupled: true,
            bias_correction: true,
        }
    }
}

/// Per-step scalars, computed once per tensor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coefficients {
    pub(crate) bc1: f32,
    pub(crate) bc2: f32,
    pub(crate) decay: f32,
    pub(crate) l2: f32,
}

impl AdamParams {
    pub(crate) fn coefficients(&self, step: u32) -> Coefficients {
        let t = step.max(1) as i32;
        let (bc1, bc2) = if self.bias_correction {
            (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
        } else {
            (1.0, 1.0)
        };
        let (decay, l2) = if self.decoupled {
            (
                (1.0 - self.lr as f64 * self.weight_decay as f64) as f32,
                0.0,
            )
        } else {
            (1.0, self.weight_decay)
        };
        Coefficients {
            bc1,
            bc2,
            decay,
            l2,
        }
    }
}

fn adam_chunk<P: ParamElement>(
    h: &AdamParams,
    c: Coefficients,
    p: &mut [P],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
) {
    for (((pp, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *pp = P::from_f32(adam_next(h, c, pp.to_f32(), g.to_f32(), m, v));
    }
}

/// The Adam math of one element in f32: updates the moments from the gradient `g` and returns
/// the parameter `p` after the step.
#[inline(always)]
fn adam_next(h: &AdamParams, c: Coefficients, p: f32, g: f32, m: &mut f32, v: &mut f32) -> f32 {
    let g = if c.l2 != 0.0 { g + p * c.l2 } else { g };
    let mi = *m * h.beta1 + g * (1.0 - h.beta1);
    let vi = *v * h.beta2 + (g * g) * (1.0 - h.beta2);
    *m = mi;
    *v = vi;
    let delta = (mi / c.bc1) / ((vi / c.bc2).sqrt() + h.eps);
    p * c.decay - delta * h.lr
}

/// One fused Adam step (the `step`-th, counted from 1) on one tensor's flat values: f32,
/// bf16 or f16 parameters and gradients, f32 moments.
///
/// # Panics
/// When the four slices differ in length.
pub fn adam_step<P: ParamElement>(
    h: &AdamParams,
    step: u32,
    p: &mut [P],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adam_step: slice lengths differ"
    );
    let c = h.coefficients(step);
    if n <= CHUNK {
        adam_chunk(h, c, p, g, m, v);
        return;
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adam_chunk(h, c, p, g, m, v));
}

/// One tensor of a multi-tensor step: its values, gradient, moments and step number.
#[derive(Debug)]
pub struct AdamTensor<'a, P = f32> {
    /// Parameter values.
    pub p: &'a mut [P],
    /// Gradient.
    pub g: &'a [P],
    /// First moment.
    pub m: &'a mut [f32],
    /// Second moment.
    pub v: &'a mut [f32],
    /// This tensor's step number (from 1).
    pub step: u32,
}

/// One fused Adam step over many tensors in a single parallel pass: the tensors are cut into
/// chunks of at most [`CHUNK`] elements and every chunk of every tensor is one task, so many
/// small tensors cost one fork-join rather than one each.
pub fn adam_step_multi<P: ParamElement>(h: &AdamParams, tensors: &mut [AdamTensor<'_, P>]) {
    let mut tasks = Vec::new();
    for t in tensors.iter_mut() {
        let n = t.p.len();
        assert!(
            t.g.len() == n && t.m.len() == n && t.v.len() == n,
            "adam_step_multi: slice lengths differ"
        );
        let c = h.coefficients(t.step);
        tasks.extend(
            t.p.chunks_mut(CHUNK)
                .zip(t.g.chunks(CHUNK))
                .zip(t.m.chunks_mut(CHUNK))
                .zip(t.v.chunks_mut(CHUNK))
                .map(move |(((p, g), m), v)| (c, p, g, m, v)),
        );
    }
    tasks
        .into_par_iter()
        .for_each(|(c, p, g, m, v)| adam_chunk(h, c, p, g, m, v));
}

/// One mixed-precision element: the gradient (of a loss multiplied by the loss scale) is
/// widened and multiplied by `inv_scale`, the fp32 master `p` and the moments take an Adam
/// step, and the working copy gets the new master rounded to `P`.
#[allow(clippy::too_many_arguments)]
fn adam_mixed_chunk<P: ParamElement>(
    h: &AdamParams,
    c: Coefficients,
    inv_scale: f32,
    p: &mut [f32],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    working: &mut [P],
) {
    for ((((pp, &g), m), v), w) in p
        .iter_mut()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(working.iter_mut())
    {
        let next = adam_next(h, c, *pp, g.to_f32() * inv_scale, m, v);
        *pp = next;
        *w = P::from_f32(next);
    }
}

/// One fused mixed-precision Adam step (the `step`-th, from 1), as DeepSpeed's fp16 and bf16
/// optimizers take it in one pass: the gradient `g` of the scaled loss in the working type `P`
/// times `inv_scale` (1 / the loss scale, or 1 / DeepSpeed's combined unscale-and-clip
/// divisor), an Adam step on the fp32 master `p` and the f32 moments, and the new master
/// rounded into the working copy `working`.
///
/// # Errors
/// [`KernelError::Arguments`](crate::KernelError::Arguments) when the five slices differ in
/// length.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_mixed<P: ParamElement>(
    h: &AdamParams,
    step: u32,
    inv_scale: f32,
    p: &mut [f32],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    working: &mut [P],
) -> Result<(), crate::KernelError> {
    let n = p.len();
    if g.len() != n || m.len() != n || v.len() != n || working.len() != n {
        return Err(crate::KernelError::Arguments {
            op: "adam_step_mixed",
            detail: format!(
                "master {n}, gradient {}, m {}, v {} and working {} values differ",
                g.len(),
                m.len(),
                v.len(),
                working.len()
            ),
        });
    }
    let c = h.coefficients(step);
    if n <= CHUNK {
        adam_mixed_chunk(h, c, inv_scale, p, g, m, v, working);
        return Ok(());
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(working.par_chunks_mut(CHUNK))
        .for_each(|((((p, g), m), v), w)| adam_mixed_chunk(h, c, inv_scale, p, g, m, v, w));
    Ok(())
}

/// The f64 reference: the same formulas, one element at a time, in double precision.
pub fn adam_reference(
    h: &AdamParams,
    step: u32,
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
) {
    let t = step.max(1) as i32;
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    let (bc1, bc2) = if h.bias_correction {
        (1.0 - b1.powi(t), 1.0 - b2.powi(t))
    } else {
        (1.0, 1.0)
    };
    let (lr, wd, eps) = (h.lr as f64, h.weight_decay as f64, h.eps as f64);
    for i in 0..p.len() {
        let g = if h.decoupled { g[i] } else { g[i] + wd * p[i] };
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        let delta = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
        let decay = if h.decoupled { 1.0 - lr * wd } else { 1.0 };
        p[i] = p[i] * decay - lr * delta;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::fill::uniform(n, seed)
    }

    /// [`adam_reference`], then the parameters rounded to `P` as the fused step stores them.
    pub(crate) fn reference_in<P: ParamElement>(
        h: &AdamParams,
        step: u32,
        p: &mut [f64],
        g: &[f64],
        m: &mut [f64],
        v: &mut [f64],
    ) {
        adam_reference(h, step, p, g, m, v);
        for x in p.iter_mut() {
            *x = P::from_f32(*x as f32).to_f32() as f64;
        }
    }

    /// Relative ‖Δp‖ allowed against the reference: f32 rounding, or one unit in the last
    /// place of the half types (whose rounding a 1-ulp difference in f32 can flip).
    pub(crate) fn tolerance<P: 'static>() -> f64 {
        let t = std::any::TypeId::of::<P>();
        if t == std::any::TypeId::of::<half::bf16>() {
            4e-3
        } else if t == std::any::TypeId::of::<half::f16>() {
            5e-4
        } else {
            1e-6
        }
    }

    #[test]
    fn half_precision_parameters_match_the_rounded_f64_reference() {
        fn run<P: ParamElement>() {
            let h = params(true, true);
            for n in [1usize, 7, 22, 64, 1000, 65537] {
                let mut p: Vec<P> = values(n, 1).into_iter().map(P::from_f32).collect();
                let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                let mut pr: Vec<f64> = p.iter().map(|x| x.to_f32() as f64).collect();
                let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
                for step in 1..=10 {
                    let g: Vec<P> = values(n, 100 + step as u64)
                        .into_iter()
                        .map(P::from_f32)
                        .collect();
                    let gr: Vec<f64> = g.iter().map(|x| x.to_f32() as f64).collect();
                    adam_step(&h, step, &mut p, &g, &mut m, &mut v);
                    reference_in::<P>(&h, step, &mut pr, &gr, &mut mr, &mut vr);
                }
                let p32: Vec<f32> = p.iter().map(|x| x.to_f32()).collect();
                let rel = rel_l2(&p32, &pr);
                let name = std::any::type_name::<P>();
                assert!(rel <= tolerance::<P>(), "{name} n {n}: rel {rel}");
            }
        }
        run::<half::bf16>();
        run::<half::f16>();
    }

    /// The mixed step keeps an fp32 master that follows the f64 reference fed the unscaled
    /// gradient (to f32 rounding), and its working copy is the master rounded to `P`; the
    /// loss scale cancels exactly (a power of two).
    #[test]
    fn mixed_step_keeps_an_fp32_master_and_rounds_the_working_copy() {
        fn run<P: ParamElement>() {
            let h = params(true, true);
            let scale = 1024.0f32;
            for n in [1usize, 7, 1000, CHUNK + 3] {
                let mut master = values(n, 1);
                let mut working: Vec<P> = master.iter().map(|&x| P::from_f32(x)).collect();
                let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                let mut pr: Vec<f64> = master.iter().map(|&x| x as f64).collect();
                let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
                for step in 1..=10 {
                    // The gradient of the scaled loss, as the working type holds it.
                    let g: Vec<P> = values(n, 100 + step as u64)
                        .into_iter()
                        .map(|x| P::from_f32(x * scale))
                        .collect();
                    let gr: Vec<f64> = g.iter().map(|x| (x.to_f32() / scale) as f64).collect();
                    adam_step_mixed(
                        &h,
                        step,
                        1.0 / scale,
                        &mut master,
                        &g,
                        &mut m,
                        &mut v,
                        &mut working,
                    )
                    .expect("equal lengths");
                    adam_reference(&h, step, &mut pr, &gr, &mut mr, &mut vr);
                }
                let name = std::any::type_name::<P>();
                let rel = rel_l2(&master, &pr);
                assert!(rel < 1e-6, "{name} n {n}: master rel {rel}");
                assert!(
                    master
                        .iter()
                        .zip(&working)
                        .all(|(&a, w)| P::from_f32(a).to_f32() == w.to_f32()),
                    "{name} n {n}: the working copy is the rounded master"
                );
            }
            let e = adam_step_mixed::<P>(&h, 1, 1.0, &mut [0.0; 3], &[], &mut [], &mut [], &mut [])
                .expect_err("lengths differ");
            assert!(e.to_string().contains("adam_step_mixed"), "{e}");
        }
        run::<f32>();
        run::<half::bf16>();
        run::<half::f16>();
    }

    /// ‖a − b‖ / ‖b‖.
    pub(crate) fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
        let diff: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
        let norm: f64 = b.iter().map(|y| y * y).sum();
        (diff / norm).sqrt()
    }

    fn params(decoupled: bool, bias_correction: bool) -> AdamParams {
        AdamParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
            bias_correction,
        }
    }

    #[test]
    fn fused_adam_matches_the_f64_reference() {
        for n in [1usize, 7, 22, 64, 1000, 65537] {
            for (decoupled, bc) in [(true, true), (false, true), (true, false), (false, false)] {
                let h = params(decoupled, bc);
                let mut p = values(n, 1);
                let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
                let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
                for step in 1..=10 {
                    let g = values(n, 100 + step as u64);
                    let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                    adam_step(&h, step, &mut p, &g, &mut m, &mut v);
                    adam_reference(&h, step, &mut pr, &gr, &mut mr, &mut vr);
                }
                let rel = rel_l2(&p, &pr);
                assert!(rel < 1e-6, "n {n} decoupled {decoupled} bc {bc}: rel {rel}");
            }
        }
    }

    #[test]
    fn multi_tensor_step_equals_one_step_per_tensor() {
        let h = params(true, true);
        let sizes = [3usize, CHUNK + 5, 1];
        let mut single: Vec<Vec<f32>> = sizes.iter().map(|&n| values(n, n as u64)).collect();
        let mut multi = single.clone();
        let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| values(n, 7 * n as u64)).collect();
        let mut ms: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.1; n]).collect();
        let mut vs: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.2; n]).collect();
        let (mut ms2, mut vs2) = (ms.clone(), vs.clone());
        for i in 0..sizes.len() {
            adam_step(
                &h,
                i as u32 + 1,
                &mut single[i],
                &grads[i],
                &mut ms[i],
                &mut vs[i],
            );
        }
        let mut tensors: Vec<AdamTensor<'_>> = multi
            .iter_mut()
            .zip(&grads)
            .zip(ms2.iter_mut().zip(vs2.iter_mut()))
            .enumerate()
            .map(|(i, ((p, g), (m, v)))| AdamTensor {
                p,
                g,
                m,
                v,
                step: i as u32 + 1,
            })
            .collect();
        adam_step_multi(&h, &mut tensors);
        assert_eq!(single, multi);
        assert_eq!(ms, ms2);
        assert_eq!(vs, vs2);
    }
}
