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
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Tensor, TensorData};

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

/// The additive mask of queries `[start, start + n)` over `keys` keys: −1e9 above the
/// diagonal (the GPT's causal mask), in `like`'s dtype and on its device.
fn causal_block(start: usize, n: usize, keys: usize, like: &Tensor<4>) -> Tensor<4> {
    let values = (0..n)
        .flat_map(|i| (0..keys).map(move |j| if j > start + i { -1e9f32 } else { 0.0 }))
        .collect();
    Tensor::<4>::from_data(TensorData::new(values, [1, 1, n, keys]), &like.device())
        .cast(like.dtype())
}

/// The scores of queries `qb` (the block at `start`) over `k`, scaled and masked.
fn scores(qb: Tensor<4>, k: &Tensor<4>, start: usize, causal: bool) -> Tensor<4> {
    let [_, _, n, d] = qb.dims();
    let keys = k.dims()[2];
    let s = qb
        .matmul(k.clone().swap_dims(2, 3))
        .div_scalar((d as f64).sqrt());
    match causal {
        true => {
            let mask = causal_block(start, n, keys, &s);
            s + mask
        }
        false => s,
    }
}

/// The blocks of queries: `(start, length)`.
fn blocks(positions: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..positions)
        .step_by(ATTENTION_BLOCK)
        .map(move |start| (start, ATTENTION_BLOCK.min(positions - start)))
}

/// The forward: the output `[b, h, t, d]` and each query's log-sum-exp `[b, h, t, 1]`.
fn forward(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, causal: bool) -> (Tensor<4>, Tensor<4>) {
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for (start, n) in blocks(q.dims()[2]) {
        let s = scores(q.clone().narrow(2, start, n), k, start, causal);
        let max = s.clone().max_dim(3);
        let p = (s - max.clone()).exp();
        let sum = p.clone().sum_dim(3);
        out.push(p.matmul(v.clone()) / sum.clone());
        lse.push(max + sum.log());
    }
    (Tensor::cat(out, 2), Tensor::cat(lse, 2))
}

/// The backward: `(dq, dk, dv)` from the output's gradient `dout`, the scores of each block
/// computed again from the log-sum-exp.
fn backward([q, k, v, out, lse]: [Tensor<4>; 5], dout: Tensor<4>, causal: bool) -> [Tensor<4>; 3] {
    let scale = 1.0 / (q.dims()[3] as f64).sqrt();
    let (mut dq, mut dk, mut dv) = (Vec::new(), k.zeros_like(), v.zeros_like());
    for (start, n) in blocks(q.dims()[2]) {
        let qb = q.clone().narrow(2, start, n);
        let dob = dout.clone().narrow(2, start, n);
        let p = (scores(qb.clone(), &k, start, causal) - lse.clone().narrow(2, start, n)).exp();
        dv = dv + p.clone().swap_dims(2, 3).matmul(dob.clone());
        let dp = dob.clone().matmul(v.clone().swap_dims(2, 3));
        let delta = (dob * out.clone().narrow(2, start, n)).sum_dim(3);
        let ds = p * (dp - delta);
        dq.push(ds.clone().matmul(k.clone()).mul_scalar(scale));
        dk = dk + ds.swap_dims(2, 3).matmul(qb).mul_scalar(scale);
    }
    [Tensor::cat(dq, 2), dk, dv]
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

macro_rules! plain_attention_ops {
    ($backend:ty) => {
        impl FusedAttentionOps for $backend {
            fn fused_attention(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                causal: bool,
            ) -> FloatTensor<Self> {
                let [q, k, v] = [q, k, v].map(tensor::<Self>);
                primitive::<Self>(forward(&q, &k, &v, causal).0)
            }
        }
    };
}

plain_attention_ops!(Flex);
#[cfg(feature = "cube")]
plain_attention_ops!(burn::backend::Cube);

#[derive(Debug)]
struct AttentionBackward;

impl<B: FlatPrimitive> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output, the log-sum-exp, and whether it is causal.
    type State = ([FloatTensor<B>; 5], bool);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (saved, causal) = ops.state;
        let dout = tensor::<B>(grads.consume::<B>(&ops.node));
        let grads_qkv = backward(saved.map(tensor::<B>), dout, causal);
        for (parent, grad) in ops.parents.into_iter().zip(grads_qkv) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, primitive::<B>(grad));
            }
        }
    }
}

impl<B: FlatPrimitive, C: CheckpointStrategy> FusedAttentionOps for Autodiff<B, C> {
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
                let [q, k, v] = [q, k, v].map(|t| tensor::<B>(t.into_primitive()));
                let (out, lse) = forward(&q, &k, &v, causal);
                let state = [q, k, v, out.clone(), lse].map(primitive::<B>);
                prep.finish((state, causal), primitive::<B>(out))
            }
            OpsKind::UnTracked(prep) => {
                let [q, k, v] = [q, k, v].map(|t| tensor::<B>(t.into_primitive()));
                prep.finish(primitive::<B>(forward(&q, &k, &v, causal).0))
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
    let t = q.dims()[2];
    let s = scores(q, &k, 0, causal && t > 0);
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
        for (t, causal) in [(5, true), (64, true), (150, true), (150, false)] {
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
}
