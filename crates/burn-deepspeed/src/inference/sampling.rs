//! [`Sampling`]: how the next token is chosen from a row of logits: greedy, or a seeded
//! draw at a temperature, restricted to the top k tokens and to the nucleus of probability
//! p (top-p). Runs on the host over one row of the whole vocabulary.

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equals).
    Greedy,
    /// A draw from softmax(logits / `temperature`), over the `top_k` most likely tokens
    /// (0: every token) and, of those, the fewest whose probability reaches `top_p` (1: every
    /// one); reproducible from `seed`.
    Random {
        /// Divides the logits (above 0).
        temperature: f32,
        /// Tokens kept by rank (0 keeps all).
        top_k: usize,
        /// Probability mass kept (in (0, 1]).
        top_p: f32,
        /// Seed of the draws.
        seed: u64,
    },
}

/// Uniform in [0, 1) from the SplitMix64 generator of state `state` (advanced by one draw).
pub(crate) fn splitmix_uniform(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

/// A [`Sampling`] with its random state: the draws of one generation.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    state: u64,
}

impl Sampler {
    /// The sampler of `sampling` (its seed, if any, starts the draws).
    pub fn new(sampling: Sampling) -> Self {
        let state = match sampling {
            Sampling::Random { seed, .. } => seed,
            Sampling::Greedy => 0,
        };
        Self { sampling, state }
    }

    /// Uniform in [0, 1) (SplitMix64).
    pub(crate) fn uniform(&mut self) -> f64 {
        splitmix_uniform(&mut self.state)
    }

    /// The next token of a row of `logits` over the whole vocabulary.
    pub fn next(&mut self, logits: &[f32]) -> usize {
        let (temperature, top_k, top_p) = match self.sampling {
            Sampling::Greedy => return argmax(logits),
            Sampling::Random {
                temperature,
                top_k,
                top_p,
                ..
            } => (temperature.max(f32::MIN_POSITIVE), top_k, top_p),
        };
        // Tokens by decreasing logit (the lower id first among equals).
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if top_k > 0 {
            order.truncate(top_k);
        }
        let top = logits[order[0]] as f64;
        let weights: Vec<f64> = order
            .iter()
            .map(|&t| ((logits[t] as f64 - top) / temperature as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        // The nucleus: the fewest tokens whose probability reaches top_p.
        let mut kept = 0;
        let mut mass = 0.0;
        while kept < weights.len() {
            mass += weights[kept] / total;
            kept += 1;
            if mass >= top_p as f64 {
                break;
            }
        }
        let kept_total: f64 = weights[..kept].iter().sum();
        let mut draw = self.uniform() * kept_total;
        for (i, w) in weights[..kept].iter().enumerate() {
            if draw < *w {
                return order[i];
            }
            draw -= w;
        }
        order[kept - 1]
    }
}

/// The index of the largest value (the first among equals).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(
            Sampler::new(Sampling::Greedy).next(&[0.1, 3.0, -1.0, 3.0]),
            1
        );
    }

    #[test]
    fn top_k_1_and_a_tiny_nucleus_are_greedy() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        for (top_k, top_p) in [(1, 1.0), (0, 1e-6)] {
            let mut s = Sampler::new(Sampling::Random {
                temperature: 1.0,
                top_k,
                top_p,
                seed: 7,
            });
            assert!((0..50).all(|_| s.next(&logits) == 1));
        }
    }

    /// Draws follow softmax(logits / T) within 2% over 20,000 draws, repeat with the seed,
    /// and top-k 2 never draws a third token.
    #[test]
    fn draws_follow_the_softmax_and_repeat_with_the_seed() {
        let logits = [1.0f32, 0.0, -1.0];
        let sampling = Sampling::Random {
            temperature: 2.0,
            top_k: 0,
            top_p: 1.0,
            seed: 11,
        };
        let (mut a, mut b) = (Sampler::new(sampling), Sampler::new(sampling));
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            let t = a.next(&logits);
            assert_eq!(t, b.next(&logits), "the same seed draws the same tokens");
            counts[t] += 1;
        }
        let z: f64 = logits.iter().map(|l| (*l as f64 / 2.0).exp()).sum();
        for (t, c) in counts.iter().enumerate() {
            let p = (logits[t] as f64 / 2.0).exp() / z;
            assert!(
                (*c as f64 / 20_000.0 - p).abs() < 0.02,
                "token {t}: {c} vs {p}"
            );
        }
        let mut k2 = Sampler::new(Sampling::Random {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 3,
        });
        assert!((0..1000).all(|_| k2.next(&logits) != 2));
    }
}
