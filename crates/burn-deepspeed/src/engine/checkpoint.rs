//! The engine's checkpoints: what it saves and how a load is checked before it is committed
//! (the files and their protocol are [`crate::checkpoint`]).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::train::TrainStep;
use burn_deepspeed_strategies::comm::CommunicatorExt;

use super::base::*;
use crate::checkpoint::{self, CheckpointMeta};
use crate::flat::param_paths;
use crate::step::StepLoss;
use crate::{DeepSpeedError, Result, agreed};

impl<M> DeepSpeedEngine<M>
where
    M: Module + TrainStep,
    M::Output: StepLoss,
{
    /// Saves the model, the optimizer state and the step as checkpoint `tag` (default
    /// `global_step{N}`, as in DeepSpeed) under `dir`, atomically, and points `dir/latest` at
    /// it. Collective: every rank calls it (see [`checkpoint`] for who writes what; the
    /// directory must be visible to every rank). Returns the checkpoint's directory.
    ///
    /// 1-bit optimizers save m, v, their frozen coefficients and the step (which fixes the
    /// phase), not the compression error buffers: after a load those start from zero, as in
    /// DeepSpeed.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        self.refuse_sliced_checkpoint()?;
        self.sync.settle();
        let tag = tag.map_or_else(
            || format!("global_step{}", self.core.global_step()),
            String::from,
        );
        let meta = self.meta();
        checkpoint::save(
            dir.as_ref(),
            &tag,
            self.comm.as_ref(),
            self.sync.as_ref(),
            &self.model,
            meta,
        )
    }

    /// Loads checkpoint `tag` (default: the one `dir/latest` names) into this engine: model,
    /// optimizer state and step. Refuses, with the reason, a checkpoint whose files are
    /// corrupt or whose parameters, optimizer or ZeRO stage differ from this engine's (stages
    /// 1-3 load each other's). The world size may differ from the one that saved it: each
    /// rank reads the parts of the saved slices that its partition in this world covers.
    /// Every rank calls it (rank 0 reads `latest` and tells the others the tag; each reads
    /// the files, so they must be visible to every rank). All or nothing: when any rank cannot read or restore the
    /// checkpoint, every rank returns the error and the engine is left as it was. Returns the
    /// step.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<u64> {
        self.refuse_sliced_checkpoint()?;
        self.sync.settle();
        let comm = self.comm.clone();
        let loaded = checkpoint::load(dir.as_ref(), tag, &self.meta(), comm.as_ref())?;
        // Everything that can refuse the checkpoint (the step protocol's position, the
        // regime's state) is checked on every rank before any rank changes anything. Each
        // rank reads its part of the files here, on its own.
        let staged = comm.as_ref().solo("checkpoint read", || {
            self.core
                .restorable(&loaded.meta.position())
                .and_then(|position| Ok((self.sync.stage_load(&loaded)?, position)))
        });
        let (staged, position) = agreed(comm.as_ref(), "checkpoint restore", staged)?;
        // Only a swap file's write can fail from here (and then refuses every step).
        let committed = self.sync.commit_load(self.model.clone(), &loaded, staged);
        let model = agreed(comm.as_ref(), "checkpoint commit", committed)?;
        self.model = model;
        self.core.restore(position);
        self.loss_sum = 0.0;
        Ok(self.core.global_step())
    }

    /// Checkpoints store whole tensors' slices with their layout only from the grid-aware
    /// format on (not yet): a sliced model is refused rather than saved as if whole.
    fn refuse_sliced_checkpoint(&self) -> Result<()> {
        match self.grid.topology().tensor {
            1 => Ok(()),
            tp => Err(DeepSpeedError::Unsupported {
                key: "tensor_parallel.tp_size".into(),
                reason: format!(
                    "checkpoints of a model sliced over {tp} ranks are not implemented yet"
                ),
            }),
        }
    }

    /// This engine's checkpoint metadata (no files yet).
    fn meta(&self) -> CheckpointMeta {
        let layout = self.sync.layout();
        // Expert parallelism stores the whole model, every expert.
        let stored = self.sync.stored_layout();
        CheckpointMeta {
            world_size: self.comm.world_size(),
            compressing: self.sync.one_bit().map(|o| o.compressing()),
            param_ids: match stored {
                Some(w) => w.ids.clone(),
                None => layout.slots.iter().map(|s| s.id.val()).collect(),
            },
            shapes: match stored {
                Some(w) => w.shapes.clone(),
                None => layout.slots.iter().map(|s| s.shape.clone()).collect(),
            },
            paths: match stored {
                Some(w) => w.paths.clone(),
                None => param_paths(&self.model, layout),
            },
            ep_size: Some(self.grid.expert_parallel().size()).filter(|&n| n > 1),
            ..CheckpointMeta::of_run(
                &self.config,
                crate::sync::ZeroPlan::of(&self.config).number(),
                self.core.position(),
            )
        }
    }
}
