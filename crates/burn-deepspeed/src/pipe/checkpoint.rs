//! Checkpoints of the pipeline engine that load on another grid (DeepSpeed's universal
//! checkpoint idea, built in): a checkpoint holds the whole model's tensors, each whole
//! (its tensor-parallel slices joined, every stage's layers in order), with the optimizer
//! state of each, whatever (tp, pp, dp) wrote it; loading cuts them again for the reading
//! grid's stage, slice and data-parallel partition.
//!
//! The files are the engine's own format for one rank at ZeRO stage 1 (`model.bin` and one
//! `zero_pp_rank_0_optim_states.bin`), so `burn-deepspeed checkpoint consolidate` reads them
//! and the same integrity checks (checksums, shapes, optimizer) refuse a corrupt or
//! mismatched one. The tensors' names are `layer.path` in the whole layer list.
//!
//! Saving gathers the whole model on rank 0 (each stage's first rank sends its stage, its
//! slices joined over the tensor group and its state over the replicas): rank 0 must hold
//! the model's fp32 values and moments once.

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn_deepspeed_strategies::comm::CommunicatorExt;
use burn_deepspeed_strategies::zero::PartitionState;

use super::engine::PipelineEngine;
use super::layer::{PipeBatch, PipeLayer};
use crate::checkpoint::{
    self as format, CheckpointMeta, Loaded, all_gather_bytes, f32_bytes, f32_values,
    partition_file, partition_state_bytes, partition_state_from_bytes,
};
use crate::step::core::RestoredPosition;
use crate::sync::{Cut, GradSync, StagedLoad, SyncOptions};
use crate::tensor_parallel::{cut_flat, join_flat};
use crate::{DeepSpeedError, Result, agreed};

impl<L, B> PipelineEngine<L, B>
where
    L: PipeLayer<B> + 'static,
    B: PipeBatch + 'static,
{
    /// Saves the whole model and its optimizer state as checkpoint `tag` (default
    /// `global_step{N}`) under `dir`, atomically, and points `dir/latest` at it; it loads on
    /// any grid ([`load_checkpoint`](Self::load_checkpoint)). Collective: every rank of the
    /// grid calls it; rank 0 writes. Needs ZeRO stage 1, whose flat optimizer state is what
    /// the checkpoint stores (stage 1 trains the same losses as stage 0 here).
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let tag = tag.map_or_else(
            || format!("global_step{}", self.core.global_step()),
            String::from,
        );
        let world = self.grid.world().as_ref();
        let sync = self.flat_state()?;
        agreed(world, "checkpoint tag", format::check_tag(&tag))?;
        // This stage's slices, whole over the replicas (collectives over the data group)...
        let state = sync
            .whole_moments()?
            .ok_or_else(crate::checkpoint::no_state_to_restore)?;
        let params = sync.whole_params(&self.layers, true)?.unwrap_or_default();
        // ...then whole over the slices (collectives over the tensor group).
        let (tensor, tp, layout) = (
            self.grid.tensor().as_ref(),
            self.grid.tensor_parallel(),
            &self.layout,
        );
        let params = join_flat(tensor, tp, layout, &params)?;
        let m = join_flat(tensor, tp, layout, &state.m)?;
        let v = join_flat(tensor, tp, layout, &state.v)?;
        // Each stage's first rank (replica 0, slice 0) sends its stage to rank 0.
        let sends = self.replica == 0 && self.grid.tensor_parallel().rank() == 0;
        let mine = match sends {
            true => encode_stage(
                &params,
                &PartitionState {
                    steps: state.steps,
                    m,
                    v,
                },
            ),
            false => Vec::new(),
        };
        let stages = all_gather_bytes(world, &mine)?;
        let written = match world.rank() {
            0 => world.solo("checkpoint write", || self.write_whole(dir, &tag, &stages)),
            _ => Ok(dir.join(&tag)),
        };
        // Every rank learns whether rank 0's commit succeeded.
        let mut ok = [u8::from(written.is_ok())];
        world.broadcast(&mut ok, 0)?;
        if ok[0] == 0 && written.is_ok() {
            return Err(DeepSpeedError::Checkpoint(format!(
                "rank 0 could not write {}",
                dir.join(&tag).display()
            )));
        }
        written
    }

    /// Loads checkpoint `tag` (default: the one `dir/latest` names), written on any grid,
    /// into this engine: this rank's slice of its stage's tensors, their optimizer state cut
    /// again for its data-parallel partition, and the step. Refuses, with the reason, a
    /// checkpoint whose files are corrupt or whose tensors or optimizer differ from this
    /// model's. Collective, all or nothing: every rank reads the parts of the files its
    /// tensors cover, and when one cannot restore, every rank returns the error and the
    /// engine is left as it was.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<u64> {
        let world = self.grid.world().clone();
        self.flat_state()?;
        let expected = self.whole_meta();
        let loaded = format::load(dir.as_ref(), tag, &expected, world.as_ref())?;
        // Every refusal happens on every rank before any rank changes anything.
        // Each rank reads its part of the files here, on its own.
        let staged = world.solo("checkpoint read", || self.stage_restore(&loaded));
        let (local, staged, position) = agreed(world.as_ref(), "checkpoint restore", staged)?;
        let committed = self.grads.commit_load(self.layers.clone(), &local, staged);
        let layers = agreed(world.as_ref(), "checkpoint commit", committed)?;
        self.layers = layers;
        self.core.restore(position);
        Ok(self.core.global_step())
    }

    /// Whether this stage steps Burn's optimizer (ZeRO stage 0), whose state is not flat.
    fn stage_zero(&self) -> bool {
        SyncOptions::of(&self.config).plan.cut() == Some(Cut::Nothing)
    }

    /// The regime whose flat state a checkpoint stores (ZeRO stage 1).
    fn flat_state(&self) -> Result<&dyn GradSync<Vec<L>>> {
        match self.stage_zero() {
            false => Ok(self.grads.as_ref()),
            true => Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.stage".into(),
                reason: "pipelined checkpoints store the flat optimizer state of ZeRO stage 1 \
                         (which trains the same losses as stage 0 in the pipeline); set the \
                         stage to 1"
                    .into(),
            }),
        }
    }

    /// The metadata of a checkpoint of the whole model, as one rank at ZeRO stage 1 writes
    /// it.
    fn whole_meta(&self) -> CheckpointMeta {
        CheckpointMeta {
            zero_stage: 1,
            // The tensors' catalog indices: ids are not restored from a grid checkpoint
            // (each rank keeps its own, under which its slices' layouts are recorded).
            param_ids: (0..self.catalog.len() as u64).collect(),
            shapes: self.catalog.iter().map(|t| t.shape.clone()).collect(),
            paths: self.catalog.iter().map(|t| t.name.clone()).collect(),
            ..CheckpointMeta::of_run(
                &self.config,
                crate::sync::ZeroPlan::of(&self.config).number(),
                self.core.position(),
            )
        }
    }

    /// Rank 0: the stages' parts (in stage order, empty from the other ranks) joined and
    /// written as one checkpoint.
    fn write_whole(&self, dir: &Path, tag: &str, stages: &[Vec<u8>]) -> Result<PathBuf> {
        let mut params = Vec::new();
        let mut whole = PartitionState {
            steps: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
        };
        for part in stages.iter().filter(|p| !p.is_empty()) {
            let (p, s) = decode_stage(part)?;
            params.extend(p);
            whole.steps.extend(s.steps);
            whole.m.extend(s.m);
            whole.v.extend(s.v);
        }
        let numel: usize = self.catalog.iter().map(|t| t.numel()).sum();
        if params.len() != numel || whole.steps.len() != self.catalog.len() {
            return Err(DeepSpeedError::Checkpoint(format!(
                "the stages sent {} values of {} tensors; the model has {numel} in {}",
                params.len(),
                whole.steps.len(),
                self.catalog.len()
            )));
        }
        let state_file = partition_file(0);
        let files = [
            ("model.bin", f32_bytes(&params)),
            (state_file.as_str(), partition_state_bytes(&whole)),
        ];
        format::write_checkpoint(dir, tag, self.whole_meta(), &files)
    }

    /// This rank's part of a whole checkpoint, checked and staged, changing nothing: its
    /// stage's tensors cut for its slice as one rank's checkpoint of its layout (which the
    /// regime cuts again for its data-parallel partition), the staged state, and the step
    /// protocol's position.
    fn stage_restore(&self, loaded: &Loaded) -> Result<(Loaded, StagedLoad, RestoredPosition)> {
        let sizes: Vec<usize> = self.catalog.iter().map(|t| t.numel()).collect();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for n in &sizes {
            ranges.push(at..at + n);
            at += n;
        }
        // Only this stage's tensors are read: their values and state back to back.
        let n = self.layout.slots.len();
        let mine = &ranges[self.first_slot..self.first_slot + n];
        let read = loaded.slice_state(&sizes, mine)?;
        let values = loaded.params_in(mine)?;
        let mut local = Vec::with_capacity(n);
        let mut at = 0;
        for r in mine {
            local.push(at..at + r.len());
            at += r.len();
        }
        let (tp, layout) = (self.grid.tensor_parallel(), &self.layout);
        let params = cut_flat(tp, layout, |i| &values[local[i].clone()]);
        let m = cut_flat(tp, layout, |i| &read.m[local[i].clone()]);
        let v = cut_flat(tp, layout, |i| &read.v[local[i].clone()]);
        let steps = read.steps[self.first_slot..self.first_slot + n].to_vec();
        let local = Loaded::in_memory(
            CheckpointMeta {
                // The model keeps its ids (the slices' layouts are recorded under them).
                param_ids: layout.slots.iter().map(|s| s.id.val()).collect(),
                shapes: layout.slots.iter().map(|s| s.shape.clone()).collect(),
                paths: Vec::new(),
                ep_size: None,
                files: Vec::new(),
                ..loaded.meta.clone()
            },
            params,
            vec![partition_state_bytes(&PartitionState { steps, m, v })],
        );
        // The step protocol's position is checked before the regime takes the state.
        let position = self.core.restorable(&loaded.meta.position())?;
        if self.stage_zero() {
            return Err(no_flat_state());
        }
        let staged = self.grads.stage_load(&local)?;
        Ok((local, staged, position))
    }
}

fn no_flat_state() -> DeepSpeedError {
    DeepSpeedError::Checkpoint("no flat optimizer state to restore".into())
}

/// One stage's whole tensors and state as bytes: the values' length (u64), the values, then
/// the state.
fn encode_stage(params: &[f32], state: &PartitionState) -> Vec<u8> {
    let values = f32_bytes(params);
    let mut out = (values.len() as u64).to_le_bytes().to_vec();
    out.extend(values);
    out.extend(partition_state_bytes(state));
    out
}

fn decode_stage(bytes: &[u8]) -> Result<(Vec<f32>, PartitionState)> {
    let short = || DeepSpeedError::Checkpoint("a stage sent a truncated part".into());
    let len = bytes.get(..8).ok_or_else(short)?;
    let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
    let values = bytes.get(8..8 + len).ok_or_else(short)?;
    let state = bytes.get(8 + len..).ok_or_else(short)?;
    Ok((
        f32_values(values, "a stage's values")?,
        partition_state_from_bytes(state, "a stage's state")?,
    ))
}
