//! Flash attention on the CPU: `softmax(q kᵀ / √d + mask) v` computed one block of queries
//! at a time, so that no `[queries, keys]` score matrix exists; the forward keeps each query's
//! log-sum-exp, and the backward computes each block's scores again from it (FlashAttention,
//! Dao et al., arXiv 2205.14135, Algorithms 1 and 2; the backward's loop order, queries outside
//! and keys inside with `dK`, `dV` summed per head, is FlashAttention-2's, arXiv 2307.08691).
//!
//! Every product is one `gemm` call on a head's block (strided, so a `[batch, positions,
//! heads, d]` layout seen as `[batch, heads, positions, d]` is read without a copy); heads run
//! in parallel on rayon's pool. Under the causal mask a block reads only the keys up to its
//! last query, which skips about half of the products, and the masked scores are never made.
//! [`attention_reference`] computes the same from the definition, for tests.

use std::cell::RefCell;

use gemm::Parallelism;
use rayon::prelude::*;

use crate::KernelError;

/// Queries per block: the scores of a block (`BLOCK × keys`) are what exists at one time.
pub const BLOCK: usize = 64;

/// A `[batch, heads, positions, d]` f32 tensor as it lies in memory: element
/// `(b, h, t, c)` is `values[offset + b·strides[0] + h·strides[1] + t·strides[2] + c·strides[3]]`.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The storage.
    pub values: &'a [f32],
    /// Where element `(0, 0, 0, 0)` lies.
    pub offset: usize,
    /// `[batch, heads, positions, d]`.
    pub shape: [usize; 4],
    /// Steps between neighbours along each dimension, in elements.
    pub strides: [usize; 4],
}

impl<'a> Strided<'a> {
    /// A contiguous `[batch, heads, positions, d]` tensor.
    pub fn contiguous(values: &'a [f32], shape: [usize; 4]) -> Self {
        let [_, h, t, d] = shape;
        Self {
            values,
            offset: 0,
            shape,
            strides: [h * t * d, t * d, d, 1],
        }
    }

    /// Checks that every element lies inside `values`.
    fn check(&self, name: &str) -> Result<(), KernelError> {
        if self.shape.contains(&0) {
            return Ok(());
        }
        let last: usize = (self.shape.iter().zip(self.strides))
            .map(|(&n, s)| (n - 1) * s)
            .sum::<usize>()
            + self.offset;
        match last < self.values.len() {
            true => Ok(()),
            false => Err(arguments(format!(
                "{name} {:?} with strides {:?} from {} reaches element {last} of a storage of {}",
                self.shape,
                self.strides,
                self.offset,
                self.values.len()
            ))),
        }
    }

    /// Where head `i` (of `batch · heads`), position `t`, feature `c` lies in `values`.
    fn index(&self, i: usize, t: usize, c: usize) -> usize {
        let heads = self.shape[1];
        self.offset
            + (i / heads) * self.strides[0]
            + (i % heads) * self.strides[1]
            + t * self.strides[2]
            + c * self.strides[3]
    }

    /// A pointer to head `i`, position `t`, and the steps between positions and between
    /// features.
    fn at(&self, i: usize, t: usize) -> (*const f32, isize, isize) {
        (
            self.values.as_ptr().wrapping_add(self.index(i, t, 0)),
            self.strides[2] as isize,
            self.strides[3] as isize,
        )
    }

    /// Element `c` of head `i`, position `t`.
    fn get(&self, i: usize, t: usize, c: usize) -> f32 {
        self.values[self.index(i, t, c)]
    }
}

fn arguments(detail: String) -> KernelError {
    KernelError::Arguments {
        op: "attention",
        detail,
    }
}

/// The sizes every call shares: heads (`batch · heads`), queries, keys and `d`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    heads: usize,
    queries: usize,
    keys: usize,
    d: usize,
    causal: bool,
    scale: f32,
}

impl Dims {
    fn of(q: &Strided, k: &Strided, v: &Strided, causal: bool) -> Result<Self, KernelError> {
        q.check("q")?;
        k.check("k")?;
        v.check("v")?;
        let [b, h, tq, d] = q.shape;
        let [kb, kh, tk, kd] = k.shape;
        if [kb, kh, kd] != [b, h, d] || v.shape != k.shape {
            return Err(arguments(format!(
                "q {:?}, k {:?} and v {:?}: k and v must be alike, with q's batch, heads and d",
                q.shape, k.shape, v.shape
            )));
        }
        if causal && tk < tq {
            return Err(arguments(format!(
                "causal attention of {tq} queries over {tk} keys: the queries are the last \
                 positions, so there must be at least as many keys"
            )));
        }
        Ok(Self {
            heads: b * h,
            queries: tq,
            keys: tk,
            d,
            causal,
            scale: 1.0 / (d as f32).sqrt(),
        })
    }

    /// The keys query `t` sees: all, or under the causal mask those up to its own position
    /// (the queries are the last `queries` of the `keys` positions).
    fn visible(&self, t: usize) -> usize {
        match self.causal {
            true => t + 1 + self.keys - self.queries,
            false => self.keys,
        }
    }

    /// The blocks of queries: `(start, length, keys the block reads)`.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.queries).step_by(BLOCK).map(move |s| {
            let n = BLOCK.min(self.queries - s);
            (s, n, self.visible(s + n - 1))
        })
    }

    /// Parallelism inside one head's products: the pool's when there are fewer heads than
    /// threads, none when the heads already fill it.
    fn inner(&self) -> Parallelism {
        match self.heads < rayon::current_num_threads() {
            true => Parallelism::Rayon(0),
            false => Parallelism::None,
        }
    }
}

thread_local! {
    /// A thread's scratch for one block's scores and their gradients, kept across calls
    /// (a long context's blocks are megabytes each).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with two scratch buffers of `len` values each (contents unspecified). The buffer
/// is taken out of the thread's slot while in use: a task that rayon runs on this thread while
/// `f` waits inside a parallel product finds the slot empty and makes its own.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    let mut s = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if s.len() < 2 * len {
        s.resize(2 * len, 0.0);
    }
    let (a, b) = s.split_at_mut(len);
    let r = f(a, &mut b[..len]);
    SCRATCH.with(|slot| *slot.borrow_mut() = s);
    r
}

/// `dst[m × n] = (dst if accumulate) + lhs[m × k] · rhs[k × n]`, each operand given by a
/// pointer and its row and column steps.
///
/// # Safety
/// Every element the pointers and steps reach must lie in its allocation, and `dst` must not
/// alias `lhs` or `rhs` nor be written by another thread during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, isize),
    accumulate: bool,
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
    parallelism: Parallelism,
) {
    // SAFETY: forwarded from the caller; gemm reads `k` columns of `lhs`, `k` rows of `rhs`
    // and writes `m × n` of `dst` with the steps given.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            1,
            dst.1,
            accumulate,
            lhs.0,
            lhs.2,
            lhs.1,
            rhs.0,
            rhs.2,
            rhs.1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// The scores of queries `s..s + n` of head `i` over keys `0..kr` into `scores` (`[n, kr]`).
fn block_scores(
    dims: &Dims,
    q: &Strided,
    k: &Strided,
    i: usize,
    (s, n, kr): (usize, usize, usize),
    scores: &mut [f32],
) {
    let (qp, q_rs, q_cs) = q.at(i, s);
    let (kp, k_rs, k_cs) = k.at(i, 0);
    // SAFETY: `check` bounded every element of q and k; `scores` holds n × kr values and is
    // this thread's own.
    unsafe {
        product(
            (n, kr, dims.d),
            (scores.as_mut_ptr(), kr as isize),
            false,
            (qp, q_rs, q_cs),
            // kᵀ: row c of kᵀ is feature c of every key.
            (kp, k_cs, k_rs),
            dims.inner(),
        );
    }
}

/// The attention's output `[batch, heads, queries, d]` and each query's log-sum-exp of its
/// scaled scores `[batch, heads, queries]`, both contiguous. Causal: query `t` (of the last
/// `queries` positions) sees the keys up to its own position.
///
/// # Errors
/// [`KernelError::Arguments`] when the shapes disagree or a tensor reaches past its storage.
pub fn attention_forward(
    q: Strided,
    k: Strided,
    v: Strided,
    causal: bool,
) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
    let dims = Dims::of(&q, &k, &v, causal)?;
    let (tq, d) = (dims.queries, dims.d);
    let mut out = vec![0.0f32; dims.heads * tq * d];
    let mut lse = vec![0.0f32; dims.heads * tq];
    if out.is_empty() || dims.keys == 0 {
        return Ok((out, lse));
    }
    (out.par_chunks_mut(tq * d).zip(lse.par_chunks_mut(tq)))
        .enumerate()
        .for_each(|(i, (out, lse))| {
            for (s, n, kr) in dims.blocks() {
                with_scratch(n * kr, |p, _| {
                    let p = &mut p[..n * kr];
                    block_scores(&dims, &q, &k, i, (s, n, kr), p);
                    for (r, row) in p.chunks_mut(kr).enumerate() {
                        let seen = dims.visible(s + r).min(kr);
                        let (kept, masked) = row.split_at_mut(seen);
                        let max = kept.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut sum = 0.0f32;
                        for x in kept.iter_mut() {
                            *x = ((*x - max) * dims.scale).exp();
                            sum += *x;
                        }
                        masked.fill(0.0);
                        lse[s + r] = max * dims.scale + sum.ln();
                        let inv = 1.0 / sum;
                        kept.iter_mut().for_each(|x| *x *= inv);
                    }
                    let (vp, v_rs, v_cs) = v.at(i, 0);
                    // SAFETY: `check` bounded v; rows s..s + n of this head's output are
                    // this task's own, and `p` is this thread's scratch.
                    unsafe {
                        product(
                            (n, d, kr),
                            (out[s * d..].as_mut_ptr(), d as isize),
                            false,
                            (p.as_ptr(), kr as isize, 1),
                            (vp, v_rs, v_cs),
                            dims.inner(),
                        );
                    }
                });
            }
        });
    Ok((out, lse))
}

/// The gradients `(dq, dk, dv)`, contiguous and shaped as `q`, `k` and `v`, from the
/// forward's `out` and `lse` (as [`attention_forward`] returned them) and the output's
/// gradient `dout`.
///
/// # Errors
/// [`KernelError::Arguments`] when the shapes disagree or a tensor reaches past its storage.
#[allow(clippy::type_complexity)]
pub fn attention_backward(
    [q, k, v]: [Strided; 3],
    out: &[f32],
    lse: &[f32],
    dout: Strided,
    causal: bool,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>), KernelError> {
    let dims = Dims::of(&q, &k, &v, causal)?;
    dout.check("dout")?;
    let (tq, tk, d) = (dims.queries, dims.keys, dims.d);
    if dout.shape != q.shape || out.len() != dims.heads * tq * d || lse.len() != dims.heads * tq {
        return Err(arguments(format!(
            "dout {:?}, out of {} and lse of {} values for q {:?}",
            dout.shape,
            out.len(),
            lse.len(),
            q.shape
        )));
    }
    let mut dq = vec![0.0f32; dims.heads * tq * d];
    let mut dk = vec![0.0f32; dims.heads * tk * d];
    let mut dv = vec![0.0f32; dims.heads * tk * d];
    if dq.is_empty() || tk == 0 {
        return Ok((dq, dk, dv));
    }
    (dq.par_chunks_mut(tq * d).zip(dk.par_chunks_mut(tk * d)))
        .zip(dv.par_chunks_mut(tk * d))
        .enumerate()
        .for_each(|(i, ((dq, dk), dv))| {
            let out = &out[i * tq * d..(i + 1) * tq * d];
            let lse = &lse[i * tq..(i + 1) * tq];
            // Σ_c dout · out per query: the softmax backward's row term.
            let delta: Vec<f32> = (0..tq)
                .map(|t| (0..d).map(|c| dout.get(i, t, c) * out[t * d + c]).sum())
                .collect();
            for (s, n, kr) in dims.blocks() {
                with_scratch(n * kr, |p, dp| {
                    let (p, dp) = (&mut p[..n * kr], &mut dp[..n * kr]);
                    block_scores(&dims, &q, &k, i, (s, n, kr), p);
                    for (r, row) in p.chunks_mut(kr).enumerate() {
                        let seen = dims.visible(s + r).min(kr);
                        let (kept, masked) = row.split_at_mut(seen);
                        let l = lse[s + r];
                        kept.iter_mut()
                            .for_each(|x| *x = (*x * dims.scale - l).exp());
                        masked.fill(0.0);
                    }
                    let (op, o_rs, o_cs) = dout.at(i, s);
                    let (vp, v_rs, v_cs) = v.at(i, 0);
                    let (kp, k_rs, k_cs) = k.at(i, 0);
                    let (qp, q_rs, q_cs) = q.at(i, s);
                    let par = dims.inner();
                    // SAFETY: `check` bounded q, k, v and dout; dq, dk and dv are this
                    // head's own slices, p and dp this thread's scratch, none aliasing.
                    unsafe {
                        // dv[0..kr] += pᵀ · dout
                        product(
                            (kr, d, n),
                            (dv.as_mut_ptr(), d as isize),
                            true,
                            (p.as_ptr(), 1, kr as isize),
                            (op, o_rs, o_cs),
                            par,
                        );
                        // dp = dout · vᵀ
                        product(
                            (n, kr, d),
                            (dp.as_mut_ptr(), kr as isize),
                            false,
                            (op, o_rs, o_cs),
                            (vp, v_cs, v_rs),
                            par,
                        );
                    }
                    // ds = p ⊙ (dp − delta) / √d, into dp.
                    for (r, (ds, p)) in dp.chunks_mut(kr).zip(p.chunks(kr)).enumerate() {
                        let delta = delta[s + r];
                        for (x, &p) in ds.iter_mut().zip(p) {
                            *x = p * (*x - delta) * dims.scale;
                        }
                    }
                    // SAFETY: as above.
                    unsafe {
                        // dq[s..s + n] = ds · k
                        product(
                            (n, d, kr),
                            (dq[s * d..].as_mut_ptr(), d as isize),
                            false,
                            (dp.as_ptr(), kr as isize, 1),
                            (kp, k_rs, k_cs),
                            par,
                        );
                        // dk[0..kr] += dsᵀ · q
                        product(
                            (kr, d, n),
                            (dk.as_mut_ptr(), d as isize),
                            true,
                            (dp.as_ptr(), 1, kr as isize),
                            (qp, q_rs, q_cs),
                            par,
                        );
                    }
                });
            }
        });
    Ok((dq, dk, dv))
}

/// The output and `(dq, dk, dv)` from the definition, in f64, one query at a time: the
/// scores `q kᵀ / √d` with `−∞` where the causal mask hides a key, their softmax `p`,
/// `out = p v`, and the gradients of `Σ dout ⊙ out` by the chain rule through each of them
/// (`dp = dout vᵀ`, `ds = p ⊙ (dp − Σ_j p dp)`, `dq = ds k / √d`, `dk = dsᵀ q / √d`,
/// `dv = pᵀ dout`). All contiguous.
#[allow(clippy::type_complexity)]
pub fn attention_reference(
    [q, k, v]: [Strided; 3],
    dout: Strided,
    causal: bool,
) -> Result<(Vec<f32>, [Vec<f32>; 3]), KernelError> {
    let dims = Dims::of(&q, &k, &v, causal)?;
    let (tq, tk, d) = (dims.queries, dims.keys, dims.d);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0f32; dims.heads * tq * d];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f64; dims.heads * tq * d],
        vec![0.0f64; dims.heads * tk * d],
        vec![0.0f64; dims.heads * tk * d],
    );
    let f = |t: &Strided, i, p, c| t.get(i, p, c) as f64;
    for i in 0..dims.heads {
        for t in 0..tq {
            let seen = dims.visible(t).min(tk);
            let s: Vec<f64> = (0..seen)
                .map(|j| (0..d).map(|c| f(&q, i, t, c) * f(&k, i, j, c)).sum::<f64>() * scale)
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|x| x / sum).collect();
            for c in 0..d {
                out[(i * tq + t) * d + c] =
                    (0..seen).map(|j| p[j] * f(&v, i, j, c)).sum::<f64>() as f32;
            }
            let dp: Vec<f64> = (0..seen)
                .map(|j| (0..d).map(|c| f(&dout, i, t, c) * f(&v, i, j, c)).sum())
                .collect();
            let row: f64 = (0..seen).map(|j| p[j] * dp[j]).sum();
            for j in 0..seen {
                let ds = p[j] * (dp[j] - row);
                for c in 0..d {
                    dq[(i * tq + t) * d + c] += ds * f(&k, i, j, c) * scale;
                    dk[(i * tk + j) * d + c] += ds * f(&q, i, t, c) * scale;
                    dv[(i * tk + j) * d + c] += p[j] * f(&dout, i, t, c);
                }
            }
        }
    }
    let narrow = |x: Vec<f64>| x.into_iter().map(|x| x as f32).collect();
    Ok((out, [narrow(dq), narrow(dk), narrow(dv)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reproducible values in about [−2, 2).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{name}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{name}[{i}]: {g} against {w}"
            );
        }
    }

    /// The kernel's output and gradients equal the definition's, causal or not, for lengths
    /// below, at and across the block size, with q, k and v read through a `[batch,
    /// positions, heads, d]` layout (strided) and the gradient of the output contiguous.
    #[test]
    fn forward_and_backward_equal_the_definition() {
        for (b, h, tq, tk, d, causal) in [
            (1, 1, 1, 1, 4, true),
            (2, 3, 5, 5, 8, true),
            (1, 2, 64, 64, 16, true),
            (2, 2, 150, 150, 8, true),
            (1, 2, 70, 200, 8, true),
            (2, 1, 130, 90, 8, false),
        ] {
            // Stored as [b, t, h, d]; seen as [b, h, t, d].
            let strided = |vals: &'static [f32], t: usize| Strided {
                values: vals,
                offset: 0,
                shape: [b, h, t, d],
                strides: [t * h * d, d, h * d, 1],
            };
            let leak = |v: Vec<f32>| -> &'static [f32] { Box::leak(v.into_boxed_slice()) };
            let q = strided(leak(values(b * tq * h * d, 1)), tq);
            let k = strided(leak(values(b * tk * h * d, 2)), tk);
            let v = strided(leak(values(b * tk * h * d, 3)), tk);
            let dout_values = leak(values(b * h * tq * d, 4));
            let dout = Strided::contiguous(dout_values, [b, h, tq, d]);
            let case = format!("b {b} h {h} tq {tq} tk {tk} d {d} causal {causal}");
            let (out, lse) = attention_forward(q, k, v, causal).expect(&case);
            let (want_out, [want_dq, want_dk, want_dv]) =
                attention_reference([q, k, v], dout, causal).expect(&case);
            assert_close(&format!("{case}: out"), &out, &want_out, 1e-5);
            let (dq, dk, dv) =
                attention_backward([q, k, v], &out, &lse, dout, causal).expect(&case);
            assert_close(&format!("{case}: dq"), &dq, &want_dq, 2e-5);
            assert_close(&format!("{case}: dk"), &dk, &want_dk, 2e-5);
            assert_close(&format!("{case}: dv"), &dv, &want_dv, 2e-5);
        }
    }

    /// Shapes that disagree, a causal call with fewer keys than queries and strides that
    /// reach past the storage are refused, naming what is wrong.
    #[test]
    fn refuses_what_it_cannot_compute() {
        let vals = vec![0.0f32; 2 * 3 * 4 * 8];
        let q = Strided::contiguous(&vals, [2, 3, 4, 8]);
        let short = Strided::contiguous(&vals[..2 * 3 * 2 * 8], [2, 3, 2, 8]);
        let wide = Strided::contiguous(&vals[..2 * 3 * 2 * 8], [2, 3, 4, 4]);
        let err = |r: Result<(Vec<f32>, Vec<f32>), KernelError>| r.unwrap_err().to_string();
        assert!(err(attention_forward(q, wide, wide, false)).contains("must be alike"));
        assert!(err(attention_forward(q, short, short, true)).contains("at least as many keys"));
        let past = Strided { offset: 1, ..q };
        assert!(err(attention_forward(past, q, q, false)).contains("reaches element"));
        // Fewer keys than queries without the mask is fine.
        assert!(attention_forward(q, short, short, false).is_ok());
    }
}
