//! Batch-size resolution: `train_batch_size = micro_batch_per_gpu × gradient_accumulation_steps
//! × data-parallel world size`, any two of the three determining the third (as DeepSpeed's
//! `_set_batch_related_parameters`).

use serde::Serialize;

use crate::{DeepSpeedError, Result};

/// The three batch numbers, resolved for one data-parallel world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchSizes {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per forward/backward on one rank.
    pub train_micro_batch_size_per_gpu: u64,
    /// Micro-batches per optimizer step on one rank.
    pub gradient_accumulation_steps: u64,
    /// Data-parallel ranks.
    pub world_size: u64,
}

/// Resolves the batch numbers for `world` data-parallel ranks.
pub fn resolve_batch(
    train: Option<u64>,
    micro: Option<u64>,
    gas: Option<u64>,
    world: u64,
) -> Result<BatchSizes> {
    let err = |m: String| Err(DeepSpeedError::BatchSize(m));
    for (name, v) in [
        ("train_batch_size", train),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", gas),
    ] {
        if v == Some(0) {
            return err(format!("{name} must be at least 1, found 0"));
        }
    }
    if world == 0 {
        return err("the world size must be at least 1".into());
    }
    let (train, micro, gas) = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => {
            if t % (m * world) != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by train_micro_batch_size_per_gpu \
                     ({m}) × world size ({world}) = {}, so gradient_accumulation_steps would \
                     not be a whole number",
                    m * world
                ));
            }
            (t, m, t / (m * world))
        }
        (Some(t), None, Some(g)) => {
            if t % (g * world) != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by gradient_accumulation_steps \
                     ({g}) × world size ({world}) = {}",
                    g * world
                ));
            }
            (t, t / (g * world), g)
        }
        (None, Some(m), Some(g)) => (m * g * world, m, g),
        (Some(t), None, None) => {
            if t % world != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by the world size ({world})"
                ));
            }
            (t, t / world, 1)
        }
        (None, Some(m), None) => (m * world, m, 1),
        (None, None, _) => {
            return err("set train_batch_size or train_micro_batch_size_per_gpu (or both)".into());
        }
    };
    if train != micro * gas * world {
        return err(format!(
            "train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) × \
             gradient_accumulation_steps ({gas}) × world size ({world}) = {}",
            micro * gas * world
        ));
    }
    Ok(BatchSizes {
        train_batch_size: train,
        train_micro_batch_size_per_gpu: micro,
        gradient_accumulation_steps: gas,
        world_size: world,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_two_determine_the_third() {
        let b = resolve_batch(Some(64), Some(4), None, 4).unwrap();
        assert_eq!(b.gradient_accumulation_steps, 4);
        let b = resolve_batch(Some(64), None, Some(2), 4).unwrap();
        assert_eq!(b.train_micro_batch_size_per_gpu, 8);
        let b = resolve_batch(None, Some(3), Some(5), 2).unwrap();
        assert_eq!(b.train_batch_size, 30);
        let b = resolve_batch(Some(32), None, None, 2).unwrap();
        assert_eq!(
            (
                b.train_micro_batch_size_per_gpu,
                b.gradient_accumulation_steps
            ),
            (16, 1)
        );
        let b = resolve_batch(None, Some(8), None, 3).unwrap();
        assert_eq!(b.train_batch_size, 24);
    }

    #[test]
    fn inconsistent_sizes_give_the_numbers() {
        let e = resolve_batch(Some(4096), Some(16), Some(3), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4096") && e.contains("16") && e.contains("(3)") && e.contains("96"));
        let e = resolve_batch(Some(10), Some(4), None, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("(10)") && e.contains("(4)"), "{e}");
        assert!(resolve_batch(None, None, Some(2), 1).is_err());
        assert!(resolve_batch(Some(0), None, None, 1).is_err());
    }
}
