//! Burn's stock transformer pieces sliced across a tensor-parallel group (Megatron-LM,
//! arXiv 1909.08053 §3), so that a user slices a `TransformerEncoderLayer` instead of writing
//! the splits: the attention heads are cut across the ranks (the query, key and value
//! projections column-parallel by heads, the output projection row-parallel) and the
//! feed-forward's hidden features too (column, then row). Each block then needs one
//! all-reduce per sub-layer forward and one backward; the LayerNorms stay whole.
//!
//! Dropout draws each rank's own mask: with a dropout probability above 0 the slices of a
//! replicated activation would differ (Megatron keeps a separate RNG state for that); the
//! tests train with dropout 0.

use burn::module::Module;
use burn::nn::activation::Activation;
use burn::nn::attention::MultiHeadAttention;
use burn::nn::transformer::{PositionWiseFeedForward, TransformerEncoderLayer};
use burn::nn::{Dropout, LayerNorm};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::{Bool, Tensor};

use super::{ColumnParallelLinear, RowParallelLinear, TensorParallel};
use crate::{DeepSpeedError, Result};

/// Burn's [`MultiHeadAttention`] with its heads cut across the group: each rank computes
/// `n_heads / tp` heads, and the output projection sums their contributions.
#[derive(Module, Debug)]
pub struct ParallelMultiHeadAttention {
    /// This rank's heads of the query projection.
    pub query: ColumnParallelLinear,
    /// This rank's heads of the key projection.
    pub key: ColumnParallelLinear,
    /// This rank's heads of the value projection.
    pub value: ColumnParallelLinear,
    /// The output projection's rows of this rank's heads.
    pub output: RowParallelLinear,
    /// Dropout on the attention weights.
    pub dropout: Dropout,
    /// Heads on this rank.
    pub n_heads: usize,
    /// Width of one head.
    pub d_k: usize,
    /// The value masked scores take.
    pub min_float: f64,
    /// Softmax with an extra zero logit (Burn's `quiet_softmax`).
    pub quiet_softmax: bool,
}

impl ParallelMultiHeadAttention {
    /// This rank's heads of `mha` (the same layer on every rank).
    ///
    /// # Errors
    /// When the heads do not split evenly over the group.
    pub fn from_mha(mha: &MultiHeadAttention, tp: &TensorParallel) -> Result<Self> {
        if !mha.n_heads.is_multiple_of(tp.size()) {
            return Err(DeepSpeedError::TensorParallel(format!(
                "{} attention heads do not split over {} ranks; choose a \
                 tensor_parallel.tp_size that divides the heads",
                mha.n_heads,
                tp.size()
            )));
        }
        Ok(Self {
            query: ColumnParallelLinear::from_linear(&mha.query, tp.clone())?,
            key: ColumnParallelLinear::from_linear(&mha.key, tp.clone())?,
            value: ColumnParallelLinear::from_linear(&mha.value, tp.clone())?,
            output: RowParallelLinear::from_linear(&mha.output, tp.clone())?,
            dropout: mha.dropout.clone(),
            n_heads: mha.n_heads / tp.size(),
            d_k: mha.d_k,
            min_float: mha.min_float,
            quiet_softmax: mha.quiet_softmax,
        })
    }

    /// The attention's context `[batch, seq_1, d_model]`, whole on every rank, as
    /// `MultiHeadAttention::forward` computes it (`query` `[batch, seq_1, d_model]`, `key`
    /// and `value` `[batch, seq_2, d_model]`, optional padding and attention masks).
    pub fn forward(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let [batch, seq_1, _] = query.dims();
        let heads = |x: Tensor<3>, layer: &ColumnParallelLinear| {
            let [b, s, _] = x.dims();
            layer
                .forward(x)
                .reshape([b, s, self.n_heads, self.d_k])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            heads(query, &self.query),
            heads(key, &self.key),
            heads(value, &self.value),
        );
        let mut scores = q.matmul(k.transpose()).div_scalar((self.d_k as f32).sqrt());
        if let Some(mask) = mask_pad {
            let [b, s] = mask.dims();
            scores = scores.mask_fill(mask.reshape([b, 1, 1, s]), self.min_float);
        }
        if let Some(mask) = mask_attn {
            let [b, s1, s2] = mask.dims();
            scores = scores.mask_fill(mask.reshape([b, 1, s1, s2]), self.min_float);
        }
        let weights = match self.quiet_softmax {
            true => quiet_softmax(scores, 3),
            false => softmax(scores, 3),
        };
        let context = self.dropout.forward(weights).matmul(v);
        let context = context
            .swap_dims(1, 2)
            .reshape([batch, seq_1, self.n_heads * self.d_k]);
        self.output.forward(context)
    }
}

/// Burn's [`PositionWiseFeedForward`] with its hidden features cut across the group.
#[derive(Module, Debug)]
pub struct ParallelFeedForward {
    /// This rank's hidden features of the inner layer.
    pub linear_inner: ColumnParallelLinear,
    /// The outer layer's rows of those features.
    pub linear_outer: RowParallelLinear,
    /// Dropout on the hidden features.
    pub dropout: Dropout,
    /// The activation between the two layers.
    #[module(skip)]
    pub activation: Activation,
}

impl ParallelFeedForward {
    /// This rank's slice of `pwff` (the same layer on every rank).
    ///
    /// # Errors
    /// When the hidden features do not split evenly over the group.
    pub fn from_feed_forward(pwff: &PositionWiseFeedForward, tp: &TensorParallel) -> Result<Self> {
        Ok(Self {
            linear_inner: ColumnParallelLinear::from_linear(&pwff.linear_inner, tp.clone())?,
            linear_outer: RowParallelLinear::from_linear(&pwff.linear_outer, tp.clone())?,
            dropout: pwff.dropout.clone(),
            activation: pwff.activation.clone(),
        })
    }

    /// The feed-forward of `x`, whole on every rank.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let hidden = self.activation.forward(self.linear_inner.forward(x));
        self.linear_outer.forward(self.dropout.forward(hidden))
    }
}

/// Burn's [`TransformerEncoderLayer`] sliced: its attention and feed-forward cut across the
/// group, its LayerNorms whole.
#[derive(Module, Debug)]
pub struct ParallelTransformerEncoderLayer {
    /// The sliced attention.
    pub mha: ParallelMultiHeadAttention,
    /// The sliced feed-forward.
    pub pwff: ParallelFeedForward,
    /// LayerNorm around the feed-forward.
    pub norm_1: LayerNorm,
    /// LayerNorm around the attention.
    pub norm_2: LayerNorm,
    /// Dropout on the residual branches.
    pub dropout: Dropout,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
}

impl ParallelTransformerEncoderLayer {
    /// This rank's slice of `layer` (the same layer on every rank): the parameters keep their
    /// ids, and the slices' layouts are recorded in `tp`.
    ///
    /// # Errors
    /// When the heads or the feed-forward's features do not split evenly over the group.
    pub fn from_layer(layer: &TransformerEncoderLayer, tp: &TensorParallel) -> Result<Self> {
        Ok(Self {
            mha: ParallelMultiHeadAttention::from_mha(&layer.mha, tp)?,
            pwff: ParallelFeedForward::from_feed_forward(&layer.pwff, tp)?,
            norm_1: layer.norm_1.clone(),
            norm_2: layer.norm_2.clone(),
            dropout: layer.dropout.clone(),
            norm_first: layer.norm_first,
        })
    }

    /// The layer on `input` `[batch, seq, d_model]`, as `TransformerEncoderLayer::forward`.
    pub fn forward(
        &self,
        input: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let x = input;
        let normed = match self.norm_first {
            true => self.norm_2.forward(x.clone()),
            false => x.clone(),
        };
        let attended =
            self.mha
                .forward(normed.clone(), normed.clone(), normed, mask_pad, mask_attn);
        let mut x = x + self.dropout.forward(attended);
        let normed = if self.norm_first {
            self.norm_1.forward(x.clone())
        } else {
            x = self.norm_1.forward(x);
            x.clone()
        };
        let x = x + self.dropout.forward(self.pwff.forward(normed));
        match self.norm_first {
            true => x,
            false => self.norm_2.forward(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::nn::attention::generate_autoregressive_mask;
    use burn::nn::transformer::TransformerEncoderConfig;
    use burn::tensor::{Device, Distribution};
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::super::test_util::{close, read};
    use super::*;
    use crate::launch::launch;

    /// A stock pre-norm and post-norm encoder layer (4 heads, a causal mask) sliced over 2
    /// and 4 ranks: the output, the input's gradient and each slice's query-weight gradient
    /// are the whole layer's.
    #[test]
    fn a_sliced_stock_encoder_layer_matches_the_whole_one() {
        let device = Device::flex().autodiff();
        let (d, heads, d_ff, seq) = (8, 4, 16, 5);
        let x0 =
            Tensor::<3>::random([2, seq, d], Distribution::Default, &Device::flex()).into_data();
        let causal = || generate_autoregressive_mask(2, seq, &device);
        for norm_first in [true, false] {
            let config = TransformerEncoderConfig::new(d, d_ff, heads, 1)
                .with_dropout(0.0)
                .with_norm_first(norm_first);
            let whole = TransformerEncoderLayer::new(&config, &device);
            let run = |f: &dyn Fn(Tensor<3>) -> Tensor<3>| {
                let x = Tensor::<3>::from_data(x0.clone(), &device).require_grad();
                let y = f(x.clone());
                let grads = (y.clone() * y.clone()).sum().backward();
                (read(y), read(x.grad(&grads).expect("x's gradient")), grads)
            };
            let (y, gx, grads) = run(&|x| whole.forward(x, None, Some(causal())));
            let gq = whole.mha.query.weight.grad(&grads).expect("query gradient");
            for world in [2usize, 4] {
                let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
                    let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
                    let layer = ParallelTransformerEncoderLayer::from_layer(&whole, &tp)
                        .expect("the heads split");
                    let (y, gx, grads) = run(&|x| layer.forward(x, None, Some(causal())));
                    if let Some(e) = tp.take_error() {
                        panic!("{e}");
                    }
                    let gq = layer
                        .mha
                        .query
                        .weight
                        .grad(&grads)
                        .expect("a slice's gradient");
                    Ok((tp.rank(), y, gx, read(gq)))
                })
                .expect("the ranks run");
                let cols = d / world;
                for (r, ys, gxs, gqs) in ranks {
                    close(&ys, &y, "output");
                    close(&gxs, &gx, "input gradient");
                    let slice = gq.clone().slice([0..d, r * cols..(r + 1) * cols]);
                    close(&gqs, &read(slice), "query slice gradient");
                }
            }
        }
    }

    /// A group that does not divide the heads, or the features, is refused with an error that
    /// names the count and the key to change (it panicked); so is slicing a slice.
    #[test]
    fn layers_that_do_not_split_are_refused_with_an_error() {
        let device = Device::flex();
        let config = TransformerEncoderConfig::new(8, 10, 4, 1).with_dropout(0.0);
        let whole = TransformerEncoderLayer::new(&config, &device);
        let (_, errors) = launch(3, Duration::from_secs(60), |comm| {
            let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
            let layer = ParallelTransformerEncoderLayer::from_layer(&whole, &tp).err();
            let ff = ParallelFeedForward::from_feed_forward(&whole.pwff, &tp).err();
            Ok((layer.map(|e| e.to_string()), ff.map(|e| e.to_string())))
        })
        .expect("the ranks run");
        for (layer, ff) in errors {
            let layer = layer.expect("refused");
            assert!(
                layer.contains("4 attention heads do not split over 3 ranks")
                    && layer.contains("tensor_parallel.tp_size"),
                "{layer}"
            );
            let ff = ff.expect("refused");
            assert!(ff.contains("10 features in 1 sections"), "{ff}");
        }
        let (_, errors) = launch(2, Duration::from_secs(60), |comm| {
            let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
            let half = ColumnParallelLinear::from_linear(&whole.pwff.linear_inner, tp.clone())?;
            Ok(half.slice(tp).err().map(|e| e.to_string()))
        })
        .expect("the ranks run");
        for e in errors {
            let e = e.expect("refused");
            assert!(e.contains("a slice already"), "{e}");
        }
    }
}
