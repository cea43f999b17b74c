//! The [`GradSync`] trait: how one rank turns its micro-batches' gradients into an optimizer
//! step, whatever the ZeRO regime.

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::onebit::OneBitPhase;
use burn_deepspeed_strategies::swap::SwapSummary;
use burn_deepspeed_strategies::zero::PartitionState;

use crate::Result;
use crate::checkpoint::{Loaded, SliceState};
use crate::flat::{ParamLayout, params_to_flat};
use crate::memory::ModelStateBytes;
use crate::zero3::GatherStats;

/// What [`GradSync::reduce`] leaves for the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reduced {
    /// Global gradient norm before clipping.
    pub norm: f64,
    /// When each rank clipped its own gradient (a 1-bit optimizer's compression stage):
    /// this rank's squared norm, averaged over ranks for the report.
    pub local_norm_sq: Option<f64>,
    /// Whether the step exchanges 1-bit compressed momenta instead of gradients.
    pub compressed: bool,
    /// The norm is not finite (inf or NaN somewhere in the gradient): the overflow flag that
    /// loss scaling and skipped steps read.
    pub overflow: bool,
}

impl Reduced {
    /// A 1-bit optimizer's gradient with norm `norm`: this rank's own once `compressed`
    /// (each rank clipped its own gradient, and the report averages the squares over the
    /// ranks), else reduced over every rank.
    pub fn one_bit(norm: f64, compressed: bool) -> Self {
        Self {
            norm,
            local_norm_sq: compressed.then_some(norm * norm),
            compressed,
            overflow: !norm.is_finite(),
        }
    }

    /// A gradient reduced over every rank with global norm `norm`.
    pub fn global(norm: f64) -> Self {
        Self {
            norm,
            local_norm_sq: None,
            compressed: false,
            overflow: !norm.is_finite(),
        }
    }
}

/// A checkpoint's optimizer state checked and prepared for one regime by
/// [`GradSync::stage_load`], not in place yet.
pub enum StagedLoad {
    /// Burn's optimizer, rebuilt from `optim.bin` (ZeRO stage 0).
    Burn(ModuleOptimizer),
    /// This rank's cut of a flat state (steps, m and v).
    Flat(PartitionState),
    /// ZeRO stage 3: this rank's cut of the flat state, its pieces of the parameters (in its
    /// buffer's order) and the persistent tensors whole (`None` for the partitioned ones),
    /// read without the rest of the checkpoint.
    Sharded {
        /// The optimizer state of the pieces.
        state: PartitionState,
        /// The pieces' parameters.
        pieces: Vec<f32>,
        /// Per tensor: its whole values when it is persistent.
        persistent: Vec<Option<Vec<f32>>>,
    },
    /// A 1-bit optimizer built and restored from the checkpoint (the regime's own type).
    OneBit(Box<dyn std::any::Any>),
    /// Expert parallelism: the dense tensors' state and this rank's experts'.
    Experts(Box<StagedLoad>, Box<StagedLoad>),
}

impl StagedLoad {
    /// The refusal of a load staged by another kind of regime (a defect, never input).
    pub fn mismatch(regime: &str) -> crate::DeepSpeedError {
        crate::DeepSpeedError::Regime(format!(
            "{regime} was given a load staged by another regime"
        ))
    }
}

/// Where [`GradSync::stream_params`] hands the parameters, piece by piece in layout order.
pub type ParamSink<'a> = &'a mut dyn FnMut(&[f32]);

/// The optimizer state a rank contributes to a checkpoint.
#[derive(Debug)]
pub enum SavedState<'a> {
    /// The same on every rank: rank 0 writes it as `optim.bin` (`None` on the other ranks,
    /// which need not serialize it).
    Replicated(Option<Vec<u8>>),
    /// This rank's slice: every rank writes its own `zero_pp_rank_R_optim_states.bin`.
    Slice(SliceState<'a>),
}

/// One data-parallel gradient regime: accumulate a micro-batch's gradients, reduce them
/// (average over ranks and micro-batches, clip, flag overflow), step, report the model state
/// held, and save or restore the optimizer state.
///
/// Three regimes implement it, as ZeRO's stages (arXiv 1910.02054) cut the state:
/// [`ReplicatedSync`](super::ReplicatedSync) (stage 0, and
/// [`CompressedSync`](super::CompressedSync) with a 1-bit optimizer),
/// [`PartitionedSync`](super::PartitionedSync) (stages 1 and 2) and
/// [`ShardedSync`](super::ShardedSync) (stage 3). The engine holds one `Box<dyn GradSync<M>>`
/// and calls, per optimizer step: [`accumulate`](Self::accumulate) once per micro-batch, then
/// [`reduce`](Self::reduce), then [`step`](Self::step) (or, when the caller owns the
/// optimizer, [`reduced_gradients`](Self::reduced_gradients), its own step, and
/// [`finish_external_step`](Self::finish_external_step)). Every method that communicates is
/// a collective: every rank calls it in the same order.
pub trait GradSync<M: Module> {
    /// The parameters' flat layout.
    fn layout(&self) -> &ParamLayout;

    /// Adds one micro-batch's gradients (stages 2 and 3 reduce-scatter here).
    fn accumulate(&mut self, model: &M, grads: &GradientsParams);

    /// Micro-batches accumulated since the last step.
    fn micro_steps(&self) -> u64;

    /// Waits until no collective that this regime overlaps with computation (stage 2's
    /// `overlap_comm`) is running, so that the caller may call collectives of the same
    /// communicator itself. Regimes that overlap nothing return at once.
    fn settle(&self) {}

    /// Marks the engine's forward and backward of one micro-batch (`running` true before it,
    /// false after): in between a regime may run collectives of its own on a communication
    /// thread (stage 3's gathers ahead under `overlap_comm`), and `false` waits for them, so
    /// that a forward the engine does not run (a user's evaluation) never races the caller's
    /// collectives. Regimes that overlap nothing ignore it.
    fn forward_scope(&self, _running: bool) {}

    /// Ends the accumulation: averages over ranks and micro-batches, divides out
    /// `loss_scale` (the factor the loss was multiplied by before backward: fp16's loss scale,
    /// else 1) and clips by the global norm of the result.
    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced>;

    /// Before [`reduce`](Self::reduce): lets `edit` change the accumulated gradient, whole and
    /// flat in layout order, where the regime holds it so (stage 0 with Burn's optimizer): the
    /// pipeline adds its tied layers' gradients across stages here. Other regimes refuse.
    fn edit_accumulated(&mut self, edit: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        let _ = edit;
        Err(crate::DeepSpeedError::Regime(
            "this gradient regime does not hold the whole accumulated gradient".into(),
        ))
    }

    /// After [`reduce`](Self::reduce): steps this regime's optimizer and returns the updated
    /// model (the same on every rank).
    fn step(&mut self, model: M, lr: f64) -> Result<M>;

    /// After [`reduce`](Self::reduce): multiplies this rank's reduced gradient by `factor`
    /// (a caller that clips over several regimes by their joint norm, as expert parallelism
    /// does, applies the coefficient here). Regimes that cannot refuse.
    fn scale_reduced(&mut self, factor: f32) -> Result<()> {
        let _ = factor;
        Err(crate::DeepSpeedError::Regime(
            "this gradient regime cannot rescale its reduced gradient".into(),
        ))
    }

    /// After [`reduce`](Self::reduce), instead of a step (the norm was not finite): drops the
    /// accumulated gradient and leaves the parameters and the optimizer state as they are.
    fn discard(&mut self);

    /// After [`reduce`](Self::reduce), for a caller that steps with its own optimizer: the
    /// gradients it steps on this rank (whole tensors at stage 0, this rank's tensors at
    /// stages 1-2, this rank's chunks at stage 3). Clears the buffers.
    fn reduced_gradients(&mut self, model: &M) -> Result<GradientsParams>;

    /// After the caller stepped [`reduced_gradients`](Self::reduced_gradients) into `model`:
    /// makes every rank's model consistent again. Returns the model to load back where it
    /// changed (stages 1-2 all-gather the updated slices), `None` where `model` stands.
    fn finish_external_step(&mut self, model: &M) -> Result<Option<M>> {
        let _ = model;
        Ok(None)
    }

    /// The model state this rank holds now, measured (see [`crate::memory`]).
    fn held(&self, model: &M) -> ModelStateBytes;

    /// The largest model state (held plus the step's transient buffers) observed so far.
    fn peak(&self) -> u64;

    /// The whole parameters, flat in layout order, where `wanted` (at stage 3 a collective
    /// that every rank joins, wanted or not). By default, read from the model as it is.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| params_to_flat(model, self.layout())))
    }

    /// The whole parameters, flat in layout order, handed to `sink` in pieces (one or more
    /// tensors each, in order) where it is given: a collective that every rank joins, with a
    /// sink or not, as [`whole_params`](Self::whole_params). By default, that whole buffer at
    /// once; stage 3 gathers and hands over one tensor at a time.
    fn stream_params(&self, model: &M, sink: Option<ParamSink>) -> Result<()> {
        let whole = self.whole_params(model, sink.is_some())?;
        if let (Some(sink), Some(whole)) = (sink, whole) {
            sink(&whole);
        }
        Ok(())
    }

    /// A copy of `model` with whole parameters (at stage 3 a collective gather that leaves
    /// `model` sharded). By default, the model as it is.
    fn whole_model(&self, model: &M) -> Result<M> {
        Ok(model.clone())
    }

    /// `model` with whole parameters, for use without this regime (at stage 3 a collective
    /// that releases the gather group). By default, the model as it is.
    fn release_whole(&self, model: M) -> Result<M> {
        Ok(model)
    }

    /// The layout a checkpoint stores, where it is not [`layout`](Self::layout): expert
    /// parallelism stores the whole model with every expert (see
    /// [`WholeLayout`](super::WholeLayout)).
    fn stored_layout(&self) -> Option<&super::WholeLayout> {
        None
    }

    /// This rank's optimizer state for a checkpoint (`root`: this rank writes replicated
    /// state).
    fn save(&self, root: bool) -> Result<SavedState<'_>>;

    /// The first phase of an all-or-nothing load: checks a checkpoint read by every rank
    /// against this regime and prepares this rank's optimizer state (cut again for this world
    /// size where partitioned), changing nothing. Every refusal of a load happens here, so
    /// that the ranks can agree before any of them commits.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad>;

    /// The second phase: puts what [`stage_load`](Self::stage_load) prepared in place, the
    /// parameters and their ids into `model` and the optimizer state into this regime. Fails
    /// only writing a swap file (ZeRO-Infinity), which then refuses every step until a load
    /// succeeds.
    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M>;

    /// The whole optimizer state (steps, m and v in layout order) on every rank, joined from
    /// every rank's slice: a collective. `None` where the state is not flat slices (Burn's or
    /// a 1-bit optimizer).
    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        Ok(None)
    }

    /// ZeRO-Infinity: the optimizer's swap file (size, engine, transfers), when offloaded.
    fn swap(&self) -> Option<SwapSummary> {
        None
    }

    /// ZeRO-Infinity: the parameter store under `offload_param` (stage 3).
    fn param_store(&self) -> Option<crate::zero3::ParamStoreSummary> {
        None
    }

    /// ZeRO stage 3's gather counters.
    fn gather_stats(&self) -> Option<GatherStats> {
        None
    }

    /// Burn's optimizer, when this regime steps with one.
    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        None
    }

    /// The 1-bit optimizer's phase, when this regime steps with one.
    fn one_bit(&self) -> Option<&dyn OneBitPhase> {
        None
    }

    /// Mixed precision with the caller's optimizer (the Learner strategy): the caller steps
    /// fp32 masters itself and runs `working`, their copy in `dtype`. At stage 3 the gathers
    /// send chunks in `dtype` from now on and prefetch from `working`; the other regimes need
    /// nothing. Call it again whenever the working copy is rebuilt, and with the masters and
    /// f32 before gathering the masters whole.
    fn track_working_copy(&mut self, working: &M, dtype: FloatDType) {
        let _ = (working, dtype);
    }

    /// Model parallelism (tensor slices, pipeline stages): from now on the global norm
    /// counts each logical parameter once over the model-parallel groups (see [`ModelParallelNorm`](super::ModelParallelNorm)). Regimes that cannot
    /// refuse.
    fn model_parallel_norm(&mut self, norm: super::ModelParallelNorm) -> Result<()> {
        let _ = norm;
        Err(crate::DeepSpeedError::Unsupported {
            key: "tensor_parallel.tp_size".into(),
            reason: "this gradient regime (1-bit compression or the Learner's optimizer) \
                     does not run with model parallelism; use Adam or AdamW at ZeRO stages 0-3"
                .into(),
        })
    }

    /// Mixed precision: keeps fp32 master copies of this rank's parameters, taken from
    /// `model` (still in f32), and returns the model's working copy in `dtype` (f16 or bf16).
    /// From then on the optimizer steps the masters and the model receives them rounded.
    /// Regimes that cannot keep masters refuse.
    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        let _ = (model, dtype);
        Err(crate::DeepSpeedError::Unsupported {
            key: "bf16.enabled".into(),
            reason: "this gradient regime keeps no fp32 master weights yet".into(),
        })
    }
}

/// The refusal of a regime whose caller steps with its own optimizer (the Learner strategy):
/// that optimizer would step the 16-bit parameters, with no fp32 masters.
pub(crate) fn caller_optimizer_keeps_no_masters(dtype: FloatDType) -> crate::DeepSpeedError {
    let key = if dtype == FloatDType::F16 {
        "fp16.enabled"
    } else {
        "bf16.enabled"
    };
    crate::DeepSpeedError::Unsupported {
        key: key.into(),
        reason: "the Learner strategy steps the Learner's own optimizer, which keeps no fp32 \
                 master weights"
            .into(),
    }
}

/// The refusal of a 1-bit regime asked for its gradients: its optimizer steps the flat
/// buffers itself.
pub(crate) fn one_bit_has_no_gradients() -> crate::DeepSpeedError {
    crate::DeepSpeedError::Data(
        "a 1-bit optimizer steps the flat buffers itself; it has no gradients to hand out".into(),
    )
}
