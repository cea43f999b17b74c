//! The GPT's layers: the transformer block (attention and MLP, sliced across a
//! tensor-parallel group), the embedding and the head, and the fused ops they may run.

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn_deepspeed::activation::checkpoint_tiles;
use burn_deepspeed::fused::{blockwise_attention, gelu, layer_norm, softmax};
use std::sync::atomic::{AtomicBool, Ordering};

use super::shape::*;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_deepspeed::inference::{KvCache, WeightQuantization};
use burn_deepspeed::moe::{ExpertMlp, MoE, MoeConfig, MoeStats};
use burn_deepspeed::profiler::scope;
use burn_deepspeed::sequence::SequenceParallel;
use burn_deepspeed::tensor_parallel::{
    ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
};

/// A whole layer, to be sliced as a column-parallel one (`sections` stacked outputs).
pub(crate) fn column(
    d_in: usize,
    d_out: usize,
    sections: usize,
    device: &Device,
) -> ColumnParallelLinear {
    let whole: Linear = LinearConfig::new(d_in, d_out).init(device);
    ColumnParallelLinear::from_linear_sections(&whole, sections, TensorParallel::none())
        .expect("a whole layer is not cut")
}

/// A whole layer, to be sliced as a row-parallel one.
pub(crate) fn row(d_in: usize, d_out: usize, device: &Device) -> RowParallelLinear {
    let whole: Linear = LinearConfig::new(d_in, d_out).init(device);
    RowParallelLinear::from_linear(&whole, TensorParallel::none())
        .expect("a whole layer is not cut")
}

/// How the GPT keeps its activations over long sequences (the memory side of Arctic Long
/// Sequence Training, arXiv 2506.13996). The default keeps everything, as a short context
/// wants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LongContext {
    /// Attention computes its scores one block of queries at a time, in the forward and
    /// again in the backward ([`blockwise_attention`]), instead of keeping `[t, t]` scores
    /// per head; its memory is linear in the sequence.
    pub blockwise_attention: bool,
    /// Positions per tile of the MLP and of the head with its loss, each tile an activation
    /// checkpoint ([`checkpoint_tiles`]): their `4·d`-wide and vocabulary-wide intermediates
    /// exist for one tile at a time. `None`: whole sequences.
    pub tile: Option<usize>,
}

/// One pre-LN transformer block: attention (a fused `[q | k | v]` projection, column
/// parallel by heads, and a row-parallel output) and an MLP (column then row parallel).
/// Whole, its group is [`TensorParallel::none`] and every op is Burn's.
#[derive(Module, Debug)]
pub struct Block {
    pub(crate) ln_attn: LayerNorm,
    pub(crate) qkv: ColumnParallelLinear,
    pub(crate) attn_out: RowParallelLinear,
    pub(crate) ln_mlp: LayerNorm,
    /// The MLP (a dense block).
    pub(crate) mlp_in: Option<ColumnParallelLinear>,
    pub(crate) mlp_out: Option<RowParallelLinear>,
    /// The MoE layer in the MLP's place (an MoE block).
    pub(crate) moe: Option<MoE<ExpertMlp>>,
    /// Attention heads of the whole block.
    pub(crate) heads: usize,
    /// The sequence-parallel group its attention exchanges heads with (none: whole
    /// sequences).
    #[module(skip)]
    pub(crate) sp: SequenceParallel,
    /// How it keeps its activations over long sequences.
    #[module(skip)]
    pub(crate) long: LongContext,
}

impl Block {
    /// A block whose MLP is dense, or with `moe` an MoE layer of experts shaped like it.
    pub(crate) fn new(
        d: usize,
        heads: usize,
        moe: Option<(MoeShape, usize)>,
        device: &Device,
    ) -> Self {
        let dense = moe.is_none();
        let moe = moe.map(|(m, n)| {
            let experts = (0..n).map(|_| ExpertMlp::new(d, 4 * d, device)).collect();
            let residual = m.residual.then(|| ExpertMlp::new(d, 4 * d, device));
            MoeConfig::new(d, n)
                .with_k(m.k)
                .with_use_residual(m.residual)
                .init(experts, residual, device)
                .expect("a GPT-MoE preset is a valid MoE layer")
        });
        Self {
            ln_attn: LayerNormConfig::new(d).init(device),
            qkv: column(d, 3 * d, 3, device),
            attn_out: row(d, d, device),
            ln_mlp: LayerNormConfig::new(d).init(device),
            mlp_in: dense.then(|| column(d, 4 * d, 1, device)),
            mlp_out: dense.then(|| row(4 * d, d, device)),
            moe,
            heads,
            sp: SequenceParallel::none(),
            long: LongContext::default(),
        }
    }

    /// This rank's slice of the (whole) block: its `heads / tp` heads of q, k and v and the
    /// matching rows of the output projection, its block of the MLP's hidden features;
    /// the LayerNorms whole.
    ///
    /// # Errors
    /// When the heads or the hidden features do not split evenly over the group.
    pub fn sliced(&self, tp: &TensorParallel) -> burn_deepspeed::Result<Self> {
        if !self.heads.is_multiple_of(tp.size()) {
            return Err(burn_deepspeed::DeepSpeedError::TensorParallel(format!(
                "{} attention heads do not split over {} ranks; choose a \
                 tensor_parallel.tp_size that divides the heads",
                self.heads,
                tp.size()
            )));
        }
        Ok(Self {
            ln_attn: self.ln_attn.clone(),
            qkv: self.qkv.slice(tp.clone())?,
            attn_out: self.attn_out.slice(tp.clone())?,
            ln_mlp: self.ln_mlp.clone(),
            mlp_in: self
                .mlp_in
                .as_ref()
                .map(|l| l.slice(tp.clone()))
                .transpose()?,
            mlp_out: self
                .mlp_out
                .as_ref()
                .map(|l| l.slice(tp.clone()))
                .transpose()?,
            // The experts stay whole on every slice.
            moe: self.moe.clone(),
            heads: self.heads,
            sp: self.sp.clone(),
            long: self.long,
        })
    }

    /// The block with its four linear layers' weights quantized under `how`.
    pub(crate) fn quantized(&self, how: &WeightQuantization) -> burn_deepspeed::Result<Self> {
        let (Some(mlp_in), Some(mlp_out)) = (&self.mlp_in, &self.mlp_out) else {
            return Err(burn_deepspeed::DeepSpeedError::Unsupported {
                key: "quantize".into(),
                reason: "the GPT's MoE blocks are not quantized yet".into(),
            });
        };
        Ok(Self {
            ln_attn: self.ln_attn.clone(),
            qkv: self.qkv.quantized(how)?,
            attn_out: self.attn_out.quantized(how)?,
            ln_mlp: self.ln_mlp.clone(),
            mlp_in: Some(mlp_in.quantized(how)?),
            mlp_out: Some(mlp_out.quantized(how)?),
            moe: None,
            heads: self.heads,
            sp: self.sp.clone(),
            long: self.long,
        })
    }

    /// The block on new positions `x` `[batch, t, d]` that attend to `cache`'s positions and
    /// to themselves under the additive `mask` `[batch, 1, t, cached + t]`; their keys and
    /// values are appended to `cache` (inference: no residual scaling).
    pub(crate) fn forward_cached(
        &self,
        x: Tensor<3>,
        mask: &Tensor<4>,
        cache: &mut KvCache,
    ) -> burn_deepspeed::Result<Tensor<3>> {
        let [q, k, v] = self.heads(&x);
        let (k, v) = cache.append(k, v)?;
        let x = x.clone() + self.attend(q, k, v, mask.clone().cast(x.dtype()));
        Ok(x.clone() + self.mlp(x).0)
    }

    /// This rank's heads (all of them when whole) of q, k and v `[b, heads, t, d_head]`
    /// of the normalized `x`.
    pub(crate) fn heads(&self, x: &Tensor<3>) -> [Tensor<4>; 3] {
        let [b, t, d] = x.dims();
        let dh = d / self.heads;
        let h = self.heads / self.qkv.tp.size();
        let device = x.device();
        let x = scope("ln_attn", &device, || norm(&self.ln_attn, x.clone()));
        let qkv = scope("qkv", &device, || self.qkv.forward(x));
        [0, 1, 2].map(|i| {
            qkv.clone()
                .narrow(2, i * h * dh, h * dh)
                .reshape([b, t, h, dh])
                .swap_dims(1, 2)
        })
    }

    /// The attention branch: `q` over `k` and `v` under the additive `mask`, through the
    /// output projection (summed over the group when sliced).
    pub(crate) fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        mask: Tensor<4>,
    ) -> Tensor<3> {
        self.project(attention(q, k, v, mask))
    }

    /// Each head's attention output `[b, heads, t, d_head]` through the output projection.
    fn project(&self, att: Tensor<4>) -> Tensor<3> {
        let [b, h, t, dh] = att.dims();
        let device = att.device();
        scope("attn_out", &device, || {
            self.attn_out
                .forward(att.swap_dims(1, 2).reshape([b, t, h * dh]))
        })
    }

    /// The MLP branch of `x`, and for an MoE block its `l_aux` and routing.
    pub(crate) fn mlp(&self, x: Tensor<3>) -> (Tensor<3>, Option<(Tensor<1>, MoeStats)>) {
        let device = x.device();
        let x = scope("ln_mlp", &device, || norm(&self.ln_mlp, x));
        match (&self.moe, &self.mlp_in, &self.mlp_out) {
            (Some(moe), _, _) => {
                let out = scope("moe", &device, || moe.forward(x));
                (out.output, Some((out.l_aux, out.stats)))
            }
            (None, Some(mlp_in), Some(mlp_out)) => {
                let h = scope("mlp_in", &device, || activation(mlp_in.forward(x)));
                (scope("mlp_out", &device, || mlp_out.forward(h)), None)
            }
            _ => unreachable!("a block has a dense MLP or an MoE layer"),
        }
    }

    /// The additive causal mask its attention takes over `t` positions, in `like`'s dtype;
    /// `None` when the attention is blockwise (it masks each block itself, and a `[t, t]`
    /// mask is what a long context cannot hold).
    pub(crate) fn mask(&self, t: usize, like: &Tensor<3>) -> Option<Tensor<4>> {
        (!self.long.blockwise_attention).then(|| causal_mask(t, &like.device()).cast(like.dtype()))
    }

    /// The block, with its two residual branches multiplied by `scale` (1/p_l for a block
    /// kept by progressive layer dropping, else 1), under `causal` ([`Block::mask`]).
    pub(crate) fn forward(&self, x: Tensor<3>, causal: Option<Tensor<4>>, scale: f64) -> Tensor<3> {
        self.forward_moe(x, causal, scale).0
    }

    /// [`forward`](Self::forward), with an MoE block's `l_aux` and routing.
    pub(crate) fn forward_moe(
        &self,
        x: Tensor<3>,
        causal: Option<Tensor<4>>,
        scale: f64,
    ) -> (Tensor<3>, Option<(Tensor<1>, MoeStats)>) {
        let branch = |y: Tensor<3>| if scale == 1.0 { y } else { y.mul_scalar(scale) };
        let attend = |q, k, v| match causal {
            Some(mask) => attention(q, k, v, mask),
            None => blockwise_attention(q, k, v, true),
        };
        // ANCHOR: ulysses
        // Sequence parallel (DeepSpeed-Ulysses): this rank's positions of every head become
        // every position of its heads for attention, and back for the projection.
        let [q, k, v] = self.heads(&x).map(|t| self.sp.heads_from_sequence(t));
        let att = self.sp.sequence_from_heads(attend(q, k, v));
        let x = x + branch(self.project(att));
        // ANCHOR_END: ulysses
        let (y, aux) = match (self.long.tile, &self.moe) {
            // ALST's tiled MLP: one tile's hidden features at a time.
            (Some(tile), None) => {
                let tiles = checkpoint_tiles(self, x.clone(), 1, tile, |b, x, _| b.mlp(x).0);
                (Tensor::cat(tiles, 1), None)
            }
            _ => self.mlp(x.clone()),
        };
        (x + branch(y), aux)
    }
}

/// Additive causal mask `[1, 1, t, t]`: 0 on and below the diagonal, −1e9 above.
pub(crate) fn causal_mask(t: usize, device: &Device) -> Tensor<4> {
    let values: Vec<f32> = (0..t * t)
        .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
        .collect();
    Tensor::<2>::from_data(TensorData::new(values, [t, t]), device).reshape([1, 1, t, t])
}

/// Scaled dot-product attention of `q` over `k` and `v` `[b, heads, t, d_head]` under the
/// additive `mask`.
fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4>) -> Tensor<4> {
    let dh = q.dims()[3];
    let scores = q.matmul(k.transpose()).div_scalar((dh as f64).sqrt()) + mask;
    attention_softmax(scores).matmul(v)
}

/// Token and position embeddings: the first layer of the GPT.
#[derive(Module, Debug)]
pub struct GptEmbed {
    pub(crate) tok_emb: VocabParallelEmbedding,
    pub(crate) pos_emb: VocabParallelEmbedding,
    pub(crate) seq_len: usize,
    /// The sequence-parallel group (its rank sets the first position).
    #[module(skip)]
    pub(crate) sp: SequenceParallel,
}

impl GptEmbed {
    /// Hidden states `[batch, t, d]` of token ids `[batch, t]` at `positions` `[batch, t]`.
    /// Sliced, each rank adds its shares of the two tables and the group sums them once.
    pub fn forward_at(&self, inputs: Tensor<2, Int>, positions: Tensor<2, Int>) -> Tensor<3> {
        let tokens = self.tok_emb.partial(inputs);
        if self.pos_emb.tp.size() == self.tok_emb.tp.size() {
            self.tok_emb
                .tp
                .reduce(tokens + self.pos_emb.partial(positions))
        } else {
            self.tok_emb.tp.reduce(tokens) + self.pos_emb.forward(positions)
        }
    }

    /// Hidden states `[batch, seq, d]` of token ids `[batch, seq]` (under sequence
    /// parallelism, this rank's block of every sequence: its positions start at
    /// [`first_position`](SequenceParallel::first_position)).
    pub fn forward(&self, inputs: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = inputs.dims();
        let device = inputs.device();
        let first = self.sp.first_position(t);
        assert!(
            first + t <= self.seq_len,
            "sequence of {} exceeds the context of {}",
            first + t,
            self.seq_len
        );
        let positions = Tensor::<1, Int>::arange(first as i64..(first + t) as i64, &device)
            .reshape([1, t])
            .repeat_dim(0, b);
        self.forward_at(inputs, positions)
    }
}

/// Final LayerNorm and the (untied) output projection: the last layer of the GPT.
#[derive(Module, Debug)]
pub struct GptHead {
    pub(crate) ln_f: LayerNorm,
    pub(crate) head: ColumnParallelLinear,
}

impl GptHead {
    /// Logits `[batch, seq, 256 / tp]`: this rank's block of the vocabulary (all of it when
    /// whole).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.head.forward(norm(&self.ln_f, x))
    }
}

/// Whether the blocks use [`burn_deepspeed::fused`]'s softmax, layer norm and GELU (the
/// default) or Burn's own ([`set_fused_ops`]).
pub(crate) static FUSED_OPS: AtomicBool = AtomicBool::new(true);

/// Makes every GPT of the process use the fused softmax, layer norm and GELU (`true`, the
/// default) or Burn's `softmax`, `LayerNorm::forward` and `gelu` (`false`), for benchmarks
/// that compare the two in one process. The values differ by float rounding only.
pub fn set_fused_ops(on: bool) {
    FUSED_OPS.store(on, Ordering::Relaxed);
}

/// `ln` applied to `x`: under autodiff the fused layer norm, whose backward is one step
/// instead of the decomposition's.
pub(crate) fn norm<const D: usize>(ln: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
    if !FUSED_OPS.load(Ordering::Relaxed) {
        return ln.forward(x);
    }
    // The GPT's LayerNorms are built with the config's default epsilon.
    let epsilon = LayerNormConfig::new(1).epsilon;
    layer_norm(
        x,
        ln.gamma.val(),
        ln.beta.as_ref().map(|b| b.val()),
        epsilon,
    )
}

/// The MLP's activation: the exact GELU.
pub(crate) fn activation(x: Tensor<3>) -> Tensor<3> {
    match FUSED_OPS.load(Ordering::Relaxed) {
        true => gelu(x),
        false => burn::tensor::activation::gelu(x),
    }
}

/// The attention's softmax over the keys (the last dimension of the scores).
pub(crate) fn attention_softmax(scores: Tensor<4>) -> Tensor<4> {
    match FUSED_OPS.load(Ordering::Relaxed) {
        true => softmax(scores, 3),
        false => burn::tensor::activation::softmax(scores, 3),
    }
}
