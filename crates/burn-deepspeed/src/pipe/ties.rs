//! Tied layers (DeepSpeed's `TiedLayerSpec`): copies of one set of weights on several stages,
//! kept equal by summing their gradients (`ReduceTiedGrads`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use crate::Result;

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
            groups.push(TiedGroup {
                comm,
                ranges: layers
                    .iter()
                    .filter(|&&l| stage_of(l) == Some(stage))
                    .map(|&l| ranges[l - parts[stage]].clone())
                    .collect(),
                first_holder: stages[0] == stage,
            });
        }
    }
    Ok(groups)
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
