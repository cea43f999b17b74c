//! A byte-level GPT: pre-LN transformer blocks, learned positions, an untied head; also as a
//! sequence of pipeline layers, and sliced across a tensor-parallel group (Megatron-LM's
//! split: attention heads and the MLP's hidden features cut across the ranks, the vocabulary
//! of the embedding and of the head too).

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn_deepspeed::fused::{gelu, layer_norm, softmax};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_deepspeed::activation::checkpoint;
use burn_deepspeed::distill::{DistillationConfig, distillation_loss};
use burn_deepspeed::flat::{ParamLayout, params_from_flat};
use burn_deepspeed::inference::{CausalLm, KvCache, WeightQuantization};
use burn_deepspeed::memory::param_bytes;
use burn_deepspeed::moe::{ExpertMlp, ExpertParallel, MoE, MoeConfig, MoeStats};
use burn_deepspeed::pipe::{LayerInput, PipeBatch, PipeLayer};
use burn_deepspeed::pld::ProgressiveLayerDrop;
use burn_deepspeed::profiler::scope;
use burn_deepspeed::tensor_parallel::{
    ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
};

/// Vocabulary: one token per byte.
pub const VOCAB: usize = 256;

/// Size of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptShape {
    /// Model width.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub seq_len: usize,
    /// Mixture of Experts in every other block (GPT-MoE), or none.
    pub moe: Option<MoeShape>,
}

/// The MoE layers of a GPT-MoE (DeepSpeed-MoE, arXiv 2201.05596): every other block's MLP
/// (the second, fourth, ...) is an MoE layer of experts shaped like that MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token (1 or 2).
    pub k: usize,
    /// PR-MoE's residual: a dense MLP beside the experts.
    pub residual: bool,
    /// PR-MoE's pyramid: more experts in the last MoE layers.
    pub pyramid: Option<Pyramid>,
}

/// PR-MoE's pyramid (arXiv 2201.05596 §4.1: experts help the deeper layers more): the last
/// `layers` MoE layers hold `experts` experts each, the earlier ones [`MoeShape::experts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pyramid {
    /// MoE layers at the end of the model with more experts.
    pub layers: usize,
    /// Experts in each of them.
    pub experts: usize,
}

impl MoeShape {
    /// Experts of MoE layer `index` of `count` (0-based, in model order).
    pub fn experts_at(&self, index: usize, count: usize) -> usize {
        match self.pyramid {
            Some(p) if index + p.layers >= count => p.experts,
            _ => self.experts,
        }
    }
}

/// The load-balancing loss's coefficient in the training loss (Megatron-DeepSpeed's
/// `--moe-loss-coeff` default).
pub const MOE_LOSS_COEF: f64 = 0.01;

impl GptShape {
    /// d 128, 4 layers, 4 heads, context 128 (about 0.9M parameters).
    pub const TINY: GptShape = GptShape {
        d_model: 128,
        layers: 4,
        heads: 4,
        seq_len: 128,
        moe: None,
    };
    /// d 256, 8 layers, 8 heads, context 256 (about 6.5M parameters).
    pub const SMALL: GptShape = GptShape {
        d_model: 256,
        layers: 8,
        heads: 8,
        seq_len: 256,
        moe: None,
    };

    /// d 512, 16 layers, 8 heads, context 256 (about 50.7M parameters).
    pub const MEDIUM: GptShape = GptShape {
        d_model: 512,
        layers: 16,
        heads: 8,
        seq_len: 256,
        moe: None,
    };

    /// d 2048, 40 layers, 16 heads, context 128 (about 2.01B parameters: its fp32 Adam
    /// state alone, 16 bytes per parameter, is 32 GB). Built lazily: [`Gpt::new`] makes no
    /// values until a parameter is read, so that ZeRO-3 with `offload_param` cuts it into
    /// its store one tensor at a time.
    pub const XL: GptShape = GptShape {
        d_model: 2048,
        layers: 40,
        heads: 16,
        seq_len: 128,
        moe: None,
    };

    /// `tiny` with 4 experts, top-1, in blocks 2 and 4.
    pub const TINY_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 4,
            k: 1,
            residual: false,
            pyramid: None,
        }),
        ..Self::TINY
    };

    /// `small` with 8 experts, top-1, in every other block (the same compute per token:
    /// each token runs one expert the size of the dense MLP).
    pub const SMALL_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 8,
            k: 1,
            residual: false,
            pyramid: None,
        }),
        ..Self::SMALL
    };

    /// `tiny-moe` as PR-MoE: a dense MLP beside the experts of each MoE block, 2 experts in
    /// block 2 and 4 in block 4 (the pyramid).
    pub const TINY_PR_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 2,
            k: 1,
            residual: true,
            pyramid: Some(Pyramid {
                layers: 1,
                experts: 4,
            }),
        }),
        ..Self::TINY
    };

    /// `small-moe` as PR-MoE: a dense MLP beside the experts of each MoE block, 2 experts in
    /// the first two MoE blocks and 4 in the last two (the pyramid): half the experts'
    /// parameters of `small-moe`, with the residual MLPs.
    pub const SMALL_PR_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 2,
            k: 1,
            residual: true,
            pyramid: Some(Pyramid {
                layers: 2,
                experts: 4,
            }),
        }),
        ..Self::SMALL
    };

    /// The preset names [`preset`](Self::preset) knows.
    pub const PRESETS: [&'static str; 8] = [
        "tiny",
        "small",
        "medium",
        "xl",
        "tiny-moe",
        "small-moe",
        "tiny-pr-moe",
        "small-pr-moe",
    ];

    /// A preset by name (one of [`PRESETS`](Self::PRESETS)).
    pub fn preset(name: &str) -> Option<GptShape> {
        match name {
            "tiny" => Some(Self::TINY),
            "small" => Some(Self::SMALL),
            "medium" => Some(Self::MEDIUM),
            "xl" => Some(Self::XL),
            "tiny-moe" => Some(Self::TINY_MOE),
            "small-moe" => Some(Self::SMALL_MOE),
            "tiny-pr-moe" => Some(Self::TINY_PR_MOE),
            "small-pr-moe" => Some(Self::SMALL_PR_MOE),
            _ => None,
        }
    }
}

/// A whole layer, to be sliced as a column-parallel one (`sections` stacked outputs).
fn column(d_in: usize, d_out: usize, sections: usize, device: &Device) -> ColumnParallelLinear {
    let whole: Linear = LinearConfig::new(d_in, d_out).init(device);
    ColumnParallelLinear::from_linear_sections(&whole, sections, TensorParallel::none())
}

/// A whole layer, to be sliced as a row-parallel one.
fn row(d_in: usize, d_out: usize, device: &Device) -> RowParallelLinear {
    let whole: Linear = LinearConfig::new(d_in, d_out).init(device);
    RowParallelLinear::from_linear(&whole, TensorParallel::none())
}

/// One pre-LN transformer block: attention (a fused `[q | k | v]` projection, column
/// parallel by heads, and a row-parallel output) and an MLP (column then row parallel).
/// Whole, its group is [`TensorParallel::none`] and every op is Burn's.
#[derive(Module, Debug)]
pub struct Block {
    ln_attn: LayerNorm,
    qkv: ColumnParallelLinear,
    attn_out: RowParallelLinear,
    ln_mlp: LayerNorm,
    /// The MLP (a dense block).
    mlp_in: Option<ColumnParallelLinear>,
    mlp_out: Option<RowParallelLinear>,
    /// The MoE layer in the MLP's place (an MoE block).
    moe: Option<MoE<ExpertMlp>>,
    /// Attention heads of the whole block.
    heads: usize,
}

impl Block {
    /// A block whose MLP is dense, or with `moe` an MoE layer of experts shaped like it.
    fn new(d: usize, heads: usize, moe: Option<(MoeShape, usize)>, device: &Device) -> Self {
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
        }
    }

    /// This rank's slice of the (whole) block: its `heads / tp` heads of q, k and v and the
    /// matching rows of the output projection, its block of the MLP's hidden features;
    /// the LayerNorms whole.
    ///
    /// # Panics
    /// When the heads or the hidden features do not split evenly over the group.
    pub fn sliced(&self, tp: &TensorParallel) -> Self {
        assert!(
            self.heads.is_multiple_of(tp.size()),
            "{} attention heads do not split over {} tensor-parallel ranks",
            self.heads,
            tp.size()
        );
        Self {
            ln_attn: self.ln_attn.clone(),
            qkv: self.qkv.slice(tp.clone()),
            attn_out: self.attn_out.slice(tp.clone()),
            ln_mlp: self.ln_mlp.clone(),
            mlp_in: self.mlp_in.as_ref().map(|l| l.slice(tp.clone())),
            mlp_out: self.mlp_out.as_ref().map(|l| l.slice(tp.clone())),
            // The experts stay whole on every slice.
            moe: self.moe.clone(),
            heads: self.heads,
        }
    }

    /// The block with its four linear layers' weights quantized under `how`.
    fn quantized(&self, how: &WeightQuantization) -> burn_deepspeed::Result<Self> {
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
        })
    }

    /// The block on new positions `x` `[batch, t, d]` that attend to `cache`'s positions and
    /// to themselves under the additive `mask` `[batch, 1, t, cached + t]`; their keys and
    /// values are appended to `cache` (inference: no residual scaling).
    fn forward_cached(
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
    fn heads(&self, x: &Tensor<3>) -> [Tensor<4>; 3] {
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
    fn attend(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4>) -> Tensor<3> {
        let [b, h, t, dh] = q.dims();
        let scores = q.matmul(k.transpose()).div_scalar((dh as f64).sqrt()) + mask;
        let att = attention_softmax(scores).matmul(v);
        let device = att.device();
        scope("attn_out", &device, || {
            self.attn_out
                .forward(att.swap_dims(1, 2).reshape([b, t, h * dh]))
        })
    }

    /// The MLP branch of `x`, and for an MoE block its `l_aux` and routing.
    fn mlp(&self, x: Tensor<3>) -> (Tensor<3>, Option<(Tensor<1>, MoeStats)>) {
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

    /// The block, with its two residual branches multiplied by `scale` (1/p_l for a block
    /// kept by progressive layer dropping, else 1).
    fn forward(&self, x: Tensor<3>, causal: Tensor<4>, scale: f64) -> Tensor<3> {
        self.forward_moe(x, causal, scale).0
    }

    /// [`forward`](Self::forward), with an MoE block's `l_aux` and routing.
    fn forward_moe(
        &self,
        x: Tensor<3>,
        causal: Tensor<4>,
        scale: f64,
    ) -> (Tensor<3>, Option<(Tensor<1>, MoeStats)>) {
        let branch = |y: Tensor<3>| if scale == 1.0 { y } else { y.mul_scalar(scale) };
        let [q, k, v] = self.heads(&x);
        let x = x + branch(self.attend(q, k, v, causal));
        let (y, aux) = self.mlp(x.clone());
        (x + branch(y), aux)
    }
}

/// Token and position embeddings: the first layer of the GPT.
#[derive(Module, Debug)]
pub struct GptEmbed {
    tok_emb: VocabParallelEmbedding,
    pos_emb: VocabParallelEmbedding,
    seq_len: usize,
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

    /// Hidden states `[batch, seq, d]` of token ids `[batch, seq]`.
    pub fn forward(&self, inputs: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = inputs.dims();
        let device = inputs.device();
        assert!(
            t <= self.seq_len,
            "sequence of {t} exceeds the context of {}",
            self.seq_len
        );
        let positions = Tensor::<1, Int>::arange(0..t as i64, &device)
            .reshape([1, t])
            .repeat_dim(0, b);
        self.forward_at(inputs, positions)
    }
}

/// Final LayerNorm and the (untied) output projection: the last layer of the GPT.
#[derive(Module, Debug)]
pub struct GptHead {
    ln_f: LayerNorm,
    head: ColumnParallelLinear,
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
static FUSED_OPS: AtomicBool = AtomicBool::new(true);

/// Makes every GPT of the process use the fused softmax, layer norm and GELU (`true`, the
/// default) or Burn's `softmax`, `LayerNorm::forward` and `gelu` (`false`), for benchmarks
/// that compare the two in one process. The values differ by float rounding only.
pub fn set_fused_ops(on: bool) {
    FUSED_OPS.store(on, Ordering::Relaxed);
}

/// `ln` applied to `x`: under autodiff the fused layer norm, whose backward is one step
/// instead of the decomposition's.
fn norm<const D: usize>(ln: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
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
fn activation(x: Tensor<3>) -> Tensor<3> {
    match FUSED_OPS.load(Ordering::Relaxed) {
        true => gelu(x),
        false => burn::tensor::activation::gelu(x),
    }
}

/// The attention's softmax over the keys (the last dimension of the scores).
fn attention_softmax(scores: Tensor<4>) -> Tensor<4> {
    match FUSED_OPS.load(Ordering::Relaxed) {
        true => softmax(scores, 3),
        false => burn::tensor::activation::softmax(scores, 3),
    }
}

/// The byte-level GPT.
#[derive(Module, Debug)]
pub struct Gpt {
    embed: GptEmbed,
    blocks: Vec<Block>,
    head: GptHead,
    /// Whether each block is an activation checkpoint.
    checkpoint_blocks: bool,
    /// The MoE blocks' routing summed since the log was last drained.
    #[module(skip)]
    moe_log: MoeLog,
}

/// The MoE blocks' figures summed over their forwards since the log was last drained (a
/// bounded tally, whether or not anyone drains it; the `l_aux` values stay on the device
/// until then).
#[derive(Debug, Clone, Default)]
pub struct MoeLog(Arc<Mutex<Pending>>);

/// The log's running sums; `l_aux` as a detached tensor, read once per drain.
#[derive(Debug, Default)]
struct Pending {
    l_aux: Option<Tensor<1>>,
    tally: MoeTally,
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
    fn add(&self, l_aux: Tensor<1>, stats: MoeStats) {
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

/// A batch of token sequences and their next-token targets, each `[batch, seq]`.
#[derive(Debug, Clone)]
pub struct GptBatch {
    /// Input tokens.
    pub inputs: Tensor<2, Int>,
    /// The token after each input token.
    pub targets: Tensor<2, Int>,
    /// Progressive layer dropping for this training micro-batch, if on.
    pub layer_drop: Option<LayerDrop>,
    /// The group the head's vocabulary is cut over, for the pipelined loss (whose last
    /// stage sees only the logits); [`TensorParallel::none`] without slicing.
    pub vocab_group: TensorParallel,
    /// A teacher's logits for these inputs and how to learn from them (knowledge
    /// distillation, Mixture-of-Students), if it teaches this step.
    pub soft_targets: Option<SoftTargets>,
}

/// A teacher's next-token logits `[batch, seq, 256]` for a batch (constants: no gradient
/// flows into the teacher) and the distillation's weights and temperature.
#[derive(Debug, Clone)]
pub struct SoftTargets {
    /// The teacher's logits.
    pub logits: Tensor<3>,
    /// How the student learns from them.
    pub distill: Arc<DistillationConfig>,
}

/// Progressive layer dropping (arXiv 2010.13369) for one training micro-batch: the engine's
/// θ(t) (`DeepSpeedEngine::pld_theta`), handed to the model in the batch the way DeepSpeed
/// passes `pld_theta` to `forward`, and the seed of this micro-batch's draws.
///
/// Block l of L (1-based) is kept with probability p_l = 1 − (l/L)(1 − θ), the paper's
/// schedule; a kept block's attention and MLP outputs are scaled by 1/p_l, a dropped block is
/// the identity. Evaluation never drops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerDrop {
    /// θ(t), the keep probability of the last block.
    pub theta: f64,
    /// Seed of the keep/drop draws.
    pub seed: u64,
}

impl GptBatch {
    /// The batch whose pipelined loss is the vocabulary-parallel cross-entropy over `tp`.
    pub fn with_vocab_group(mut self, tp: TensorParallel) -> Self {
        self.vocab_group = tp;
        self
    }

    /// The batch with progressive layer dropping at `layer_drop`.
    pub fn with_layer_drop(mut self, layer_drop: Option<LayerDrop>) -> Self {
        self.layer_drop = layer_drop;
        self
    }

    /// The batch with a teacher's logits for its inputs.
    pub fn with_soft_targets(mut self, soft_targets: Option<SoftTargets>) -> Self {
        self.soft_targets = soft_targets;
        self
    }
}

impl GptBatch {
    /// Mean next-token cross-entropy of `logits` `[batch, seq, 256 / tp]` (this rank's block
    /// of the vocabulary over `tp`), with the logits (as `[batch·seq, 256 / tp]`) and
    /// flattened targets. The logits are never gathered whole.
    pub fn cross_entropy(
        &self,
        logits: Tensor<3>,
        tp: &TensorParallel,
    ) -> (Tensor<1>, Tensor<2>, Tensor<1, Int>) {
        let [b, t, v] = logits.dims();
        // The loss in f32 whatever the parameters' dtype (its backward casts the gradient
        // back), as mixed precision training computes it.
        let logits = logits.reshape([b * t, v]).cast(FloatDType::F32);
        let targets = self.targets.clone().reshape([b * t]);
        let loss = vocab_parallel_cross_entropy(logits.clone(), targets.clone(), tp);
        (loss, logits, targets)
    }
}

impl Gpt {
    /// A GPT of `shape` initialized from `seed`: N(0, 0.02) weights, N(0, 0.02/√(2L)) for the
    /// two residual output projections, zero biases, unit LayerNorm scales. The values depend
    /// on the seed alone, not on Burn's global RNG or on threads.
    pub fn new(shape: GptShape, seed: u64, device: &Device) -> Self {
        let d = shape.d_model;
        let model = Self {
            embed: GptEmbed {
                tok_emb: VocabParallelEmbedding::from_embedding(
                    &EmbeddingConfig::new(VOCAB, d).init(device),
                    TensorParallel::none(),
                ),
                pos_emb: VocabParallelEmbedding::from_embedding(
                    &EmbeddingConfig::new(shape.seq_len, d).init(device),
                    TensorParallel::none(),
                ),
                seq_len: shape.seq_len,
            },
            // GPT-MoE: the second, fourth, ... blocks are MoE blocks (MoE layer l / 2 of
            // layers / 2, which a pyramid gives more experts near the end).
            blocks: (0..shape.layers)
                .map(|l| {
                    let moe = shape.moe.filter(|_| l % 2 == 1);
                    let moe = moe.map(|m| (m, m.experts_at(l / 2, shape.layers / 2)));
                    Block::new(d, shape.heads, moe, device)
                })
                .collect(),
            head: GptHead {
                ln_f: LayerNormConfig::new(d).init(device),
                head: ColumnParallelLinear::from_linear(
                    &LinearConfig::new(d, VOCAB).with_bias(false).init(device),
                    TensorParallel::none(),
                ),
            },
            checkpoint_blocks: false,
            moe_log: MoeLog::default(),
        };
        model.map(&mut GptInit::new(seed, shape.layers))
    }

    /// A whole GPT of `shape` on `device` with the flat parameters `params` (in its layout
    /// order: a checkpoint's `model.bin`), refused when their count is another model's.
    pub fn from_params(
        shape: GptShape,
        params: &[f32],
        device: &Device,
    ) -> burn_deepspeed::Result<Self> {
        let whole = Self::new(shape, 0, device);
        let layout = ParamLayout::of(&whole);
        if layout.numel != params.len() {
            return Err(burn_deepspeed::DeepSpeedError::Data(format!(
                "{} parameters for a model of {}",
                params.len(),
                layout.numel
            )));
        }
        Ok(params_from_flat(whole, &layout, params))
    }

    /// This rank's part of the (whole) GPT-MoE over `ep`: each MoE block keeps its
    /// `experts / ep_size` experts (recorded in `ep`), its draws seeded from `seed` and the
    /// block (give each data-parallel rank its own seed). A dense GPT is returned as it is.
    pub fn with_experts(mut self, ep: &ExpertParallel, seed: u64) -> burn_deepspeed::Result<Self> {
        for (l, block) in self.blocks.iter_mut().enumerate() {
            if let Some(moe) = block.moe.take() {
                block.moe = Some(moe.expert_parallel(ep)?.with_seed(layer_seed(seed, l)));
            }
        }
        Ok(self)
    }

    /// For serving a sliced model: each MoE block's experts split over the tensor-parallel
    /// group `tp` as well (each rank runs `experts / tp` of them on the tokens every rank
    /// sees, and the outputs are summed over the group; see `MoE::expert_sliced`). Refused
    /// when `tp` does not divide a block's experts. Not for training: a sliced block's gate
    /// gradient would be partial on each rank.
    pub fn with_sliced_experts(mut self, tp: &TensorParallel) -> burn_deepspeed::Result<Self> {
        for block in &mut self.blocks {
            if let Some(moe) = block.moe.take() {
                block.moe = Some(moe.expert_sliced(tp)?);
            }
        }
        Ok(self)
    }

    /// Restarts the MoE layers' draws (random token selection, gate noise) for optimizer
    /// step `step` from `seed` (this rank's, as given to [`with_experts`](Self::with_experts)):
    /// a step draws the same whether the run started at step 0 or resumed from a checkpoint.
    pub fn reseed_experts(&self, seed: u64, step: u64) {
        let step = step.wrapping_mul(0xD1B5_4A32_D192_ED03);
        for (l, block) in self.blocks.iter().enumerate() {
            if let Some(moe) = &block.moe {
                moe.reseed(layer_seed(seed, l) ^ step);
            }
        }
    }

    /// The MoE blocks' figures of every forward since the last call (shared by the model's
    /// clones).
    pub fn moe_log(&self) -> &MoeLog {
        &self.moe_log
    }

    /// This rank's slice of the (whole) model over `tp` (Megatron-LM's split, arXiv
    /// 1909.08053 §3): in each block its heads and its block of the MLP's hidden features,
    /// its block of the vocabulary in the token embedding and the head (the loss is the
    /// vocabulary-parallel cross-entropy), its block of the positions in the position table
    /// (whole when the context does not split evenly); the LayerNorms whole.
    /// Every parameter keeps its id; the slices' layouts are recorded in `tp`. With
    /// [`TensorParallel::none`] the model as it is.
    ///
    /// # Panics
    /// When the heads, the hidden features or the vocabulary do not split evenly.
    pub fn sliced(self, tp: &TensorParallel) -> Self {
        if tp.size() == 1 {
            return self;
        }
        Self {
            embed: GptEmbed {
                tok_emb: self.embed.tok_emb.slice(tp.clone()),
                // Cut like the vocabulary when the positions split evenly, whole otherwise.
                pos_emb: match self.embed.seq_len.is_multiple_of(tp.size()) {
                    true => self.embed.pos_emb.slice(tp.clone()),
                    false => self.embed.pos_emb,
                },
                seq_len: self.embed.seq_len,
            },
            blocks: self.blocks.iter().map(|b| b.sliced(tp)).collect(),
            head: GptHead {
                ln_f: self.head.ln_f,
                head: self.head.head.slice(tp.clone()),
            },
            checkpoint_blocks: self.checkpoint_blocks,
            moe_log: self.moe_log,
        }
    }

    /// The model (whole or this rank's slice) for inference with its weights quantized under
    /// `how` (DeepSpeed-Inference's INT8/INT4 weights): every linear layer's weight, the
    /// token and position tables and the head as codes; the LayerNorms and biases keep their dtype
    /// (the generate example then casts them to fp16: [`crate::generate::in_dtype`]).
    ///
    /// # Errors
    /// When no group fits a weight's rows, or the model is quantized already.
    pub fn quantized(&self, how: &WeightQuantization) -> burn_deepspeed::Result<Self> {
        let blocks = self
            .blocks
            .iter()
            .map(|b| b.quantized(how))
            .collect::<burn_deepspeed::Result<_>>()?;
        Ok(Self {
            embed: GptEmbed {
                tok_emb: self.embed.tok_emb.quantized(how)?,
                pos_emb: self.embed.pos_emb.quantized(how)?,
                seq_len: self.embed.seq_len,
            },
            blocks,
            head: GptHead {
                ln_f: self.head.ln_f.clone(),
                head: self.head.head.quantized(how)?,
            },
            checkpoint_blocks: self.checkpoint_blocks,
            moe_log: self.moe_log.clone(),
        })
    }

    /// Bytes of this rank's weights: its parameters' tensors and its quantized weights'
    /// codes, steps and offsets, measured on what it holds.
    pub fn weight_bytes(&self) -> u64 {
        let quantized: u64 = self
            .blocks
            .iter()
            .map(|b| {
                b.qkv.quantized_bytes()
                    + b.attn_out.quantized_bytes()
                    + b.mlp_in.as_ref().map_or(0, |l| l.quantized_bytes())
                    + b.mlp_out.as_ref().map_or(0, |l| l.quantized_bytes())
            })
            .sum::<u64>()
            + self.embed.tok_emb.quantized_bytes()
            + self.embed.pos_emb.quantized_bytes()
            + self.head.head.quantized_bytes();
        param_bytes(self) + quantized
    }

    /// The model with each block an activation checkpoint (`on`), or not: a checkpointed
    /// block keeps only its input through the forward, and runs again in backward (see
    /// [`burn_deepspeed::activation::checkpoint`]). The GPT example turns it on when the
    /// config has an `activation_checkpointing` section, as DeepSpeed's models read it.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.checkpoint_blocks = on;
        self
    }

    // ANCHOR: checkpoint_block
    /// One block, checkpointed or not (an MoE block never is: its recompute would route
    /// with new draws); an MoE block's figures go to the log, and its `l_aux` is returned.
    fn block(
        &self,
        block: &Block,
        x: Tensor<3>,
        causal: &Tensor<4>,
        scale: f64,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        if self.checkpoint_blocks && block.moe.is_none() {
            let causal = causal.clone();
            let y = checkpoint(block, x, move |b, x| b.forward(x, causal.clone(), scale));
            return (y, None);
        }
        let (y, aux) = block.forward_moe(x, causal.clone(), scale);
        let aux = aux.map(|(l_aux, stats)| {
            self.moe_log.add(l_aux.clone(), stats);
            l_aux
        });
        (y, aux)
    }
    // ANCHOR_END: checkpoint_block

    /// Logits `[batch, seq, 256]`, every block applied.
    pub fn forward(&self, inputs: Tensor<2, Int>) -> Tensor<3> {
        self.forward_dropping(inputs, None)
    }

    /// Logits `[batch, seq, 256]`, with the blocks dropped and scaled as `layer_drop` draws
    /// (see [`LayerDrop`]); `None` applies every block.
    pub fn forward_dropping(
        &self,
        inputs: Tensor<2, Int>,
        layer_drop: Option<LayerDrop>,
    ) -> Tensor<3> {
        self.forward_aux(inputs, layer_drop).0
    }

    /// [`forward_dropping`](Self::forward_dropping), with the sum of the MoE blocks' `l_aux`
    /// (`None` for a dense GPT).
    pub fn forward_aux(
        &self,
        inputs: Tensor<2, Int>,
        layer_drop: Option<LayerDrop>,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let mut aux: Option<Tensor<1>> = None;
        let mut add = |a: Option<Tensor<1>>| {
            if let Some(a) = a {
                aux = Some(match aux.take() {
                    Some(sum) => sum + a,
                    None => a,
                });
            }
        };
        let device = inputs.device();
        // Each layer's forward in a profiler scope: a profile times them (no cost otherwise).
        let mut x = scope("embed", &device, || self.embed.forward(inputs));
        // In the parameters' dtype: one op may not mix f32 with f16 or bf16.
        let causal = causal_mask(x.dims()[1], &x.device()).cast(x.dtype());
        // ANCHOR: pld_forward
        let keep = layer_drop.map(|d| {
            (
                ProgressiveLayerDrop::keep_probabilities(d.theta, self.blocks.len()),
                SplitMix64::new(d.seed),
            )
        });
        match keep {
            None => {
                for (i, block) in self.blocks.iter().enumerate() {
                    let (y, a) = scope(format_args!("blocks.{i}"), &device, || {
                        self.block(block, x, &causal, 1.0)
                    });
                    add(a);
                    x = y;
                }
            }
            Some((p, mut rng)) => {
                for (i, (block, p)) in self.blocks.iter().zip(p).enumerate() {
                    if rng.uniform() < p {
                        let (y, a) = scope(format_args!("blocks.{i}"), &device, || {
                            self.block(block, x, &causal, 1.0 / p)
                        });
                        add(a);
                        x = y;
                    }
                }
            }
        }
        // ANCHOR_END: pld_forward
        (scope("head", &device, || self.head.forward(x)), aux)
    }

    /// Mean next-token cross-entropy over the batch, with the logits and targets flattened.
    /// Drops layers when the batch asks for it (training only: see [`InferenceStep`]).
    pub fn forward_loss(&self, batch: GptBatch) -> ClassificationOutput {
        self.forward_losses(batch).0
    }

    /// [`forward_loss`](Self::forward_loss), with the MoE blocks' summed `l_aux`.
    fn forward_losses(&self, batch: GptBatch) -> (ClassificationOutput, Option<Tensor<1>>) {
        let (logits, aux) = self.forward_aux(batch.inputs.clone(), batch.layer_drop);
        let (loss, logits, targets) = batch.cross_entropy(logits, &self.head.head.tp);
        // With a teacher: its term beside the cross-entropy (the whole vocabulary is here:
        // a run with a teacher does not slice the head).
        let loss = match &batch.soft_targets {
            Some(soft) => {
                let [b, t, v] = soft.logits.dims();
                let teacher = soft.logits.clone().reshape([b * t, v]);
                let kd = distillation_loss(logits.clone(), teacher, soft.distill.temperature);
                soft.distill.loss(loss, Some(kd))
            }
            None => loss,
        };
        (ClassificationOutput::new(loss, logits, targets), aux)
    }

    /// The model as a sequence of pipeline layers: the embeddings, each block, the head. The
    /// parameters (ids and values) are this model's.
    pub fn into_layers(self) -> Vec<GptLayer> {
        // The pipeline engine checkpoints runs of layers itself
        // (`pipeline.activation_checkpoint_interval`).
        std::iter::once(GptLayer::Embed(self.embed))
            .chain(self.blocks.into_iter().map(GptLayer::Block))
            .chain(std::iter::once(GptLayer::Head(self.head)))
            .collect()
    }
}

/// One layer of the pipelined GPT (see [`Gpt::into_layers`]).
// Variants differ in size, but a model holds a few dozen layers: boxing saves nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum GptLayer {
    /// Token and position embeddings (reads the micro-batch).
    Embed(GptEmbed),
    /// A transformer block.
    Block(Block),
    /// Final LayerNorm and output projection.
    Head(GptHead),
}

// ANCHOR: pipe_layer
impl PipeLayer<GptBatch> for GptLayer {
    fn forward(&self, input: LayerInput<'_, GptBatch>) -> Tensor<3> {
        match (self, input) {
            (GptLayer::Embed(e), LayerInput::Batch(batch)) => e.forward(batch.inputs.clone()),
            (GptLayer::Embed(_), LayerInput::Hidden(_)) => {
                panic!("the embedding must be the first layer of the model")
            }
            (GptLayer::Block(b), input) => {
                let x = input.hidden("Block");
                let causal = causal_mask(x.dims()[1], &x.device()).cast(x.dtype());
                b.forward(x, causal, 1.0)
            }
            (GptLayer::Head(h), input) => h.forward(input.hidden("Head")),
        }
    }

    fn type_name(&self) -> String {
        match self {
            GptLayer::Embed(_) => "Embed",
            GptLayer::Block(_) => "Block",
            GptLayer::Head(_) => "Head",
        }
        .to_string()
    }
}

impl PipeBatch for GptBatch {
    fn loss(&self, logits: Tensor<3>) -> Tensor<1> {
        self.cross_entropy(logits, &self.vocab_group).0
    }
}
// ANCHOR_END: pipe_layer

/// Additive causal mask `[1, 1, t, t]`: 0 on and below the diagonal, −1e9 above.
fn causal_mask(t: usize, device: &Device) -> Tensor<4> {
    let values: Vec<f32> = (0..t * t)
        .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
        .collect();
    Tensor::<2>::from_data(TensorData::new(values, [t, t]), device).reshape([1, 1, t, t])
}

// ANCHOR: causal_lm
/// Generation from key/value caches ([`burn_deepspeed::inference::generate`]), whole or
/// sliced (each rank caches its own heads).
impl CausalLm for Gpt {
    fn caches(&self, batch: usize, capacity: usize, device: &Device) -> Vec<KvCache> {
        self.blocks
            .iter()
            .map(|b| {
                let tp = b.qkv.tp.size();
                // The width from the LayerNorm (a quantized weight's tensor is empty).
                let scale = b.ln_attn.gamma.val();
                let ([d], dtype) = (scale.dims(), scale.dtype());
                KvCache::new(batch, b.heads / tp, capacity, d / b.heads, dtype, device)
            })
            .collect()
    }

    fn forward_cached(
        &self,
        tokens: Tensor<2, Int>,
        positions: Tensor<2, Int>,
        mask: Tensor<4>,
        caches: &mut [KvCache],
    ) -> burn_deepspeed::Result<Tensor<3>> {
        let mut x = self.embed.forward_at(tokens, positions);
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            x = block.forward_cached(x, &mask, cache)?;
        }
        Ok(self.head.forward(x))
    }

    fn vocab_group(&self) -> &TensorParallel {
        &self.head.head.tp
    }
}
// ANCHOR_END: causal_lm

impl TrainStep for Gpt {
    type Input = GptBatch;
    type Output = ClassificationOutput;

    /// The next-token loss, plus [`MOE_LOSS_COEF`] times the MoE blocks' `l_aux` for a
    /// GPT-MoE (DeepSpeed-MoE's training loss; evaluation reports the next-token loss alone).
    fn step(&self, batch: GptBatch) -> TrainOutput<ClassificationOutput> {
        let (mut out, aux) = self.forward_losses(batch);
        if let Some(aux) = aux {
            let aux = aux.cast(out.loss.dtype()).mul_scalar(MOE_LOSS_COEF);
            out.loss = out.loss + aux;
        }
        let grads = burn_deepspeed::precision::backward(&out.loss);
        TrainOutput::new(self, grads, out)
    }
}

impl InferenceStep for Gpt {
    type Input = GptBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: GptBatch) -> ClassificationOutput {
        // Evaluation never drops layers.
        self.forward_loss(batch.with_layer_drop(None))
    }
}

/// Re-initializes every parameter deterministically from a seed and its position.
struct GptInit {
    seed: u64,
    layers: usize,
    path: Vec<String>,
    index: u64,
}

impl GptInit {
    fn new(seed: u64, layers: usize) -> Self {
        Self {
            seed,
            layers,
            path: Vec::new(),
            index: 0,
        }
    }
}

impl ModuleMapper for GptInit {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }

    /// Lazy: the values are made when the parameter is first read, so that a model larger
    /// than memory is never whole (ZeRO-3 with `offload_param` cuts it tensor by tensor).
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, shape, device) = (param.id, param.lazy_shape(), param.lazy_device());
        let n = shape.num_elements();
        let name = self.path.last().map(String::as_str).unwrap_or("");
        let in_residual_out =
            (self.path.iter()).any(|p| p == "attn_out" || p == "mlp_out" || p == "fc_out");
        let seed = self.seed ^ (self.index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.index += 1;
        let std = match name {
            "gamma" => None,
            "beta" | "bias" => Some(0.0),
            _ if in_residual_out => Some(0.02 / (2.0 * self.layers as f64).sqrt()),
            _ => Some(0.02),
        };
        let dims = shape.clone();
        let init = move |device: &Device, require_grad: bool| {
            let values: Vec<f32> = match std {
                None => vec![1.0; n],
                Some(0.0) => vec![0.0; n],
                Some(std) => {
                    let mut rng = SplitMix64::new(seed);
                    (0..n).map(|_| (rng.normal() * std) as f32).collect()
                }
            };
            Tensor::<D>::from_data(TensorData::new(values, dims), device)
                .set_require_grad(require_grad)
        };
        Param::uninitialized(id, init, device, true, shape)
    }
}

/// A small, fast, seedable generator (SplitMix64), for reproducible init and sampling.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// MoE block `l`'s draws' seed from the rank's `seed`.
fn layer_seed(seed: u64, l: usize) -> u64 {
    seed ^ (l as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
