//! [`Gpt`]: the whole model, its forward and loss, and the same model as pipeline layers, as
//! a causal language model for generation, and as a Burn `TrainStep`.

use burn::module::Module;
use burn::nn::{EmbeddingConfig, LayerNormConfig, LinearConfig};

use super::{batch::*, init::*, layers::*, moe_log::*, shape::*};
use burn::tensor::{Device, FloatDType, Int, Tensor};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_deepspeed::activation::{checkpoint, checkpoint_tiles};
use burn_deepspeed::distill::distillation_loss;
use burn_deepspeed::flat::{ParamLayout, params_from_flat};
use burn_deepspeed::inference::{CausalLm, KvCache, WeightQuantization};
use burn_deepspeed::memory::param_bytes;
use burn_deepspeed::moe::ExpertParallel;
use burn_deepspeed::pipe::{LayerInput, PipeLayer};
use burn_deepspeed::pld::ProgressiveLayerDrop;
use burn_deepspeed::profiler::scope;
use burn_deepspeed::sequence::SequenceParallel;
use burn_deepspeed::tensor_parallel::{
    ColumnParallelLinear, TensorParallel, VocabParallelEmbedding,
};

/// The byte-level GPT.
#[derive(Module, Debug)]
pub struct Gpt {
    pub(crate) embed: GptEmbed,
    pub(crate) blocks: Vec<Block>,
    pub(crate) head: GptHead,
    /// Whether each block is an activation checkpoint.
    pub(crate) checkpoint_blocks: bool,
    /// How the blocks and the loss keep their activations over long sequences.
    #[module(skip)]
    pub(crate) long: LongContext,
    /// The MoE blocks' routing summed since the log was last drained.
    #[module(skip)]
    pub(crate) moe_log: MoeLog,
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
                )
                .expect("a whole table is not cut"),
                pos_emb: VocabParallelEmbedding::from_embedding(
                    &EmbeddingConfig::new(shape.seq_len, d).init(device),
                    TensorParallel::none(),
                )
                .expect("a whole table is not cut"),
                seq_len: shape.seq_len,
                sp: SequenceParallel::none(),
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
                )
                .expect("a whole layer is not cut"),
            },
            checkpoint_blocks: false,
            long: LongContext::default(),
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
    /// # Errors
    /// When the heads, the hidden features or the vocabulary do not split evenly.
    pub fn sliced(self, tp: &TensorParallel) -> burn_deepspeed::Result<Self> {
        if tp.size() == 1 {
            return Ok(self);
        }
        Ok(Self {
            embed: GptEmbed {
                tok_emb: self.embed.tok_emb.slice(tp.clone())?,
                // Cut like the vocabulary when the positions split evenly, whole otherwise.
                pos_emb: match self.embed.seq_len.is_multiple_of(tp.size()) {
                    true => self.embed.pos_emb.slice(tp.clone())?,
                    false => self.embed.pos_emb,
                },
                seq_len: self.embed.seq_len,
                sp: self.embed.sp,
            },
            blocks: (self.blocks.iter())
                .map(|b| b.sliced(tp))
                .collect::<burn_deepspeed::Result<_>>()?,
            head: GptHead {
                ln_f: self.head.ln_f,
                head: self.head.head.slice(tp.clone())?,
            },
            checkpoint_blocks: self.checkpoint_blocks,
            long: self.long,
            moe_log: self.moe_log,
        })
    }

    /// The model for DeepSpeed-Ulysses sequence parallelism over `sp` (arXiv 2309.14509):
    /// each rank then takes its block of every sequence's positions (see
    /// [`SequenceParallel::shard`]), and each block's attention exchanges heads with the
    /// group. The identity for a group of one.
    ///
    /// # Errors
    /// When the heads or the context do not split over the group, naming
    /// `sequence_parallel_size`.
    pub fn with_sequence_parallel(mut self, sp: &SequenceParallel) -> burn_deepspeed::Result<Self> {
        if sp.size() == 1 {
            return Ok(self);
        }
        // Sliced, a rank's attention holds heads / tp of them, which the group splits again.
        if let Some(block) = self.blocks.first() {
            sp.check_heads(block.heads / block.qkv.tp.size())?;
        }
        if !self.embed.seq_len.is_multiple_of(sp.size()) {
            return Err(burn_deepspeed::DeepSpeedError::Unsupported {
                key: burn_deepspeed::sequence::SEQUENCE_PARALLEL_KEY.into(),
                reason: format!(
                    "a context of {} positions does not split over {} ranks",
                    self.embed.seq_len,
                    sp.size()
                ),
            });
        }
        self.embed.sp = sp.clone();
        for block in &mut self.blocks {
            block.sp = sp.clone();
        }
        Ok(self)
    }

    /// The sequence-parallel group the model was given ([`SequenceParallel::none`] by
    /// default).
    pub fn sequence_parallel(&self) -> &SequenceParallel {
        &self.embed.sp
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
                sp: self.embed.sp.clone(),
            },
            blocks,
            head: GptHead {
                ln_f: self.head.ln_f.clone(),
                head: self.head.head.quantized(how)?,
            },
            checkpoint_blocks: self.checkpoint_blocks,
            long: self.long,
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

    /// The model keeping its activations over long sequences as `long` says (blockwise
    /// attention, tiles of the MLP and the loss; see [`LongContext`]). A tile must hold at
    /// least one position.
    pub fn with_long_context(mut self, long: LongContext) -> Self {
        assert!(long.tile != Some(0), "a tile holds at least one position");
        self.long = long;
        for block in &mut self.blocks {
            block.long = long;
        }
        self
    }

    // ANCHOR: checkpoint_block
    /// One block, checkpointed or not (an MoE block never is: its recompute would route
    /// with new draws); an MoE block's figures go to the log, and its `l_aux` is returned.
    pub(crate) fn block(
        &self,
        block: &Block,
        x: Tensor<3>,
        causal: &Option<Tensor<4>>,
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
        let device = inputs.device();
        let (x, aux) = self.hidden(inputs, layer_drop);
        (scope("head", &device, || self.head.forward(x)), aux)
    }

    /// The last block's output `[batch, seq, d]` (what the head reads), with the MoE blocks'
    /// summed `l_aux`.
    fn hidden(
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
        // In the parameters' dtype: one op may not mix f32 with f16 or bf16. Attention runs
        // over whole sequences (under sequence parallelism, after the heads' exchange).
        let whole = x.dims()[1] * self.embed.sp.size();
        let causal = self.blocks.first().and_then(|b| b.mask(whole, &x));
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
        (x, aux)
    }

    /// Mean next-token cross-entropy over the batch, with the logits and targets flattened.
    /// Drops layers when the batch asks for it (training only: see [`InferenceStep`]).
    pub fn forward_loss(&self, batch: GptBatch) -> ClassificationOutput {
        self.forward_losses(batch).0
    }

    /// [`forward_loss`](Self::forward_loss), with the MoE blocks' summed `l_aux`.
    pub(crate) fn forward_losses(
        &self,
        batch: GptBatch,
    ) -> (ClassificationOutput, Option<Tensor<1>>) {
        let tile = self.long.tile.filter(|_| batch.soft_targets.is_none());
        if let Some(tile) = tile {
            let (x, aux) = self.hidden(batch.inputs.clone(), batch.layer_drop);
            return (self.tiled_loss(x, &batch, tile), aux);
        }
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

    /// ALST's tiled loss: the head and the cross-entropy over tiles of `tile` positions of
    /// the last hidden states `x`, each tile an activation checkpoint, so that its logits and
    /// their softmax exist for one tile at a time, in the forward and in the backward. The
    /// mean is the untiled one (each tile's mean weighted by its share of the positions). The
    /// output's logits, for metrics only, are made again outside the graph.
    fn tiled_loss(&self, x: Tensor<3>, batch: &GptBatch, tile: usize) -> ClassificationOutput {
        let t = x.dims()[1];
        let targets = batch.targets.clone();
        let losses = checkpoint_tiles(&self.head, x.clone(), 1, tile, move |head, x, start| {
            let n = x.dims()[1];
            let tile_targets = targets.clone().narrow(1, start, n);
            let (loss, _, _) = token_cross_entropy(head.forward(x), tile_targets, &head.head.tp);
            loss.mul_scalar(n as f64 / t as f64)
        });
        let loss = losses
            .into_iter()
            .reduce(|a, b| a + b)
            .expect("a sequence has at least one position");
        let logits = self.head.clone().no_grad().forward(x.detach());
        let [b, _, v] = logits.dims();
        let logits = logits.reshape([b * t, v]).cast(FloatDType::F32);
        ClassificationOutput::new(loss, logits, batch.targets.clone().reshape([b * t]))
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
                let causal = b.mask(x.dims()[1], &x);
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

// ANCHOR_END: pipe_layer

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
