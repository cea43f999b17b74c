//! [`generate`]: prefill over a batch of prompts of any lengths (left-padded, the pads
//! masked), then one token per step from the key/value caches, for any [`CausalLm`].

use std::time::{Duration, Instant};

use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;

use super::{KvCache, Sampler, Sampling};
use crate::tensor_parallel::{SliceLayout, TensorParallel};
use crate::{DeepSpeedError, Result};

/// The value a masked attention score gets (added before the softmax).
pub const MASKED: f32 = -1e9;

/// A causal language model that decodes from key/value caches, whole or sliced across a
/// tensor-parallel group.
pub trait CausalLm {
    /// One cache per attention layer for `batch` sequences of at most `capacity`
    /// positions, on `device`.
    fn caches(&self, batch: usize, capacity: usize, device: &Device) -> Vec<KvCache>;

    /// The logits `[batch, t, vocab / tp]` (this rank's block of the vocabulary) of
    /// `tokens` `[batch, t]` at `positions` `[batch, t]`, each attending to the cached
    /// positions and to the new ones under `mask` `[batch, 1, t, cached + t]` (0 where it
    /// may attend, [`MASKED`] where not, to be added to the scores); appends the new keys
    /// and values to `caches`.
    fn forward_cached(
        &self,
        tokens: Tensor<2, Int>,
        positions: Tensor<2, Int>,
        mask: Tensor<4>,
        caches: &mut [KvCache],
    ) -> Result<Tensor<3>>;

    /// The group the vocabulary of the logits is cut over ([`TensorParallel::none`] when
    /// whole).
    fn vocab_group(&self) -> &TensorParallel;
}

/// What [`generate`] does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    /// Tokens generated after each prompt.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
}

/// The tokens generated and the time it took, measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Generation {
    /// The new tokens of each prompt, in prompt order.
    pub tokens: Vec<Vec<u32>>,
    /// Time of the prefill (up to the first token: the time to first token).
    pub prefill: Duration,
    /// Time of each decode step after it.
    pub steps: Vec<Duration>,
    /// Bytes of the key/value caches.
    pub cache_bytes: u64,
}

/// The most positions (prompt and new tokens) a generation may ask its caches for: 2^24, far
/// beyond any context length, and small enough that sizing the caches cannot overflow.
pub const MAX_CONTEXT: usize = 1 << 24;

/// Generates `options.max_new_tokens` tokens after each of `prompts` (token ids; lengths
/// may differ, at least one token each) with `model` on `device` (without autodiff). The
/// prompts are left-padded to the longest and the pads masked, so each sequence attends to
/// its own tokens only. With a sliced model every rank of its group calls it with the same
/// prompts and options, and every rank returns the same tokens.
pub fn generate<M: CausalLm>(
    model: &M,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    device: &Device,
) -> Result<Generation> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(DeepSpeedError::Data(
            "generate needs at least one prompt, each of at least one token".into(),
        ));
    }
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let capacity = longest
        .checked_add(options.max_new_tokens)
        .filter(|&c| c <= MAX_CONTEXT)
        .ok_or_else(|| {
            DeepSpeedError::Data(format!(
                "max_new_tokens {} after a prompt of {longest} tokens exceeds {MAX_CONTEXT} \
                 positions, more than any cache holds; ask for fewer tokens",
                options.max_new_tokens
            ))
        })?;
    let mut caches = model.caches(batch, capacity, device);
    let mut sampler = Sampler::new(options.sampling);
    let mut out = vec![Vec::with_capacity(options.max_new_tokens); batch];
    if options.max_new_tokens == 0 {
        let cache_bytes = caches.iter().map(KvCache::bytes).sum();
        return Ok(Generation {
            tokens: out,
            prefill: Duration::ZERO,
            steps: Vec::new(),
            cache_bytes,
        });
    }

    // Prefill: every prompt position at once.
    let start = Instant::now();
    let mut tokens = Vec::with_capacity(batch * longest);
    let mut positions = Vec::with_capacity(batch * longest);
    for (prompt, &pad) in prompts.iter().zip(&pads) {
        tokens.extend(std::iter::repeat_n(0i64, pad));
        tokens.extend(prompt.iter().map(|&t| i64::from(t)));
        positions.extend((0..longest).map(|j| j.saturating_sub(pad) as i64));
    }
    let mask = prefill_mask(&pads, longest);
    let logits = model.forward_cached(
        int(tokens, [batch, longest], device),
        int(positions, [batch, longest], device),
        Tensor::from_data(TensorData::new(mask, [batch, 1, longest, longest]), device),
        &mut caches,
    )?;
    let mut next = next_tokens(model.vocab_group(), logits, &mut sampler)?;
    let prefill = start.elapsed();

    let mut steps = Vec::with_capacity(options.max_new_tokens - 1);
    for step in 1..=options.max_new_tokens {
        for (o, t) in out.iter_mut().zip(&next) {
            o.push(*t);
        }
        if step == options.max_new_tokens {
            break;
        }
        let start = Instant::now();
        // The new token of sequence i sits at position len_i + step - 1.
        let cached = longest + step - 1;
        let positions: Vec<i64> = prompts
            .iter()
            .map(|p| (p.len() + step - 1) as i64)
            .collect();
        let mask: Vec<f32> = pads
            .iter()
            .flat_map(|&pad| (0..=cached).map(move |k| if k < pad { MASKED } else { 0.0 }))
            .collect();
        let logits = model.forward_cached(
            int(
                next.iter().map(|&t| i64::from(t)).collect(),
                [batch, 1],
                device,
            ),
            int(positions, [batch, 1], device),
            Tensor::from_data(TensorData::new(mask, [batch, 1, 1, cached + 1]), device),
            &mut caches,
        )?;
        next = next_tokens(model.vocab_group(), logits, &mut sampler)?;
        steps.push(start.elapsed());
    }
    Ok(Generation {
        tokens: out,
        prefill,
        steps,
        cache_bytes: caches.iter().map(KvCache::bytes).sum(),
    })
}

fn int<const D: usize>(values: Vec<i64>, shape: [usize; D], device: &Device) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The prefill's additive mask `[batch, 1, t, t]` for left pads `pads`: a query attends to
/// the keys at or before it that are not pads (a pad query to itself alone).
fn prefill_mask(pads: &[usize], t: usize) -> Vec<f32> {
    let mut mask = Vec::with_capacity(pads.len() * t * t);
    for &pad in pads {
        for q in 0..t {
            for k in 0..t {
                let allowed = k <= q && (k >= pad || k == q);
                mask.push(if allowed { 0.0 } else { MASKED });
            }
        }
    }
    mask
}

/// The next token of each sequence from `logits` `[batch, t, vocab / tp]` at its last
/// position, the vocabulary's blocks gathered over `group` first (only that position's); a
/// collective over the group.
pub fn next_tokens(
    group: &TensorParallel,
    logits: Tensor<3>,
    sampler: &mut Sampler,
) -> Result<Vec<u32>> {
    let [batch, t, block] = logits.dims();
    let last = logits
        .slice([0..batch, t - 1..t, 0..block])
        .reshape([batch, block]);
    let layout = SliceLayout {
        dim: 1,
        sections: 1,
    };
    let whole = group.gather(last, layout)?;
    let vocab = whole.dims()[1];
    let values = whole
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| DeepSpeedError::Data(format!("logits: {e:?}")))?;
    Ok(values
        .chunks(vocab)
        .map(|row| sampler.next(row) as u32)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_mask_is_causal_and_hides_the_pads() {
        let m = prefill_mask(&[0, 2], 3);
        let allowed = |i: usize| m[i] == 0.0;
        // Sequence 0: lower triangle.
        let first: Vec<bool> = (0..9).map(allowed).collect();
        assert_eq!(
            first,
            [true, false, false, true, true, false, true, true, true]
        );
        // Sequence 1 (two pads): the pad queries see themselves, the token only itself.
        let second: Vec<bool> = (9..18).map(allowed).collect();
        assert_eq!(
            second,
            [true, false, false, false, true, false, false, false, true]
        );
    }
}
