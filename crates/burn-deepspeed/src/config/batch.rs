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
    // Every product is checked: huge values are refused by name, never wrapped.
    let mg = |m: u64, g: u64| {
        product(&[
            ("train_micro_batch_size_per_gpu", m),
            ("gradient_accumulation_steps", g),
            ("the world size", world),
        ])
    };
    let (train, micro, gas) = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => {
            let per_step = mg(m, 1)?;
            if t % per_step != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by train_micro_batch_size_per_gpu \
                     ({m}) × world size ({world}) = {per_step}, so gradient_accumulation_steps \
                     would not be a whole number"
                ));
            }
            (t, m, t / per_step)
        }
        (Some(t), None, Some(g)) => {
            let per_micro = product(&[
                ("gradient_accumulation_steps", g),
                ("the world size", world),
            ])?;
            if t % per_micro != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by gradient_accumulation_steps \
                     ({g}) × world size ({world}) = {per_micro}"
                ));
            }
            (t, t / per_micro, g)
        }
        (None, Some(m), Some(g)) => (mg(m, g)?, m, g),
        (Some(t), None, None) => {
            if t % world != 0 {
                return err(format!(
                    "train_batch_size ({t}) is not divisible by the world size ({world})"
                ));
            }
            (t, t / world, 1)
        }
        (None, Some(m), None) => (mg(m, 1)?, m, 1),
        (None, None, _) => {
            return err("set train_batch_size or train_micro_batch_size_per_gpu (or both)".into());
        }
    };
    let whole = mg(micro, gas)?;
    if train != whole {
        return err(format!(
            "train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) × \
             gradient_accumulation_steps ({gas}) × world size ({world}) = {whole}"
        ));
    }
    Ok(BatchSizes {
        train_batch_size: train,
        train_micro_batch_size_per_gpu: micro,
        gradient_accumulation_steps: gas,
        world_size: world,
    })
}

/// The product of the named factors, or an error naming them when it overflows.
fn product(factors: &[(&str, u64)]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |acc, (_, v)| acc.checked_mul(*v))
        .ok_or_else(|| {
            let named: Vec<String> = factors.iter().map(|(k, v)| format!("{k} ({v})")).collect();
            DeepSpeedError::BatchSize(format!(
                "{} overflows a 64-bit batch size",
                named.join(" × ")
            ))
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

    #[test]
    fn overflowing_products_are_refused_by_name() {
        let huge = 1u64 << 63;
        for (t, m, g) in [
            (None, Some(huge), None),
            (None, Some(huge), Some(2)),
            (Some(8), Some(huge), None),
            (Some(8), None, Some(huge)),
            (Some(8), Some(huge), Some(huge)),
        ] {
            let e = resolve_batch(t, m, g, 2).unwrap_err().to_string();
            assert!(
                e.contains("overflows") && e.contains("9223372036854775808"),
                "{e}"
            );
        }
    }
}
