//! Megatron's vocabulary-parallel cross-entropy (arXiv 1909.08053 §3): the loss of logits
//! whose vocabulary is cut across the tensor-parallel group (the output of a
//! column-parallel head), computed from per-rank partial sums so that the logits are never
//! gathered whole. Each rank sends three numbers per token: its largest logit, its sum of
//! exponentials and its target logit (zero when another rank holds the target).

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};

use super::TensorParallel;
use super::embedding::{local_ids, vocab_rows};

/// Mean cross-entropy of `logits` `[tokens, vocab / tp]` (this rank's block of the
/// vocabulary) against `targets` `[tokens]` (ids in the whole vocabulary), the same on every
/// rank of `tp`. Its backward gives each rank the gradient of its own block. With a group of
/// one it is Burn's `CrossEntropyLoss`.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    tp: &TensorParallel,
) -> Tensor<1> {
    if tp.size() == 1 {
        return CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets);
    }
    let [_, block] = logits.dims();
    // The stabilising shift is a constant for autodiff: any value gives the same loss.
    let max = tp.max(logits.clone().max_dim(1));
    let shifted = logits - max;
    // The sums go through `reduce` (identity backward): every rank computes the same loss,
    // and each one's own block is all its backward reaches.
    let sum_exp = tp.reduce(shifted.clone().exp().sum_dim(1));
    let (index, held) = local_ids(targets, vocab_rows(block * tp.size(), tp));
    let held = held.cast(shifted.dtype()).unsqueeze_dim(1);
    let target = tp.reduce(shifted.gather(1, index.unsqueeze_dim(1)) * held);
    (sum_exp.log() - target).mean()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::tensor::{Device, Distribution, TensorData};
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::super::test_util::{close, read};
    use super::*;
    use crate::launch::launch;

    /// Logits over 12 classes cut over 2, 3 and 4 ranks: the loss is Burn's on the whole
    /// logits, and each rank's block gets its block of the whole gradient.
    #[test]
    fn the_sliced_loss_is_the_whole_one() {
        let device = Device::flex().autodiff();
        let (tokens, vocab) = (7, 12);
        let values = Tensor::<2>::random(
            [tokens, vocab],
            Distribution::Normal(0.0, 3.0),
            &Device::flex(),
        )
        .into_data();
        let targets = TensorData::new(vec![0i64, 11, 5, 6, 3, 9, 4], [tokens]);
        let logits = Tensor::<2>::from_data(values.clone(), &device).require_grad();
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.clone(), Tensor::from_data(targets.clone(), &device));
        let grads = loss.backward();
        let (whole_loss, whole_g) = (read(loss), logits.grad(&grads).expect("gradient"));
        for world in [2usize, 3, 4] {
            let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
                let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
                let cols = vocab / world;
                let r = tp.rank();
                let block = Tensor::<2>::from_data(values.clone(), &device)
                    .slice([0..tokens, r * cols..(r + 1) * cols])
                    .detach()
                    .require_grad();
                let targets = Tensor::from_data(targets.clone(), &device);
                let loss = vocab_parallel_cross_entropy(block.clone(), targets, &tp);
                let grads = loss.backward();
                if let Some(e) = tp.take_error() {
                    panic!("{e}");
                }
                Ok((r, read(loss), read(block.grad(&grads).expect("gradient"))))
            })
            .expect("the ranks run");
            let cols = vocab / world;
            for (r, loss, g) in ranks {
                close(&loss, &whole_loss, "loss");
                let slice = whole_g.clone().slice([0..tokens, r * cols..(r + 1) * cols]);
                close(&g, &read(slice), "the block's gradient");
            }
        }
    }
}
