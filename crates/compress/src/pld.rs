//! Progressive Layer Dropping (PLD, arXiv 2010.13369): the keep-probability schedule.
//!
//! The global keep ratio decays from 1 to θ̄ as θ(t) = (1 − θ̄)·e^(−γt) + θ̄, advanced once per
//! optimizer step; layer `l` of `L` (1-based) is kept with probability
//! p_l = 1 − (l/L)(1 − θ(t)), so deeper layers are dropped more often.
//!
//! We follow the paper: a layer is sampled and, when kept, scaled with the same p_l. (DeepSpeed's
//! BERT example samples layer `l` with p_{l−1} but scales by p_l.)

/// The PLD schedule (`progressive_layer_drop {theta, gamma}`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProgressiveLayerDrop {
    /// θ̄: the keep ratio the schedule decays to (DeepSpeed default 1.0; the tutorial uses 0.5).
    pub theta: f64,
    /// γ: the decay rate per step (default 0.001).
    pub gamma: f64,
}

impl ProgressiveLayerDrop {
    /// θ(t) = (1 − θ̄)·e^(−γt) + θ̄ at optimizer step `step`.
    pub fn theta_at(&self, step: u64) -> f64 {
        (1.0 - self.theta) * (-self.gamma * step as f64).exp() + self.theta
    }

    /// Keep probability of each of `layers` layers (first layer first) at ratio `theta`:
    /// p_l = 1 − (l/L)(1 − θ), l = 1..L.
    pub fn keep_probabilities(theta: f64, layers: usize) -> Vec<f64> {
        (1..=layers)
            .map(|l| 1.0 - (l as f64 / layers as f64) * (1.0 - theta))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn theta_matches_deepspeed_test_vectors() {
        let pld = ProgressiveLayerDrop {
            theta: 0.5,
            gamma: 0.001,
        };
        for (step, want) in [
            (0, 1.0),
            (100, 0.95242),
            (1000, 0.68394),
            (2000, 0.56767),
            (5000, 0.50337),
        ] {
            let got = pld.theta_at(step);
            assert!(
                (got - want).abs() < 5e-6,
                "θ({step}) = {got}, DeepSpeed {want}"
            );
            let formula = 0.5 * (-0.001 * step as f64).exp() + 0.5;
            assert!((got - formula).abs() <= 1e-12);
        }
        // DeepSpeed's unit test: θ̄ in {0, 0.1, 0.9, 1} follows the formula exactly.
        for theta in [0.0, 0.1, 0.9, 1.0] {
            let pld = ProgressiveLayerDrop {
                theta,
                gamma: 0.001,
            };
            for step in [0, 1, 10, 1000] {
                let want = (1.0 - theta) * (-0.001 * step as f64).exp() + theta;
                assert_eq!(pld.theta_at(step), want);
            }
        }
    }

    #[test]
    fn keep_probabilities_fall_linearly_with_depth() {
        // DeepSpeed's example at θ = 0.68394, L = 12 samples with 1.0, 0.97366, ..., 0.71028;
        // the paper's p_l (ours) is the same sequence shifted by one layer.
        let p = ProgressiveLayerDrop::keep_probabilities(0.68394, 12);
        assert_eq!(p.len(), 12);
        assert!((p[0] - 0.97366).abs() < 1e-5, "{p:?}");
        assert!((p[10] - 0.71028).abs() < 1e-5, "{p:?}");
        assert!((p[11] - 0.68394).abs() < 1e-12, "the last layer keeps θ");
        assert!(p.windows(2).all(|w| w[0] > w[1]));
        assert_eq!(
            ProgressiveLayerDrop::keep_probabilities(1.0, 4),
            vec![1.0; 4]
        );
    }
}
