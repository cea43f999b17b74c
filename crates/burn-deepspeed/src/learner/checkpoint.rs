//! Burn's checkpointer in the Learner strategy at ZeRO stages 1-2 and in 16-bit.
//!
//! Burn's `LearningCheckpointer` saves one `Learner`: its model's record, its optimizer's
//! record and its schedule's. At stages 1 and 2 each rank's optimizer holds the state of its
//! own whole tensors only (ZeRO's optimizer-state partition, arXiv 1910.02054), and in 16-bit
//! the `Learner` holds the working copy, not the fp32 masters its optimizer steps. So at the
//! end of an epoch the ranks gather their optimizer records into one (the partitions are
//! disjoint: every parameter's state comes from the rank that steps it), and rank 0 hands the
//! checkpointer a `Learner` holding the fp32 masters and that whole record: the files are
//! those of an unpartitioned fp32 run, which any world size (or a plain Burn run) can load.
//!
//! On resume, Burn loads the whole record into the `Learner` before the strategy starts; each
//! rank then keeps the state of the tensors it steps and drops the rest, so the partition
//! holds again from the first step.
//!
//! A `Learner` shows its optimizer's record only to a checkpointer, so [`optimizer_record`]
//! reads it through one that keeps the record in memory.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use super::base::RankRun;
use super::masters::Masters;
use crate::checkpoint::gather_bytes;
use crate::flat::ParamLayout;
use crate::sync::{Cut, Part};
use crate::{DeepSpeedError, Result};

/// The parameters whose optimizer state this rank holds at ZeRO stages 1 and 2 (the whole
/// tensors of its group, as the regime cuts them); `None` at stage 0, where it holds all.
pub(super) fn owned_ids(
    layout: &ParamLayout,
    cut: Cut,
    world: usize,
    rank: usize,
) -> Option<HashSet<u64>> {
    if cut == Cut::Nothing {
        return None;
    }
    let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
    let own = Part::tensor_aligned(cut, &sizes, world, rank).own;
    let inside =
        |s: &&crate::flat::ParamSlot| own.start <= s.offset && s.offset + s.numel <= own.end;
    Some(
        layout
            .slots
            .iter()
            .filter(inside)
            .map(|s| s.id.val())
            .collect(),
    )
}

fn record_error(what: &str, e: impl std::fmt::Display) -> DeepSpeedError {
    DeepSpeedError::LearnerStrategy(format!("the Learner's optimizer record: {what}: {e}"))
}

/// A checkpointer that keeps the last record it was given, for [`optimizer_record`].
struct Keep<R>(Arc<Mutex<Option<R>>>);

impl<R: Checkpoint> Checkpointer<R> for Keep<R> {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(record);
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "an in-memory record is never restored".into(),
        ))
    }
}

/// Saves every epoch it is asked about.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(&mut self, _epoch: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

impl<M: LearnerModel> RankRun<'_, M> {
    /// At stages 1-2, the optimizer state of this rank's tensors only: a `Learner` resumed
    /// by Burn's checkpointer holds every tensor's.
    pub(super) fn keep_own_optimizer_state(&mut self) -> Result<()> {
        let Some(owned) = &self.owned else {
            return Ok(());
        };
        let record = optimizer_record(&self.learner, &self.store)?;
        if !record.is_empty() {
            let own = join_records(&[record_bytes(record)?], |id| owned.contains(&id))?;
            self.learner.load_optim(own);
        }
        Ok(())
    }

    /// What Burn's checkpointer saves at the end of an epoch, on rank 0 (`None` elsewhere, or
    /// where the `Learner` itself is it): the `Learner` with the fp32 masters in 16-bit, and
    /// at stages 1-2 with every rank's optimizer state. A collective at stages 1-2 when
    /// checkpointing.
    pub(super) fn learner_to_save(&self, mixed: Option<&Masters<M>>) -> Result<Option<Learner<M>>> {
        if !self.settings.checkpointer {
            return Ok(None);
        }
        let record = match &self.owned {
            None => None,
            Some(_) => {
                let mine = record_bytes(optimizer_record(&self.learner, &self.store)?)?;
                let parts = gather_bytes(self.comm.as_ref(), &mine)?;
                parts.map(|p| join_records(&p, |_| true)).transpose()?
            }
        };
        if self.comm.rank() != 0 || (record.is_none() && mixed.is_none()) {
            return Ok(None);
        }
        let mut saved = self.learner.clone();
        if let Some(mixed) = mixed {
            saved.load_model(mixed.masters.clone().into_record());
        }
        if let Some(record) = record {
            saved.load_optim(record);
        }
        Ok(Some(saved))
    }
}

/// `learner`'s optimizer record (a `Learner` hands it only to a checkpointer).
pub(super) fn optimizer_record<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<OptimizerRecord> {
    let slot = Arc::new(Mutex::new(None));
    let mut reader = LearningCheckpointer::<M>::new(
        AsyncCheckpointer::new(Keep::<ModuleRecord>(Arc::default())),
        AsyncCheckpointer::new(Keep(slot.clone())),
        AsyncCheckpointer::new(Keep::<LrSchedulerRecord>(Arc::default())),
        Box::new(Always),
    );
    reader.checkpoint(learner, 0, store);
    // Dropping the checkpointer waits for its threads, so the record is in the slot.
    drop(reader);
    let record = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    record.ok_or_else(|| record_error("read", "the checkpointer kept none"))
}

/// The record's bytes (burnpack).
pub(super) fn record_bytes(record: OptimizerRecord) -> Result<Vec<u8>> {
    let bytes = record.into_bytes().map_err(|e| record_error("write", e))?;
    Ok(bytes.to_vec())
}

/// The parameter id a record entry belongs to: entries are named `"{id}"` or `"{id}.{field}"`.
fn entry_id(name: &str) -> Option<u64> {
    name.split('.').next()?.parse().ok()
}

/// One record from the records of several ranks (burnpack bytes, in rank order): every
/// parameter's entries (its state tensors, scalars and path) come from the first record that
/// has the parameter, and only parameters that `keep` accepts are kept. Entries of no
/// parameter come from the first record.
pub(super) fn join_records(
    parts: &[Vec<u8>],
    keep: impl Fn(u64) -> bool,
) -> Result<OptimizerRecord> {
    let mut taken: HashSet<u64> = HashSet::new();
    let mut tensors = Vec::new();
    let mut scalars = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (at, part) in parts.iter().enumerate() {
        let reader = burn_pack::Reader::from_bytes(Bytes::from_bytes_vec(part.clone()))
            .map_err(|e| record_error("read", e))?;
        let names = reader.tensor_names().into_iter().map(str::to_owned);
        let here: HashSet<u64> = (names.chain(reader.scalars().keys().cloned()))
            .chain(reader.metadata().keys().cloned())
            .filter_map(|name| entry_id(&name))
            .filter(|id| keep(*id) && !taken.contains(id))
            .collect();
        let wanted = |name: &str| entry_id(name).map_or(at == 0, |id| here.contains(&id));
        for (name, value) in reader.scalars() {
            if wanted(name) {
                scalars.insert(name.clone(), *value);
            }
        }
        for (name, value) in reader.metadata() {
            if wanted(name) {
                metadata.insert(name.clone(), value.clone());
            }
        }
        for tensor in reader.into_tensors().map_err(|e| record_error("read", e))? {
            let (name, dtype, shape, id, bytes) =
                tensor.into_parts().map_err(|e| record_error("read", e))?;
            if wanted(&name) {
                tensors.push(burn_pack::Tensor::new(name, dtype, shape, id, bytes));
            }
        }
        taken.extend(here);
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (name, value) in &scalars {
        writer = writer.with_scalar(name, *value);
    }
    for (name, value) in &metadata {
        writer = writer.with_metadata(name, value);
    }
    let bytes = writer.into_bytes().map_err(|e| record_error("write", e))?;
    OptimizerRecord::from_bytes(bytes).map_err(|e| record_error("read", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    /// A record holding parameter `id`'s state: a tensor of `value`s, a scalar and a path.
    fn entry(ids: &[(u64, f32)]) -> Vec<u8> {
        let tensors = ids
            .iter()
            .map(|&(id, value)| {
                let bytes = Bytes::from_bytes_vec(
                    [value; 2].iter().flat_map(|v| v.to_le_bytes()).collect(),
                );
                burn_pack::Tensor::new(format!("{id}.moment_1"), DType::F32, [2], Some(id), bytes)
            })
            .collect();
        let mut writer = burn_pack::Writer::new(tensors);
        for &(id, value) in ids {
            writer = writer
                .with_scalar(&format!("{id}.__rank"), burn_pack::Scalar::from(1usize))
                .with_metadata(&id.to_string(), &format!("layer{value}"));
        }
        writer.into_bytes().expect("bytes").to_vec()
    }

    /// Named entries of a record.
    type Entries<T> = Vec<(String, T)>;

    /// What a joined record holds: each state tensor's first value, and the paths.
    fn contents(record: OptimizerRecord) -> (Entries<f32>, Entries<String>) {
        let bytes = record.into_bytes().expect("bytes");
        let reader = burn_pack::Reader::from_bytes(bytes).expect("a record");
        let paths = reader
            .metadata()
            .iter()
            .filter(|(k, _)| entry_id(k).is_some());
        let paths = paths.map(|(k, v)| (k.clone(), v.clone())).collect();
        let tensors = reader
            .into_tensors()
            .expect("tensors")
            .into_iter()
            .map(|t| {
                let (name, _, _, _, bytes) = t.into_parts().expect("parts");
                (
                    name,
                    f32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
                )
            });
        (tensors.collect(), paths)
    }

    /// Disjoint partitions join into the whole; a parameter two ranks hold comes from the
    /// first; `keep` drops the rest.
    #[test]
    fn records_join_per_parameter() {
        let parts = [entry(&[(7, 1.0)]), entry(&[(9, 2.0), (7, 3.0)])];
        let (tensors, paths) = contents(join_records(&parts, |_| true).expect("joined"));
        let mut tensors = tensors;
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            tensors,
            [("7.moment_1".into(), 1.0), ("9.moment_1".into(), 2.0)]
        );
        assert_eq!(
            paths,
            [("7".into(), "layer1".into()), ("9".into(), "layer2".into())]
        );
        let (tensors, paths) = contents(join_records(&parts, |id| id == 9).expect("joined"));
        assert_eq!(tensors, [("9.moment_1".into(), 2.0)]);
        assert_eq!(paths, [("9".into(), "layer2".into())]);
        let empty = join_records(&[entry(&[])], |_| true).expect("joined");
        assert!(empty.is_empty());
    }
}
