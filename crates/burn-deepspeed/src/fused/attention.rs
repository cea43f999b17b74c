//! [`blockwise_attention`]: scaled dot-product attention whose memory is linear in the sequence, as
//! FlashAttention arranges it (Dao et al., arXiv 2205.14135, Algorithms 1 and 2): the scores
//! are computed one block of queries at a time and never kept; the forward keeps each
//! query's log-sum-exp of its scores, and the backward computes each block's scores again
//! from it. Only `[block, keys]` scores exist at any moment, not `[queries, keys]`.
//!
//! Written with the backend's own tensor ops (matrix products per block), so it runs on
//! every backend the engine runs on. It trades the time of a second pass over the scores
//! in the backward for the memory of all of them.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{DType, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::attention::{Strided, attention_backward, attention_forward};

use super::gelu::values;
use crate::primitive::FlatPrimitive;

/// Queries per block of scores.
pub const ATTENTION_BLOCK: usize = 64;

/// Backends that run the blockwise attention (use [`attention`]).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FusedAttentionOps: burn::backend::Backend {
    /// `softmax(q kᵀ / √d + mask) v` over `[batch, heads, positions, d_head]`, causal or not.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self>;
}

/// The additive causal mask of a block of `n` queries over the same `n` positions as keys:
/// −1e9 above the diagonal (the GPT's causal mask), in `like`'s dtype and on its device.
fn diagonal_mask(n: usize, like: &Tensor<4>) -> Tensor<4> {
    let values = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j > i { -1e9f32 } else { 0.0 }))
        .collect();
    Tensor::<4>::from_data(TensorData::new(values, [1, 1, n, n]), &like.device()).cast(like.dtype())
}

/// The scores of queries `qb` (the block at `start`) over `k`, scaled, and masked when
/// `causal`. Causal, `k` holds the keys up to the block's last query: those before the
/// block are all visible, and only the block's own diagonal square is masked.
fn scores(qb: Tensor<4>, k: &Tensor<4>, start: usize, causal: bool) -> Tensor<4> {
    let [_, _, n, d] = qb.dims();
    let keys = k.dims()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let product = |k: Tensor<4>| qb.clone().matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    if !causal {
        return product(k.clone());
    }
    debug_assert_eq!(
        keys,
        start + n,
        "causal blocks read the keys up to their last query"
    );
    let diagonal = product(k.clone().narrow(2, start, n));
    let diagonal = diagonal.clone() + diagonal_mask(n, &diagonal);
    match start {
        0 => diagonal,
        _ => Tensor::cat(vec![product(k.clone().narrow(2, 0, start)), diagonal], 3),
    }
}

/// The blocks of queries: `(start, length, keys)`, where `keys` is how many keys the block
/// reads: all of them, or under the causal mask only those up to its last query (the later
/// ones would get a weight of exactly 0, so about half of the products are skipped).
fn blocks(
    positions: usize,
    keys: usize,
    causal: bool,
) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..positions).step_by(ATTENTION_BLOCK).map(move |start| {
        let n = ATTENTION_BLOCK.min(positions - start);
        let read = match causal {
            true => (start + n).min(keys),
            false => keys,
        };
        (start, n, read)
    })
}

/// The forward: the output `[b, h, t, d]` and each query's log-sum-exp `[b, h, t, 1]`.
fn forward(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, causal: bool) -> (Tensor<4>, Tensor<4>) {
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for (start, n, keys) in blocks(q.dims()[2], k.dims()[2], causal) {
        let kb = k.clone().narrow(2, 0, keys);
        let s = scores(q.clone().narrow(2, start, n), &kb, start, causal);
        let max = s.clone().max_dim(3);
        let p = (s - max.clone()).exp();
        let sum = p.clone().sum_dim(3);
        out.push(p.matmul(v.clone().narrow(2, 0, keys)) / sum.clone());
        lse.push(max + sum.log());
    }
    (Tensor::cat(out, 2), Tensor::cat(lse, 2))
}

/// Keys per running sum of the backward's key gradients.
const KEY_CHUNK: usize = 1024;

/// Running sums of gradients over the keys, chunk by chunk: a block of queries adds to the
/// chunks it read, so no whole `[keys, d]` tensor is copied per block of queries.
struct KeyGrads(Vec<Option<Tensor<4>>>);

impl KeyGrads {
    fn new(keys: usize) -> Self {
        Self(vec![None; keys.div_ceil(KEY_CHUNK)])
    }

    /// Adds `update`, the gradients of the first `update.dims()[2]` keys.
    fn add(&mut self, update: Tensor<4>) {
        let n = update.dims()[2];
        for (c, sum) in self.0.iter_mut().enumerate().take(n.div_ceil(KEY_CHUNK)) {
            let start = c * KEY_CHUNK;
            let part = update.clone().narrow(2, start, KEY_CHUNK.min(n - start));
            *sum = Some(match sum.take() {
                None => part,
                // A chunk the earlier blocks read only in part (the causal diagonal).
                Some(acc) if acc.dims()[2] < part.dims()[2] => {
                    let m = acc.dims()[2];
                    let rest = part.clone().narrow(2, m, part.dims()[2] - m);
                    Tensor::cat(vec![acc + part.narrow(2, 0, m), rest], 2)
                }
                Some(acc) => acc + part,
            });
        }
    }

    /// The gradients of every key, `like` shaped (zero where no query read a key).
    fn finish(self, like: &Tensor<4>) -> Tensor<4> {
        let keys = like.dims()[2];
        let parts = (self.0.into_iter().enumerate())
            .map(|(c, sum)| {
                let len = KEY_CHUNK.min(keys - c * KEY_CHUNK);
                let zeros = || like.clone().narrow(2, c * KEY_CHUNK, len).zeros_like();
                match sum {
                    Some(s) if s.dims()[2] == len => s,
                    Some(s) => {
                        let m = s.dims()[2];
                        Tensor::cat(vec![s, zeros().narrow(2, m, len - m)], 2)
                    }
                    None => zeros(),
                }
            })
            .collect();
        Tensor::cat(parts, 2)
    }
}

/// The backward: `(dq, dk, dv)` from the output's gradient `dout`, the scores of each block
/// computed again from the log-sum-exp.
fn backward([q, k, v, out, lse]: [Tensor<4>; 5], dout: Tensor<4>, causal: bool) -> [Tensor<4>; 3] {
    let scale = 1.0 / (q.dims()[3] as f64).sqrt();
    let keys = k.dims()[2];
    let (mut dq, mut dk, mut dv) = (Vec::new(), KeyGrads::new(keys), KeyGrads::new(keys));
    for (start, n, read) in blocks(q.dims()[2], keys, causal) {
        let (kb, vb) = (k.clone().narrow(2, 0, read), v.clone().narrow(2, 0, read));
        let qb = q.clone().narrow(2, start, n);
        let dob = dout.clone().narrow(2, start, n);
        let p = (scores(qb.clone(), &kb, start, causal) - lse.clone().narrow(2, start, n)).exp();
        dv.add(p.clone().swap_dims(2, 3).matmul(dob.clone()));
        let dp = dob.clone().matmul(vb.swap_dims(2, 3));
        let delta = (dob * out.clone().narrow(2, start, n)).sum_dim(3);
        let ds = p * (dp - delta);
        dq.push(ds.clone().matmul(kb).mul_scalar(scale));
        dk.add(ds.swap_dims(2, 3).matmul(qb).mul_scalar(scale));
    }
    [Tensor::cat(dq, 2), dk.finish(&k), dv.finish(&v)]
}

/// A primitive as a tensor of its own backend (no autodiff), and back.
fn tensor<B: FlatPrimitive>(p: FloatTensor<B>) -> Tensor<4> {
    let shape = p.shape();
    B::into_flat(p).reshape(shape)
}

fn primitive<B: FlatPrimitive>(t: Tensor<4>) -> FloatTensor<B> {
    let shape = t.shape();
    let n = shape.num_elements();
    B::from_flat(t.reshape([n]), shape)
}

/// How a backend computes the attention's two passes: the forward's output and log-sum-exp,
/// and the backward's `(dq, dk, dv)`. By default, blocks of the backend's own tensor ops.
pub trait AttentionKernel: FlatPrimitive {
    /// The output `[b, h, t, d]` and each query's log-sum-exp `[b, h, t, 1]`.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        forward_by_blocks::<Self>([q, k, v], causal)
    }

    /// `(dq, dk, dv)` from q, k, v, the output and the log-sum-exp (in that order), and the
    /// output's gradient.
    fn attention_backward(
        saved: [FloatTensor<Self>; 5],
        dout: FloatTensor<Self>,
        causal: bool,
    ) -> [FloatTensor<Self>; 3] {
        backward_by_blocks::<Self>(saved, dout, causal)
    }
}

/// The passes written with the backend's tensor ops: a product per block of queries.
fn forward_by_blocks<B: FlatPrimitive>(
    [q, k, v]: [FloatTensor<B>; 3],
    causal: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [q, k, v] = [q, k, v].map(tensor::<B>);
    let (out, lse) = forward(&q, &k, &v, causal);
    (primitive::<B>(out), primitive::<B>(lse))
}

fn backward_by_blocks<B: FlatPrimitive>(
    saved: [FloatTensor<B>; 5],
    dout: FloatTensor<B>,
    causal: bool,
) -> [FloatTensor<B>; 3] {
    backward(saved.map(tensor::<B>), tensor::<B>(dout), causal).map(primitive::<B>)
}

/// A Flex tensor as the CPU kernel reads it: f32 with no negative stride (else `None`).
fn strided(t: &FlexTensor) -> Option<Strided<'_>> {
    let layout = t.layout();
    let shape = layout.shape();
    if shape.num_dims() != 4 {
        return None;
    }
    let dims: [usize; 4] = shape.dims();
    let strides: Vec<usize> = (layout.strides().iter())
        .map(|&s| usize::try_from(s).ok())
        .collect::<Option<_>>()?;
    (t.dtype() == DType::F32).then(|| Strided {
        values: t.storage::<f32>(),
        offset: layout.start_offset(),
        shape: dims,
        strides: strides.try_into().expect("four strides"),
    })
}

fn flex(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// On Flex, f32: the CPU flash-attention kernel (one `gemm` per block and product, the heads
/// in parallel); other dtypes by blocks of tensor ops.
impl AttentionKernel for Flex {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (Some(sq), Some(sk), Some(sv)) = (strided(&q), strided(&k), strided(&v)) else {
            return forward_by_blocks::<Self>([q, k, v], causal);
        };
        let [b, h, t, d] = sq.shape;
        let (out, lse) = attention_forward(sq, sk, sv, causal)
            .unwrap_or_else(|e| panic!("fused attention: {e}"));
        (flex(out, [b, h, t, d]), flex(lse, [b, h, t, 1]))
    }

    fn attention_backward(
        saved: [FloatTensor<Self>; 5],
        dout: FloatTensor<Self>,
        causal: bool,
    ) -> [FloatTensor<Self>; 3] {
        let [q, k, v, out, lse] = &saved;
        let fast = (strided(q), strided(k), strided(v), strided(&dout));
        let (Some(sq), Some(sk), Some(sv), Some(sd)) = fast else {
            return backward_by_blocks::<Self>(saved, dout, causal);
        };
        // The forward made `out` and `lse` in f32 whenever q, k and v are (checked above).
        let (out, lse) = (values(out), values(lse));
        let (dq, dk, dv) = attention_backward([sq, sk, sv], &out, &lse, sd, causal)
            .unwrap_or_else(|e| panic!("fused attention backward: {e}"));
        [(dq, sq.shape), (dk, sk.shape), (dv, sv.shape)].map(|(g, shape)| flex(g, shape))
    }
}

/// On the Cube backends, blocks of tensor ops.
#[cfg(feature = "cube")]
impl AttentionKernel for burn::backend::Cube {}

macro_rules! plain_attention_ops {
    ($backend:ty) => {
        impl FusedAttentionOps for $backend {
            fn fused_attention(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                causal: bool,
            ) -> FloatTensor<Self> {
                <Self as AttentionKernel>::attention_forward(q, k, v, causal).0
            }
        }
    };
}

plain_attention_ops!(Flex);
#[cfg(feature = "cube")]
plain_attention_ops!(burn::backend::Cube);

#[derive(Debug)]
struct AttentionBackward;

impl<B: AttentionKernel> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output, the log-sum-exp, and whether it is causal.
    type State = ([FloatTensor<B>; 5], bool);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (saved, causal) = ops.state;
        let dout = grads.consume::<B>(&ops.node);
        let grads_qkv = B::attention_backward(saved, dout, causal);
        for (parent, grad) in ops.parents.into_iter().zip(grads_qkv) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: AttentionKernel, C: CheckpointStrategy> FusedAttentionOps for Autodiff<B, C> {
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self> {
        match AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let [q, k, v] = [q, k, v].map(|t| t.into_primitive());
                let (out, lse) = B::attention_forward(q.clone(), k.clone(), v.clone(), causal);
                prep.finish(([q, k, v, out.clone(), lse], causal), out)
            }
            OpsKind::UnTracked(prep) => {
                let [q, k, v] = [q, k, v].map(|t| t.into_primitive());
                prep.finish(B::attention_forward(q, k, v, causal).0)
            }
        }
    }
}

/// `softmax(q kᵀ / √d + mask) v` for `q`, `k`, `v` `[batch, heads, positions, d_head]`, with
/// the GPT's causal mask (−1e9 above the diagonal) when `causal`: the scores are made one
/// block of [`ATTENTION_BLOCK`] queries at a time and, under autodiff, made again in the
/// backward instead of kept (memory linear in the positions).
pub fn blockwise_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedAttentionOps>::fused_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        causal,
    ))
}

/// The attention that keeps every score, for comparison: the decomposition Burn's autodiff
/// records (`[positions, positions]` scores per head kept for the backward).
pub fn attention_keeping_scores(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
) -> Tensor<4> {
    let d = q.dims()[3];
    let s = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
    let s = match causal {
        true => {
            let mask = diagonal_mask(s.dims()[2], &s);
            s + mask
        }
        false => s,
    };
    burn::tensor::activation::softmax(s, 3).matmul(v)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tolerance};

    use super::*;

    /// Values and the gradients of q, k and v equal the decomposition's, causal or not, for
    /// lengths below, at and across the block size.
    #[test]
    fn matches_the_decomposition_and_its_gradients() {
        let device = Device::flex().autodiff();
        for (t, causal) in [
            (5, true),
            (64, true),
            (150, true),
            (200, true),
            (150, false),
        ] {
            let x = |seed| {
                Tensor::<4>::random([2, 3, t, 8], Distribution::Normal(0.0, 1.0), &device)
                    .mul_scalar(seed)
            };
            let (q, k, v, w) = (x(1.0), x(0.7), x(1.3), x(1.0));
            let run = |fused: bool| {
                let [q, k, v] = [&q, &k, &v].map(|t| t.clone().detach().require_grad());
                let y = match fused {
                    true => blockwise_attention(q.clone(), k.clone(), v.clone(), causal),
                    false => attention_keeping_scores(q.clone(), k.clone(), v.clone(), causal),
                };
                let grads = (y.clone() * w.clone()).sum().backward();
                let g = [&q, &k, &v].map(|t| t.grad(&grads).expect("a gradient"));
                (y.inner(), g)
            };
            let (y, g) = run(true);
            let (y_ref, g_ref) = run(false);
            let tol = Tolerance::absolute(2e-5);
            y.into_data()
                .assert_approx_eq::<f32>(&y_ref.into_data(), tol);
            for (a, b) in g.into_iter().zip(g_ref) {
                a.into_data().assert_approx_eq::<f32>(&b.into_data(), tol);
            }
        }
    }

    /// Flex's CPU kernel and the passes by blocks of tensor ops (the other backends' and
    /// other dtypes' path) give the same output, log-sum-exp and gradients, for q, k, v seen
    /// through a transposed layout as the GPT makes them.
    #[test]
    fn the_cpu_kernel_equals_the_passes_by_blocks() {
        let device = Device::flex();
        for (t, causal) in [(70, true), (130, false)] {
            let x = |seed: f64| {
                Tensor::<4>::random([2, t, 3, 8], Distribution::Normal(0.0, 1.0), &device)
                    .mul_scalar(seed)
                    .swap_dims(1, 2)
            };
            let prim = |x: Tensor<4>| x.try_into_primitive::<Flex>().expect("a Flex tensor");
            let [q, k, v, dout] = [x(1.0), x(0.7), x(1.3), x(1.0)].map(prim);
            let (out, lse) = Flex::attention_forward(q.clone(), k.clone(), v.clone(), causal);
            let (out_ref, lse_ref) =
                forward_by_blocks::<Flex>([q.clone(), k.clone(), v.clone()], causal);
            let saved = [q, k, v, out.clone(), lse.clone()];
            let grads = Flex::attention_backward(saved.clone(), dout.clone(), causal);
            let grads_ref = backward_by_blocks::<Flex>(saved, dout, causal);
            let tol = Tolerance::absolute(2e-5);
            let data = |p| Tensor::<4>::from_primitive::<Flex>(p).into_data();
            for (a, b) in [(out, out_ref), (lse, lse_ref)]
                .into_iter()
                .chain(grads.into_iter().zip(grads_ref))
            {
                data(a).assert_approx_eq::<f32>(&data(b), tol);
            }
        }
    }
}
