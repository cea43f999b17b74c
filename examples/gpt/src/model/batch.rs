//! [`GptBatch`]: a micro-batch of byte sequences, with the optional teacher targets and
//! layer-drop draws.

use std::sync::Arc;

use burn::tensor::{FloatDType, Int, Tensor};
use burn_deepspeed::distill::DistillationConfig;
use burn_deepspeed::pipe::PipeBatch;
use burn_deepspeed::sequence::SequenceParallel;
use burn_deepspeed::tensor_parallel::{TensorParallel, vocab_parallel_cross_entropy};

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

    /// This rank's block of positions of every sequence under sequence parallelism (the
    /// batch itself for a group of one). The sequence length must split over the group, as
    /// [`Gpt::with_sequence_parallel`](super::Gpt::with_sequence_parallel) checks of the context.
    pub fn sequence_block(mut self, sp: &SequenceParallel) -> Self {
        if sp.size() > 1 {
            let block =
                |t: Tensor<2, Int>| sp.shard(t, 1).expect("the context splits over the group");
            self.inputs = block(self.inputs);
            self.targets = block(self.targets);
        }
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
        token_cross_entropy(logits, self.targets.clone(), tp)
    }
}

/// Mean cross-entropy of `logits` `[batch, seq, 256 / tp]` against `targets` `[batch, seq]`,
/// with the flattened logits and targets (see [`GptBatch::cross_entropy`]).
pub(crate) fn token_cross_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    tp: &TensorParallel,
) -> (Tensor<1>, Tensor<2>, Tensor<1, Int>) {
    let [b, t, v] = logits.dims();
    // The loss in f32 whatever the parameters' dtype (its backward casts the gradient
    // back), as mixed precision training computes it.
    let logits = logits.reshape([b * t, v]).cast(FloatDType::F32);
    let targets = targets.reshape([b * t]);
    let loss = vocab_parallel_cross_entropy(logits.clone(), targets.clone(), tp);
    (loss, logits, targets)
}

impl PipeBatch for GptBatch {
    fn loss(&self, logits: Tensor<3>) -> Tensor<1> {
        self.cross_entropy(logits, &self.vocab_group).0
    }
}
