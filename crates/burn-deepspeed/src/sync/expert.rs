//! [`ExpertSync`]: the gradient regime of a model with expert-parallel MoE layers
//! (DeepSpeed-MoE, arXiv 2201.05596; DeepSpeed's `_reduce_expert_gradients` and its MoE
//! parameter groups in ZeRO stages 1-2). Two regimes of the same stage side by side: the
//! dense parameters over the data-parallel group, the experts over the expert-data-parallel
//! group (the ranks that hold the same experts). An expert's gradient on its rank already
//! sums the tokens of every rank of its expert-parallel group, so it is divided by the whole
//! data-parallel size, not by its own group's, which gives the gradient of `ep_size` 1. One
//! global norm over both clips both.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::comm::Communicator;

use super::{
    GradSync, ModelParallelNorm, PartitionedSync, Reduced, ReplicatedSync, SavedState, SyncOptions,
    broadcast_params, module_device,
};
use crate::config::{DeepSpeedConfig, OffloadDevice, ZeroStage};
use crate::engine::checkpoint::Loaded;
use crate::engine::flat::ParamLayout;
use crate::engine::memory::ModelStateBytes;
use crate::engine::{build_optimizer, partitioned_kind};
use crate::moe::ExpertParallel;
use crate::{DeepSpeedError, Result, agreed};

/// The dense and the expert regimes of one model (see the module docs).
pub struct ExpertSync {
    layout: ParamLayout,
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
        return Err(DeepSpeedError::Strategy(
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
    let regime = |layout: ParamLayout, comm: Arc<dyn Communicator>| -> Result<Regime> {
        Ok(match options.stage {
            ZeroStage::Disabled => Regime::Replicated(
                ReplicatedSync::new(layout, comm, &options, Some(build_optimizer(optimizer)?))
                    .with_flat_kind(partitioned_kind(optimizer).ok()),
            ),
            _ => Regime::Partitioned(PartitionedSync::new(
                layout,
                comm,
                &options,
                partitioned_kind(optimizer)?,
            )),
        })
    };
    let dense = regime(dense_layout, data)?;
    let mut experts = regime(expert_layout, expert_data.clone())?;
    // The experts' norm: this group's experts, then every group's over the exchange group.
    let norm = ModelParallelNorm::none().with_group(ep_group.clone(), []);
    experts.get::<M>().model_parallel_norm(norm)?;
    let sync = ExpertSync {
        layout,
        dense,
        experts,
        ep_size: ep.size(),
        clip,
    };
    Ok((model, Box::new(sync)))
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
    if zero.stage == ZeroStage::Parameters {
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

/// One side's regime: stage 0, or stages 1-2.
enum Regime {
    Replicated(ReplicatedSync<f32>),
    Partitioned(PartitionedSync<f32>),
}

impl Regime {
    fn get<M: Module>(&mut self) -> &mut dyn GradSync<M> {
        match self {
            Regime::Replicated(s) => s,
            Regime::Partitioned(s) => s,
        }
    }

    fn view<M: Module>(&self) -> &dyn GradSync<M> {
        match self {
            Regime::Replicated(s) => s,
            Regime::Partitioned(s) => s,
        }
    }
}

impl<M: Module> GradSync<M> for ExpertSync {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        self.dense.get::<M>().accumulate(model, grads);
        self.experts.get::<M>().accumulate(model, grads);
    }

    fn micro_steps(&self) -> u64 {
        self.dense.view::<M>().micro_steps()
    }

    /// Both means (the experts' divided by `ep_size` more, folded into the same multiply as
    /// the loss scale), then one clip by the norm of both.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let experts = self
            .experts
            .get::<M>()
            .reduce(loss_scale * self.ep_size as f32)?;
        let dense = self.dense.get::<M>().reduce(loss_scale)?;
        let norm = (dense.norm * dense.norm + experts.norm * experts.norm).sqrt();
        if self.clip > 0.0 && norm.is_finite() {
            let coef = self.clip / (norm + 1e-6);
            if coef < 1.0 {
                self.dense.get::<M>().scale_reduced(coef as f32)?;
                self.experts.get::<M>().scale_reduced(coef as f32)?;
            }
        }
        Ok(Reduced::global(norm))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let model = self.dense.get::<M>().step(model, lr)?;
        self.experts.get::<M>().step(model, lr)
    }

    fn discard(&mut self) {
        self.dense.get::<M>().discard();
        self.experts.get::<M>().discard();
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
            self.dense.view::<M>().held(model),
            self.experts.view::<M>().held(model),
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
        self.dense.view::<M>().peak() + self.experts.view::<M>().peak()
    }

    /// Both sides keep fp32 masters of their parameters, taken from the f32 `model`; the
    /// model becomes its working copy in `dtype`.
    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        let working = self.dense.get::<M>().keep_masters(model.clone(), dtype)?;
        self.experts.get::<M>().keep_masters(model, dtype)?;
        Ok(working)
    }

    fn save(&self, _: bool) -> Result<SavedState> {
        Err(not_yet("save"))
    }

    fn load(&mut self, _: M, _: &Loaded) -> Result<M> {
        Err(not_yet("load"))
    }
}

fn not_yet(what: &str) -> DeepSpeedError {
    DeepSpeedError::Unsupported {
        key: "moe.ep_size".into(),
        reason: format!("checkpoints of expert-parallel models cannot {what} yet"),
    }
}
