//! [`WholeLayout`]: an expert-parallel model's parameters in the order of the same model
//! holding every expert (`ep_size` 1), the order its checkpoints store. Each rank of an
//! expert-parallel group holds `num_experts / ep_size` experts of every MoE layer; the whole
//! layout puts, where a layer's local experts stand, the experts of every rank of the group
//! in the layer's order (rank `r`'s local expert `j` is expert `r · local + j`). Parameter
//! paths are renamed to match (`moe.experts.1.fc1.weight` on rank 1 of 2 with one expert
//! each: the whole layer's expert 1). A checkpoint written this way loads at any `ep_size`,
//! 1 included, and consolidates into the whole model. Plain data, tested without tensors.

use std::collections::HashMap;

use burn::module::ParamId;

use crate::flat::ParamLayout;
use crate::moe::ExpertLayer;
use crate::{DeepSpeedError, Result};

/// Where one tensor of the whole layout lives on the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Tensor `slot` of the dense parameters (the same on every rank), from element
    /// `offset` of their flat values.
    Dense { slot: usize, offset: usize },
    /// Tensor `slot` of expert-parallel rank `owner`'s experts, from element `offset` of
    /// their flat values.
    Expert {
        owner: usize,
        slot: usize,
        offset: usize,
    },
}

/// The whole model's layout over one rank's dense and expert parameters (see the module
/// docs).
#[derive(Debug, Clone, PartialEq)]
pub struct WholeLayout {
    /// Parameter ids of the whole model (every rank's experts' own ids).
    pub ids: Vec<u64>,
    /// Shapes of the whole model's tensors.
    pub shapes: Vec<Vec<usize>>,
    /// Module paths of the whole model's tensors (empty when the rank's are unknown).
    pub paths: Vec<String>,
    numels: Vec<usize>,
    sources: Vec<Source>,
    ep_rank: usize,
    dense: (usize, usize),
    experts: (usize, usize),
}

impl WholeLayout {
    /// The whole layout of a rank whose model has `layout` (module `paths` in its order, or
    /// none), whose MoE `layers` were cut over an expert-parallel group of `peer_ids.len()`
    /// ranks where it is `ep_rank`. `peer_ids[r]` are rank `r`'s expert parameter ids in its
    /// visiting order. Refuses a model whose layers' experts are not visited together, in
    /// order, or whose ranks hold different numbers of expert tensors.
    pub fn new(
        layout: &ParamLayout,
        paths: &[String],
        layers: &[ExpertLayer],
        ep_rank: usize,
        peer_ids: &[Vec<u64>],
    ) -> Result<Self> {
        let refuse = |what: String| Err(DeepSpeedError::Regime(what));
        let mut place: HashMap<ParamId, (usize, usize, usize)> = HashMap::new();
        for (l, layer) in layers.iter().enumerate() {
            for (j, expert) in layer.experts.iter().enumerate() {
                for (k, id) in expert.iter().enumerate() {
                    place.insert(*id, (l, j, k));
                }
            }
        }
        let mine = layout
            .slots
            .iter()
            .filter(|s| place.contains_key(&s.id))
            .count();
        if let Some(r) = peer_ids.iter().position(|p| p.len() != mine) {
            return refuse(format!(
                "expert-parallel rank {r} holds {} expert tensors; rank {ep_rank} holds {mine}",
                peer_ids[r].len()
            ));
        }
        let gate_at: HashMap<ParamId, usize> = layout
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id, i))
            .collect();
        let mut whole = Self {
            ids: Vec::new(),
            shapes: Vec::new(),
            paths: Vec::new(),
            numels: Vec::new(),
            sources: Vec::new(),
            ep_rank,
            dense: (0, 0),
            experts: (0, 0),
        };
        let named = !paths.is_empty() && paths.len() == layout.slots.len();
        let mut i = 0;
        while i < layout.slots.len() {
            let slot = &layout.slots[i];
            let Some(&(l, j, k)) = place.get(&slot.id) else {
                let path = named.then(|| paths[i].clone());
                whole.push_dense(slot.id.val(), &slot.shape, path);
                i += 1;
                continue;
            };
            let layer = &layers[l];
            let per = layer.experts.first().map_or(0, Vec::len);
            let run: Vec<ParamId> = layer.experts.iter().flatten().copied().collect();
            let together = (j, k) == (0, 0)
                && layer.experts.iter().all(|e| e.len() == per)
                && layout
                    .slots
                    .get(i..i + run.len())
                    .is_some_and(|s| s.iter().zip(&run).all(|(slot, id)| slot.id == *id));
            if !together {
                return refuse(format!(
                    "the experts of MoE layer {l} are not visited together and in order (a \
                     layer's experts must be one `Vec` of modules of one shape)"
                ));
            }
            let prefix = match named {
                true => {
                    let gate = gate_at.get(&layer.gate).map(|&g| paths[g].as_str());
                    match gate.and_then(|p| p.strip_suffix("gate.weight")) {
                        Some(prefix) => Some(prefix.to_string()),
                        None => return refuse(format!("MoE layer {l}'s gate is not its own")),
                    }
                }
                false => None,
            };
            let local = layer.experts.len();
            let first = whole.experts.0;
            let first_offset = whole.experts.1;
            for (owner, ids) in peer_ids.iter().enumerate() {
                let (mut slot, mut offset) = (first, first_offset);
                for (n, local_slot) in layout.slots[i..i + run.len()].iter().enumerate() {
                    let jj = n / per.max(1);
                    let path = match &prefix {
                        Some(prefix) => {
                            let own = format!("{prefix}experts.{jj}.");
                            let Some(inner) = paths[i + n].strip_prefix(&own) else {
                                return refuse(format!(
                                    "expert {jj} of MoE layer {l} is not under {own}"
                                ));
                            };
                            Some(format!("{prefix}experts.{}.{inner}", owner * local + jj))
                        }
                        None => None,
                    };
                    whole.ids.push(ids[slot]);
                    whole.shapes.push(local_slot.shape.clone());
                    whole.numels.push(local_slot.numel);
                    whole.paths.extend(path);
                    whole.sources.push(Source::Expert {
                        owner,
                        slot,
                        offset,
                    });
                    slot += 1;
                    offset += local_slot.numel;
                }
                whole.experts = (slot, offset);
            }
            i += run.len();
        }
        if !named {
            whole.paths.clear();
        }
        Ok(whole)
    }

    fn push_dense(&mut self, id: u64, shape: &[usize], path: Option<String>) {
        let numel = shape.iter().product();
        self.ids.push(id);
        self.shapes.push(shape.to_vec());
        self.numels.push(numel);
        self.paths.extend(path);
        self.sources.push(Source::Dense {
            slot: self.dense.0,
            offset: self.dense.1,
        });
        self.dense = (self.dense.0 + 1, self.dense.1 + numel);
    }

    /// Elements of each tensor of the whole layout.
    pub fn numels(&self) -> &[usize] {
        &self.numels
    }

    /// Elements of the whole model.
    pub fn numel(&self) -> usize {
        self.numels.iter().sum()
    }

    /// The whole model's flat values from the dense ones and each expert-parallel rank's
    /// experts' (every rank's, in rank order).
    pub fn join<T: Copy>(&self, dense: &[T], experts: &[impl AsRef<[T]>]) -> Result<Vec<T>> {
        self.join_by(dense, experts, Unit::Elements)
    }

    /// The whole model's per-tensor values (an optimizer's step counts) from the dense
    /// tensors' and each rank's experts'.
    pub fn join_tensors<T: Copy>(
        &self,
        dense: &[T],
        experts: &[impl AsRef<[T]>],
    ) -> Result<Vec<T>> {
        self.join_by(dense, experts, Unit::Tensors)
    }

    /// This rank's dense and expert flat values, cut from the whole model's.
    pub fn split<T: Copy>(&self, whole: &[T]) -> (Vec<T>, Vec<T>) {
        self.split_by(whole, Unit::Elements)
    }

    /// This rank's dense and expert per-tensor values, cut from the whole model's.
    pub fn split_tensors<T: Copy>(&self, whole: &[T]) -> (Vec<T>, Vec<T>) {
        self.split_by(whole, Unit::Tensors)
    }

    fn join_by<T: Copy>(
        &self,
        dense: &[T],
        experts: &[impl AsRef<[T]>],
        unit: Unit,
    ) -> Result<Vec<T>> {
        let (d, e) = match unit {
            Unit::Elements => (self.dense.1, self.experts.1),
            Unit::Tensors => (self.dense.0, self.experts.0),
        };
        if dense.len() != d || experts.iter().any(|x| x.as_ref().len() != e) {
            return Err(DeepSpeedError::Regime(format!(
                "the whole model joins {d} dense and {e} expert values per rank; got {} and {:?}",
                dense.len(),
                experts.iter().map(|x| x.as_ref().len()).collect::<Vec<_>>()
            )));
        }
        let mut out = Vec::with_capacity(match unit {
            Unit::Elements => self.numel(),
            Unit::Tensors => self.numels.len(),
        });
        for (source, &numel) in self.sources.iter().zip(&self.numels) {
            let (from, at): (&[T], usize) = match *source {
                Source::Dense { slot, offset } => (dense, unit.pick(slot, offset)),
                Source::Expert {
                    owner,
                    slot,
                    offset,
                } => (experts[owner].as_ref(), unit.pick(slot, offset)),
            };
            let len = unit.pick(1, numel);
            out.extend_from_slice(&from[at..at + len]);
        }
        Ok(out)
    }

    fn split_by<T: Copy>(&self, whole: &[T], unit: Unit) -> (Vec<T>, Vec<T>) {
        let (mut dense, mut experts) = (Vec::new(), Vec::new());
        let mut at = 0;
        for (source, &numel) in self.sources.iter().zip(&self.numels) {
            let len = unit.pick(1, numel);
            match *source {
                Source::Dense { .. } => dense.extend_from_slice(&whole[at..at + len]),
                Source::Expert { owner, .. } if owner == self.ep_rank => {
                    experts.extend_from_slice(&whole[at..at + len])
                }
                Source::Expert { .. } => {}
            }
            at += len;
        }
        (dense, experts)
    }
}

/// Whether values are per element or per tensor.
#[derive(Debug, Clone, Copy)]
enum Unit {
    Elements,
    Tensors,
}

impl Unit {
    fn pick(self, tensors: usize, elements: usize) -> usize {
        match self {
            Unit::Elements => elements,
            Unit::Tensors => tensors,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model `emb, [gate, e0.w, e0.b, e1.w, e1.b], head` on expert-parallel rank `rank`
    /// of 2 (two local experts of four), with ids `100·rank + n`.
    fn rank(rank: usize) -> (ParamLayout, Vec<String>, Vec<ExpertLayer>) {
        let id = |n: u64| ParamId::from(100 * rank as u64 + n);
        let shapes: [(u64, &[usize]); 7] = [
            (0, &[3, 2]),
            (1, &[2, 4]),
            (2, &[2, 5]),
            (3, &[5]),
            (4, &[2, 5]),
            (5, &[5]),
            (6, &[2, 2]),
        ];
        let layout = ParamLayout::from_shapes(shapes.iter().map(|(n, s)| (id(*n), s.to_vec())));
        let paths = names(2);
        let layer = ExpertLayer {
            gate: id(1),
            experts: vec![vec![id(2), id(3)], vec![id(4), id(5)]],
        };
        (layout, paths, vec![layer])
    }

    /// The paths of the model with `experts` experts in its MoE layer.
    fn names(experts: usize) -> Vec<String> {
        let expert = |e| ["weight", "bias"].map(|p| format!("moe.experts.{e}.fc.{p}"));
        ["emb.weight", "moe.gate.weight"]
            .map(String::from)
            .into_iter()
            .chain((0..experts).flat_map(expert))
            .chain(["head.weight".to_string()])
            .collect()
    }

    fn peer_ids() -> Vec<Vec<u64>> {
        (0..2)
            .map(|r| (2..6).map(|n| 100 * r + n).collect())
            .collect()
    }

    /// Every rank's experts stand where the layer's local experts stood, renamed to their
    /// index in the whole layer; the dense tensors keep their place.
    #[test]
    fn the_whole_layout_lists_every_ranks_experts_in_layer_order() {
        let (layout, paths, layers) = rank(1);
        let whole = WholeLayout::new(&layout, &paths, &layers, 1, &peer_ids()).expect("layout");
        assert_eq!(
            whole.ids,
            vec![100, 101, 2, 3, 4, 5, 102, 103, 104, 105, 106]
        );
        assert_eq!(whole.paths, names(4));
        assert_eq!(whole.numel(), 6 + 8 + 4 * 15 + 4);
        assert_eq!(whole.shapes[6], vec![2, 5]);
    }

    /// Joining every rank's values and splitting them again gives each rank its own; the
    /// per-tensor form does the same with one value per tensor.
    #[test]
    fn join_and_split_are_inverse() {
        let layouts: Vec<WholeLayout> = (0..2)
            .map(|r| {
                let (layout, paths, layers) = rank(r);
                WholeLayout::new(&layout, &paths, &layers, r, &peer_ids()).expect("layout")
            })
            .collect();
        let dense: Vec<f32> = (0..18).map(|x| x as f32).collect();
        let experts: Vec<Vec<f32>> = (0..2)
            .map(|r| {
                (0..30)
                    .map(|x| 1000.0 * (r + 1) as f32 + x as f32)
                    .collect()
            })
            .collect();
        let whole = layouts[0].join(&dense, &experts).expect("join");
        assert_eq!(whole, layouts[1].join(&dense, &experts).expect("join"));
        assert_eq!(whole.len(), layouts[0].numel());
        assert_eq!(&whole[..14], &dense[..14]);
        assert_eq!(&whole[14..44], &experts[0][..]);
        assert_eq!(&whole[74..], &dense[14..]);
        for (r, layout) in layouts.iter().enumerate() {
            let (d, e) = layout.split(&whole);
            assert_eq!((d, e), (dense.clone(), experts[r].clone()));
        }
        let steps = layouts[1]
            .join_tensors(&[7u32, 8, 9], &[vec![1, 2, 3, 4], vec![5, 6, 7, 8]])
            .expect("join");
        assert_eq!(steps, vec![7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(
            layouts[1].split_tensors(&steps),
            (vec![7, 8, 9], vec![5, 6, 7, 8])
        );
        let short = layouts[0].join(&dense[1..], &experts).unwrap_err();
        assert!(short.to_string().contains("18 dense"), "{short}");
    }

    /// Experts out of order, and peers holding other numbers of expert tensors, are refused.
    #[test]
    fn layouts_it_cannot_join_are_refused() {
        let (layout, paths, mut layers) = rank(0);
        layers[0].experts.swap(0, 1);
        let err = WholeLayout::new(&layout, &paths, &layers, 0, &peer_ids()).unwrap_err();
        assert!(err.to_string().contains("not visited together"), "{err}");
        let (layout, paths, layers) = rank(0);
        let err = WholeLayout::new(&layout, &paths, &layers, 0, &[vec![2, 3], vec![]]).unwrap_err();
        assert!(err.to_string().contains("holds 2 expert tensors"), "{err}");
        let unnamed = WholeLayout::new(&layout, &[], &layers, 0, &peer_ids()).expect("layout");
        assert!(unnamed.paths.is_empty());
    }
}
