//! Burn's checkpointer in the Learner strategy at ZeRO stages 1-2 and in 16-bit (stage 3's
//! chunks: [`chunked`](super::chunked)).
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
use burn::tensor::{Bytes, FloatDType};
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use super::base::RankRun;
use super::chunked::{cut_chunks, join_chunks};
use super::masters::Masters;
use super::prepare::SavingWholes;
use super::schedule::is_config_schedule;
use crate::checkpoint::gather_bytes;
use crate::flat::ParamLayout;
use crate::sync::{Cut, GradSync, Part};
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

pub(super) fn record_error(what: &str, e: impl std::fmt::Display) -> DeepSpeedError {
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

    /// At stage 3, this rank's chunk of the optimizer state: a `Learner` resumed by Burn's
    /// checkpointer holds the whole record.
    pub(super) fn cut_optimizer_state(&mut self) -> Result<()> {
        let Some(plan) = &self.chunks else {
            return Ok(());
        };
        let record = optimizer_record(&self.learner, &self.store)?;
        if !record.is_empty() {
            let own = cut_chunks(&record_bytes(record)?, self.comm.rank(), plan)?;
            self.learner.load_optim(own);
        }
        Ok(())
    }

    /// What Burn's checkpointer saves at the end of an epoch, on rank 0 (`None` elsewhere, or
    /// where the `Learner` itself is it): the `Learner` with the fp32 masters in 16-bit, and
    /// at stages 1-3 with every rank's optimizer state. At stage 3 the guard holds the whole
    /// parameters that rank 0's save records in place of its chunks until it drops. A
    /// collective at stages 1-3 when checkpointing.
    pub(super) fn learner_to_save(
        &self,
        sync: &mut dyn GradSync<M>,
        mixed: Option<&Masters<M>>,
    ) -> Result<(Option<Learner<M>>, Option<SavingWholes>)> {
        if !self.settings.checkpointer {
            return Ok((None, None));
        }
        let parts = match (&self.owned, &self.chunks) {
            (None, None) => None,
            _ => {
                let mine = record_bytes(optimizer_record(&self.learner, &self.store)?)?;
                gather_bytes(self.comm.as_ref(), &mine)?
            }
        };
        // Every collective before rank 0's own work on the records, so that a record it
        // cannot join fails it alone, not while its peers wait in a collective.
        let flat = match &self.chunks {
            Some(_) => self.whole_values(sync, mixed)?,
            None => None,
        };
        let record = match &self.chunks {
            Some(plan) => parts.map(|p| join_chunks(&p, plan)).transpose()?,
            None => parts.map(|p| join_records(&p, |_| true)).transpose()?,
        };
        if self.comm.rank() != 0 || (record.is_none() && mixed.is_none()) {
            return Ok((None, None));
        }
        let mut saved = self.learner.clone();
        if let Some(mixed) = mixed {
            saved.load_model(mixed.masters.clone().into_record());
        }
        if let Some(record) = record {
            saved.load_optim(record);
        }
        // From here on a record of the chunks on this thread holds the whole values.
        let wholes = (self.chunks.as_ref().zip(flat))
            .map(|(plan, flat)| SavingWholes::new(plan.id, plan.wholes(&flat)));
        Ok((Some(saved), wholes))
    }

    /// Stage 3: the whole parameters on rank 0 (the fp32 masters when they are apart), flat
    /// in layout order. A collective.
    fn whole_values(
        &self,
        sync: &mut dyn GradSync<M>,
        mixed: Option<&Masters<M>>,
    ) -> Result<Option<Vec<f32>>> {
        let rank0 = self.comm.rank() == 0;
        let Some(mixed) = mixed else {
            return sync.whole_params(&self.learner.model(), rank0);
        };
        sync.track_working_copy(&mixed.masters, FloatDType::F32);
        let flat = sync.whole_params(&mixed.masters, rank0);
        sync.track_working_copy(&self.learner.model(), mixed.dtype);
        flat
    }
}

/// `learner`'s optimizer and schedule records (a `Learner` hands them only to a
/// checkpointer).
fn learner_records<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<(OptimizerRecord, LrSchedulerRecord)> {
    let (optim, schedule) = (Arc::new(Mutex::new(None)), Arc::new(Mutex::new(None)));
    let mut reader = LearningCheckpointer::<M>::new(
        AsyncCheckpointer::new(Keep::<ModuleRecord>(Arc::default())),
        AsyncCheckpointer::new(Keep(optim.clone())),
        AsyncCheckpointer::new(Keep(schedule.clone())),
        Box::new(Always),
    );
    reader.checkpoint(learner, 0, store);
    // Dropping the checkpointer waits for its threads, so the records are in the slots.
    drop(reader);
    let missing = || record_error("read", "the checkpointer kept none");
    let optim = take(&optim).ok_or_else(missing)?;
    Ok((optim, take(&schedule).ok_or_else(missing)?))
}

/// `learner`'s optimizer record.
pub(super) fn optimizer_record<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<OptimizerRecord> {
    Ok(learner_records(learner, store)?.0)
}

/// Whether [`DeepSpeedStrategy::learner`](super::DeepSpeedStrategy::learner) built `learner`
/// (its schedule is the config's), also after Burn's checkpointer resumed it.
pub(super) fn built_from_config<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<bool> {
    Ok(is_config_schedule(learner_records(learner, store)?.1))
}

/// What a slot holds, taken.
fn take<R>(slot: &Mutex<Option<R>>) -> Option<R> {
    slot.lock().unwrap_or_else(PoisonError::into_inner).take()
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

/// One state tensor of a record.
pub(super) struct StateTensor {
    pub name: String,
    pub dtype: burn::tensor::DType,
    pub shape: Vec<usize>,
    pub id: Option<u64>,
    pub bytes: Vec<u8>,
}

/// A record's entries: its state tensors, scalars and metadata (the parameters' paths).
#[derive(Default)]
pub(super) struct Entries {
    pub tensors: Vec<StateTensor>,
    pub scalars: BTreeMap<String, burn_pack::Scalar>,
    pub metadata: BTreeMap<String, String>,
}

impl Entries {
    /// The entries of a record's bytes (burnpack).
    pub(super) fn read(bytes: &[u8]) -> Result<Self> {
        let reader = burn_pack::Reader::from_bytes(Bytes::from_bytes_vec(bytes.to_vec()))
            .map_err(|e| record_error("read", e))?;
        let scalars = reader.scalars().clone();
        let metadata = reader.metadata().clone();
        let mut tensors = Vec::new();
        for tensor in reader.into_tensors().map_err(|e| record_error("read", e))? {
            let (name, dtype, shape, id, bytes) =
                tensor.into_parts().map_err(|e| record_error("read", e))?;
            tensors.push(StateTensor {
                name,
                dtype,
                shape: shape.to_vec(),
                id,
                bytes: bytes.to_vec(),
            });
        }
        Ok(Self {
            tensors,
            scalars,
            metadata,
        })
    }

    /// Adds the entries of `other` whose names `wanted` accepts.
    fn take_from(&mut self, other: Entries, wanted: impl Fn(&str) -> bool) {
        self.tensors
            .extend(other.tensors.into_iter().filter(|t| wanted(&t.name)));
        self.scalars
            .extend(other.scalars.into_iter().filter(|(k, _)| wanted(k)));
        self.metadata
            .extend(other.metadata.into_iter().filter(|(k, _)| wanted(k)));
    }

    /// The record holding these entries.
    pub(super) fn into_record(self) -> Result<OptimizerRecord> {
        let tensors = self.tensors.into_iter().map(|t| {
            let bytes = Bytes::from_bytes_vec(t.bytes);
            burn_pack::Tensor::new(t.name, t.dtype, t.shape, t.id, bytes)
        });
        let mut writer = burn_pack::Writer::new(tensors.collect());
        for (name, value) in &self.scalars {
            writer = writer.with_scalar(name, *value);
        }
        for (name, value) in &self.metadata {
            writer = writer.with_metadata(name, value);
        }
        let bytes = writer.into_bytes().map_err(|e| record_error("write", e))?;
        OptimizerRecord::from_bytes(bytes).map_err(|e| record_error("read", e))
    }
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
    let mut joined = Entries::default();
    for (at, part) in parts.iter().enumerate() {
        let entries = Entries::read(part)?;
        let names = entries.tensors.iter().map(|t| t.name.as_str());
        let names = names
            .chain(entries.scalars.keys().map(String::as_str))
            .chain(entries.metadata.keys().map(String::as_str));
        let here: HashSet<u64> = names
            .filter_map(entry_id)
            .filter(|id| keep(*id) && !taken.contains(id))
            .collect();
        joined.take_from(entries, |name| {
            entry_id(name).map_or(at == 0, |id| here.contains(&id))
        });
        taken.extend(here);
    }
    joined.into_record()
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
