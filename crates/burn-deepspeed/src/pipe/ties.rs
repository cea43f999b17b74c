//! Tied layers (DeepSpeed's `TiedLayerSpec`): copies of one set of weights on several stages,
//! kept equal by summing their gradients (`ReduceTiedGrads`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use crate::{DeepSpeedError, Result, agreed};

/// This stage's copies of one tied weight set.
#[derive(Debug)]
pub(crate) struct TiedGroup {
    /// The stages holding a copy, when more than this one (ranked by stage).
    comm: Option<Arc<dyn Communicator>>,
    /// This stage's copies, as ranges of its flat parameter/gradient buffer.
    ranges: Vec<Range<usize>>,
    /// Whether this stage is the first holder, whose first copy counts in the global norm.
    first_holder: bool,
}

/// Finds the tied layers. `keys[i]` is layer `i`'s tie key, `parts` the stage boundaries and
/// `ranges` the flat range of each of this stage's layers. Every rank of `pipe` (one
/// pipeline, ranked by stage) must call it with the same keys: it splits `pipe` once per key
/// held by several stages.
pub(crate) fn find_ties(
    keys: &[Option<String>],
    parts: &[usize],
    stage: usize,
    ranges: &[Range<usize>],
    pipe: &dyn Communicator,
) -> Result<Vec<TiedGroup>> {
    let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        if let Some(k) = key {
            by_key.entry(k).or_default().push(i);
        }
    }
    let stage_of = |layer: usize| parts.windows(2).position(|w| (w[0]..w[1]).contains(&layer));
    // This stage's copies of each key must have one size; the ranks agree on it before the
    // splits below (collectives of `pipe`).
    let mut local = Ok(());
    for (key, layers) in &by_key {
        let sizes: Vec<usize> = layers
            .iter()
            .filter(|&&l| stage_of(l) == Some(stage))
            .map(|&l| ranges[l - parts[stage]].len())
            .collect();
        if sizes.windows(2).any(|w| w[0] != w[1]) {
            local = Err(tie_sizes(key, &sizes));
            break;
        }
    }
    agreed(pipe, "tied layers", local)?;
    let mut groups = Vec::new();
    for layers in by_key.values().filter(|l| l.len() > 1) {
        let mut stages: Vec<usize> = layers.iter().filter_map(|&l| stage_of(l)).collect();
        stages.dedup();
        let member = stages.contains(&stage);
        let comm = if stages.len() > 1 {
            Some(pipe.split(usize::from(member))?)
        } else {
            None
        };
        if member {
            let mine: Vec<Range<usize>> = layers
                .iter()
                .filter(|&&l| stage_of(l) == Some(stage))
                .map(|&l| ranges[l - parts[stage]].clone())
                .collect();
            // The holders' copies must have one size across stages too.
            if let Some(comm) = &comm {
                let len = (mine[0].len() as u64).to_le_bytes();
                let mut all = vec![0u8; 8 * comm.world_size()];
                comm.all_gather_equal(&len, &mut all)?;
                let sizes: Vec<usize> = all
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
                    .collect();
                if sizes.windows(2).any(|w| w[0] != w[1]) {
                    let key = keys[layers[0]].as_deref().unwrap_or_default();
                    return Err(tie_sizes(key, &sizes));
                }
            }
            groups.push(TiedGroup {
                comm,
                ranges: mine,
                first_holder: stages[0] == stage,
            });
        }
    }
    Ok(groups)
}

/// The refusal of tied layers whose copies differ in size.
fn tie_sizes(key: &str, sizes: &[usize]) -> DeepSpeedError {
    DeepSpeedError::Data(format!(
        "the layers tied by `{key}` have {sizes:?} parameters: tied layers must have the same \
         parameter shapes"
    ))
}

impl TiedGroup {
    /// Sums the copies' values over this stage's copies and the other holders, and writes the
    /// sum to every copy.
    pub(crate) fn sum(&self, flat: &mut [f32]) -> Result<()> {
        let mut total = vec![0.0f32; self.ranges[0].len()];
        for r in &self.ranges {
            total
                .iter_mut()
                .zip(&flat[r.clone()])
                .for_each(|(t, v)| *t += v);
        }
        if let Some(comm) = &self.comm {
            comm.all_reduce(&mut total, ReduceOp::Sum)?;
        }
        for r in &self.ranges {
            flat[r.clone()].copy_from_slice(&total);
        }
        Ok(())
    }

    /// Makes every copy equal to the first holder's first copy.
    pub(crate) fn copy_first(&self, flat: &mut [f32]) -> Result<()> {
        let mut first = flat[self.ranges[0].clone()].to_vec();
        if let Some(comm) = &self.comm {
            comm.broadcast(&mut first, 0)?;
        }
        for r in &self.ranges {
            flat[r.clone()].copy_from_slice(&first);
        }
        Ok(())
    }

    /// The copies that must not count in the global gradient norm (every copy but one).
    pub(crate) fn duplicates(&self) -> impl Iterator<Item = &Range<usize>> {
        let skip = usize::from(self.first_holder);
        self.ranges.iter().skip(skip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};

    fn ties(ranges: [Range<usize>; 2], parts: Vec<usize>) -> Vec<Result<usize>> {
        let stages = parts.len() - 1;
        let keys = vec![Some("embed".to_string()), Some("embed".to_string())];
        ThreadWorld::run(stages, ThreadWorldOptions::default(), |c| {
            let stage = c.rank();
            let mine: Vec<Range<usize>> = (parts[stage]..parts[stage + 1])
                .map(|l| ranges[l].clone())
                .collect();
            find_ties(&keys, &parts, stage, &mine, &c).map(|g| g.len())
        })
        .into_iter()
        .map(|r| r.expect("no panic"))
        .collect()
    }

    #[test]
    fn tied_layers_of_different_sizes_are_refused_not_copied() {
        // Both copies on one stage, then one per stage.
        for parts in [vec![0, 2], vec![0, 1, 2]] {
            for r in ties([0..6, 6..10], parts.clone()) {
                let err = r.expect_err("refused").to_string();
                assert!(
                    err.contains("tied by `embed`") && err.contains('6'),
                    "{err}"
                );
            }
            for r in ties([0..6, 6..12], parts.clone()) {
                assert_eq!(r.expect("same sizes tie"), 1, "{parts:?}");
            }
        }
    }
}
