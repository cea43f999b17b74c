//! [`ExpertSync`]: the gradient regime of a model with expert-parallel MoE layers
//! (DeepSpeed-MoE, arXiv 2201.05596; DeepSpeed's `_reduce_expert_gradients` and its MoE
//! parameter groups in ZeRO stages 1-2). Two regimes of the same stage side by side: the
//! dense parameters over the data-parallel group, the experts over the expert-data-parallel
//! group (the ranks that hold the same experts). An expert's gradient on its rank already
//! sums the tokens of every rank of its expert-parallel group, so it is divided by the whole
//! data-parallel size, not by its own group's, which gives the gradient of `ep_size` 1. One
//! global norm over both clips both.
//!
//! Checkpoints hold the whole model, every expert in its layer's order, with the optimizer
//! state of every tensor ([`WholeLayout`]): they reload at another `ep_size` (1 included,
//! where the plain regimes read them) and at another world size. Both sides step flat
//! optimizer state for that, at stage 0 too (fp32 masters of the host parameters).

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::zero::PartitionState;

use super::{Cut, ZeroPlan};
use super::{
    GradSync, ModelParallelNorm, PartitionedSync, Reduced, SavedState, StagedLoad, SyncOptions,
    WholeLayout, broadcast_params, module_device,
};
use crate::checkpoint::{
    Loaded, SliceState, all_gather_bytes, f32_bytes, f32_values, partition_state_bytes,
    partition_state_from_bytes,
};
use crate::config::{DeepSpeedConfig, OffloadDevice};
use crate::flat::{ParamLayout, param_paths};
use crate::memory::ModelStateBytes;
use crate::moe::ExpertParallel;
use crate::optim::partitioned_kind;
use crate::{DeepSpeedError, Result, agreed};

/// The dense and the expert regimes of one model (see the module docs).
pub struct ExpertSync {
    layout: ParamLayout,
    /// The whole model's layout, which checkpoints store.
    whole: WholeLayout,
    /// The expert-parallel group: where every rank's experts are joined for a checkpoint.
    ep_group: Arc<dyn Communicator>,
    /// ZeRO stages 1-2 (else stage 0).
    partitioned: bool,
    dense: Regime,
    experts: Regime,
    /// `ep_size`: the experts' mean divides by it beside their group's size.
    ep_size: usize,
    /// `gradient_clipping` over both (the inner regimes do not clip).
    clip: f64,
}

/// The regime for `model`, whose MoE layers were cut over `ep` (and recorded their experts
/// there), on the data-parallel group `data`: ZeRO stages 0-2 with Adam, AdamW or LAMB on
/// the host, in fp32 or in fp16/bf16 with fp32 masters (fp32 gradient buffers). The dense
/// parameters are made rank 0's over `data`, the experts the first holder's over their
/// expert-data group. Collective over `data`.
pub fn build_expert_parallel<M: Module>(
    model: M,
    config: &DeepSpeedConfig,
    data: Arc<dyn Communicator>,
    ep: &ExpertParallel,
) -> Result<(M, Box<dyn GradSync<M>>)> {
    let (Some(ep_group), Some(expert_data)) = (ep.ep_group(), ep.expert_data_group()) else {
        return Err(DeepSpeedError::Regime(
            "expert parallelism of one rank has no groups".into(),
        ));
    };
    let optimizer = config
        .optimizer
        .as_ref()
        .ok_or_else(|| DeepSpeedError::Data("the config was not resolved".into()))?;
    // The ranks agree on what runs before the first broadcast.
    agreed(
        data.as_ref(),
        "expert parallelism",
        check(&model, config, ep),
    )?;
    let layout = ParamLayout::of(&model);
    let dense_layout = layout.subset(|id| !ep.is_expert(id));
    let expert_layout = layout.subset(|id| ep.is_expert(id));
    let model = broadcast_params(data.as_ref(), &dense_layout, model)?;
    let model = broadcast_params(expert_data.as_ref(), &expert_layout, model)?;
    let mut options = SyncOptions::of(config);
    let clip = std::mem::take(&mut options.clip);
    // Stage 0 steps the flat optimizer too (flat state that a checkpoint can cut by expert).
    let regime = |layout: ParamLayout, comm: Arc<dyn Communicator>| -> Result<Regime> {
        let kind = partitioned_kind(optimizer)?;
        // Stage 3 was refused above.
        let cut = options.plan.cut().unwrap_or(Cut::Gradients);
        PartitionedSync::new(layout, comm, &options, cut, kind)
    };
    let whole = whole_layout(&model, &layout, &expert_layout, data.as_ref(), ep, ep_group)?;
    let dense = regime(dense_layout, data)?;
    let mut experts = regime(expert_layout, expert_data.clone())?;
    // The experts' norm: this group's experts, then every group's over the exchange group.
    let norm = ModelParallelNorm::none().with_group(ep_group.clone(), []);
    get::<M>(&mut experts).model_parallel_norm(norm)?;
    let sync = ExpertSync {
        layout,
        whole,
        ep_group: ep_group.clone(),
        partitioned: options.plan.cut() != Some(Cut::Nothing),
        dense,
        experts,
        ep_size: ep.size(),
        clip,
    };
    Ok((model, Box::new(sync)))
}

/// The whole model's layout (every rank of the expert-parallel group tells the others its
/// experts' ids), agreed over `data`.
fn whole_layout<M: Module>(
    model: &M,
    layout: &ParamLayout,
    expert_layout: &ParamLayout,
    data: &dyn Communicator,
    ep: &ExpertParallel,
    ep_group: &Arc<dyn Communicator>,
) -> Result<WholeLayout> {
    let ids: Vec<u8> = expert_layout
        .slots
        .iter()
        .flat_map(|s| s.id.val().to_le_bytes())
        .collect();
    let peer_ids: Vec<Vec<u64>> = all_gather_bytes(ep_group.as_ref(), &ids)?
        .iter()
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        })
        .collect();
    let paths = param_paths(model, layout);
    let whole = WholeLayout::new(layout, &paths, &ep.layers(), ep.rank(), &peer_ids);
    agreed(data, "expert layout", whole)
}

/// What the expert regime cannot run, refused by key (the same verdict on every rank of a
/// symmetric program; the caller agrees on it all the same).
fn check<M: Module>(model: &M, config: &DeepSpeedConfig, ep: &ExpertParallel) -> Result<()> {
    let refuse = |key: &str, reason: &str| {
        Err(DeepSpeedError::Unsupported {
            key: key.into(),
            reason: format!("with expert parallelism (ep_size {}): {reason}", ep.size()),
        })
    };
    let zero = &config.zero_optimization;
    if ZeroPlan::of(config).shards_parameters() {
        return refuse(
            "zero_optimization.stage",
            "ZeRO stages 0-2 partition the experts in their own groups (as DeepSpeed-MoE); \
             stage 3 is not supported",
        );
    }
    if config.optimizer_kind().is_one_bit() {
        return refuse("optimizer.type", "1-bit compression is not supported");
    }
    if zero.optimizer_offload() != OffloadDevice::None || zero.offload_param.is_some() {
        return refuse(
            "zero_optimization.offload_optimizer",
            "offload is not supported",
        );
    }
    if module_device(model).is_some_and(|d| !burn_deepspeed_strategies::device::host_resident(&d)) {
        return refuse(
            "moe.ep_size",
            "the expert regime steps on the host; train on Flex",
        );
    }
    if ep.recorded() == 0 {
        return Err(DeepSpeedError::Data(
            "the grid has expert parallelism but no MoE layer recorded experts in it: cut \
             the model's layers with `MoE::expert_parallel(grid.expert_parallel())`"
                .into(),
        ));
    }
    Ok(())
}

/// One side's regime: stages 0-2 with the flat optimizer.
type Regime = PartitionedSync;

fn get<M: Module>(regime: &mut Regime) -> &mut dyn GradSync<M> {
    regime
}

fn view<M: Module>(regime: &Regime) -> &dyn GradSync<M> {
    regime
}

impl<M: Module> GradSync<M> for ExpertSync {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        get::<M>(&mut self.dense).accumulate(model, grads);
        get::<M>(&mut self.experts).accumulate(model, grads);
    }

    fn micro_steps(&self) -> u64 {
        view::<M>(&self.dense).micro_steps()
    }

    /// Both means (the experts' divided by `ep_size` more, folded into the same multiply as
    /// the loss scale), then one clip by the norm of both.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let experts = get::<M>(&mut self.experts).reduce(loss_scale * self.ep_size as f32)?;
        let dense = get::<M>(&mut self.dense).reduce(loss_scale)?;
        let norm = (dense.norm * dense.norm + experts.norm * experts.norm).sqrt();
        if self.clip > 0.0 && norm.is_finite() {
            let coef = self.clip / (norm + 1e-6);
            if coef < 1.0 {
                get::<M>(&mut self.dense).scale_reduced(coef as f32)?;
                get::<M>(&mut self.experts).scale_reduced(coef as f32)?;
            }
        }
        Ok(Reduced::global(norm))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let model = get::<M>(&mut self.dense).step(model, lr)?;
        get::<M>(&mut self.experts).step(model, lr)
    }

    fn discard(&mut self) {
        get::<M>(&mut self.dense).discard();
        get::<M>(&mut self.experts).discard();
    }

    fn reduced_gradients(&mut self, _: &M) -> Result<GradientsParams> {
        Err(DeepSpeedError::Unsupported {
            key: "moe.ep_size".into(),
            reason: "expert parallelism steps the engine's optimizer, not a caller's".into(),
        })
    }

    /// The parameters once (the model's), both regimes' gradients and optimizer state.
    fn held(&self, model: &M) -> ModelStateBytes {
        let (d, e) = (
            view::<M>(&self.dense).held(model),
            view::<M>(&self.experts).held(model),
        );
        ModelStateBytes {
            params: d.params,
            grads: d.grads + e.grads,
            optimizer: d.optimizer + e.optimizer,
            offloaded: d.offloaded + e.offloaded,
        }
    }

    /// The sum of the two regimes' peaks (at most that: their peaks may not coincide).
    fn peak(&self) -> u64 {
        view::<M>(&self.dense).peak() + view::<M>(&self.experts).peak()
    }

    /// Both sides keep fp32 masters of their parameters, taken from the f32 `model`; the
    /// model becomes its working copy in `dtype`.
    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        let working = get::<M>(&mut self.dense).keep_masters(model.clone(), dtype)?;
        get::<M>(&mut self.experts).keep_masters(model, dtype)?;
        Ok(working)
    }

    /// Every rank's experts joined into the whole model (a collective over the data and the
    /// expert-parallel groups; the fp32 masters in a 16-bit run).
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        let dense = view::<M>(&self.dense).whole_params(model, true)?;
        let mine = view::<M>(&self.experts).whole_params(model, true)?;
        let peers = all_gather_bytes(
            self.ep_group.as_ref(),
            &f32_bytes(&mine.unwrap_or_default()),
        )?
        .iter()
        .map(|b| f32_values(b, "an expert-parallel rank's experts"))
        .collect::<Result<Vec<_>>>()?;
        match wanted {
            true => self
                .whole
                .join(&dense.unwrap_or_default(), &peers)
                .map(Some),
            false => Ok(None),
        }
    }

    /// The whole model's optimizer state, every expert's included (a collective over the
    /// data and the expert-parallel groups).
    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        let dense = view::<M>(&self.dense).whole_moments()?;
        let mine = view::<M>(&self.experts).whole_moments()?;
        let (Some(dense), Some(mine)) = (dense, mine) else {
            return Ok(None);
        };
        let peers = all_gather_bytes(self.ep_group.as_ref(), &partition_state_bytes(&mine))?
            .iter()
            .map(|b| partition_state_from_bytes(b, "an expert-parallel rank's state"))
            .collect::<Result<Vec<_>>>()?;
        let steps: Vec<&[u32]> = peers.iter().map(|p| p.steps.as_slice()).collect();
        let m: Vec<&[f32]> = peers.iter().map(|p| p.m.as_slice()).collect();
        let v: Vec<&[f32]> = peers.iter().map(|p| p.v.as_slice()).collect();
        Ok(Some(PartitionState {
            steps: self.whole.join_tensors(&dense.steps, &steps)?,
            m: self.whole.join(&dense.m, &m)?,
            v: self.whole.join(&dense.v, &v)?,
        }))
    }

    fn stored_layout(&self) -> Option<&WholeLayout> {
        Some(&self.whole)
    }

    /// The whole model's state, written by rank 0: at stage 0 as `optim.bin`, at stages 1-2
    /// as rank 0's slice with every element (the other ranks' slices hold none), so that a
    /// plain engine of any world size joins them as it joins its own.
    fn save(&self, root: bool) -> Result<SavedState<'_>> {
        let state = GradSync::<M>::whole_moments(self)?.ok_or_else(|| {
            DeepSpeedError::Checkpoint(
                "this optimizer keeps no flat state; expert-parallel checkpoints need Adam, \
                 AdamW or LAMB"
                    .into(),
            )
        })?;
        Ok(match (self.partitioned, root) {
            (false, _) => SavedState::Replicated(root.then(|| partition_state_bytes(&state))),
            (true, true) => SavedState::Slice(SliceState::held(partition_state_bytes(&state))),
            (true, false) => {
                SavedState::Slice(SliceState::held(partition_state_bytes(&PartitionState {
                    steps: state.steps,
                    m: Vec::new(),
                    v: Vec::new(),
                })))
            }
        })
    }

    /// The whole model's parameters and state (written at any `ep_size` and world size, by
    /// this regime or a plain one with flat state) cut to this rank's dense tensors and
    /// experts. Every read happens before anything is restored.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad> {
        let state = match loaded.meta.zero_stage {
            0 => partition_state_from_bytes(&loaded.replicated_state()?, "optim.bin")?,
            _ => {
                let all = 0..self.whole.numel();
                loaded.slice_state(self.whole.numels(), std::slice::from_ref(&all))?
            }
        };
        let params = loaded.params()?;
        if params.len() != self.whole.numel() {
            return Err(DeepSpeedError::Checkpoint(format!(
                "model.bin holds {} values; the whole model has {}",
                params.len(),
                self.whole.numel()
            )));
        }
        let (dense_params, mine_params) = self.whole.split(params);
        let (dense_steps, mine_steps) = self.whole.split_tensors(&state.steps);
        let (dense_m, mine_m) = self.whole.split(&state.m);
        let (dense_v, mine_v) = self.whole.split(&state.v);
        let dense = PartitionState {
            steps: dense_steps,
            m: dense_m,
            v: dense_v,
        };
        let mine = PartitionState {
            steps: mine_steps,
            m: mine_m,
            v: mine_v,
        };
        Ok(StagedLoad::Experts(
            Box::new(self.dense.stage_whole(&dense_params, &dense)?),
            Box::new(self.experts.stage_whole(&mine_params, &mine)?),
        ))
    }

    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M> {
        let StagedLoad::Experts(dense, mine) = staged else {
            return Err(StagedLoad::mismatch("expert parallelism"));
        };
        let (dense_params, mine_params) = self.whole.split(loaded.params()?);
        let model = self.dense.commit_whole(model, &dense_params, *dense)?;
        self.experts.commit_whole(model, &mine_params, *mine)
    }
}
