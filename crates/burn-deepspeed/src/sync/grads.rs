//! [`GradStore`]: where a ZeRO stage 0-2 regime keeps a step's gradient, and how it reduces it
//! over the ranks: [`HostGrads`](super::HostGrads) (flat `Vec`s of f32, or f16 under fp16,
//! reduced in buckets, stage 2 on a communication thread under `overlap_comm`) and
//! [`DeviceGrads`](super::DeviceGrads) (a tensor on the model's device, reduced through the
//! device collectives).

use std::borrow::Cow;
use std::ops::Range;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_strategies::zero::FlatPartition;

use burn_deepspeed_strategies::place::Place;

use super::scale::{Scaling, clip_factor, sum_across};
use super::{FlatOptimizer, ModelParallelNorm, ModelPlace};
use crate::flat::ParamLayout;
use crate::{DeepSpeedError, Result, agreed};

/// What a regime of ZeRO stages 0-2 cuts across the data-parallel ranks (arXiv 1910.02054
/// §5): the builder's reading of `zero_optimization.stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Stage 0: every rank holds and steps everything; the gradient is all-reduced.
    Nothing,
    /// Stage 1: the optimizer state; the whole gradient is reduce-scattered at the boundary.
    OptimizerStates,
    /// Stage 2: the optimizer state and the gradients, reduce-scattered at every micro-batch.
    Gradients,
}

/// How a regime of stages 0-2 cuts the flat buffers: its [`Cut`], the partition over the
/// ranks (of one part at stage 0), and this rank's part of it (everything at stage 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// What is cut.
    pub cut: Cut,
    /// The flat buffers' partition.
    pub partition: FlatPartition,
    /// This rank's range of the flat buffers.
    pub own: Range<usize>,
}

impl Part {
    /// A balanced partition of `numel` elements over `world` ranks, `rank`'s part.
    pub fn balanced(cut: Cut, numel: usize, world: usize, rank: usize) -> Self {
        match cut {
            Cut::Nothing => Self::whole(numel),
            cut => Self::of(cut, FlatPartition::new(numel, world), rank),
        }
    }

    /// A partition at the boundaries of tensors of `sizes` elements over `world` ranks,
    /// `rank`'s part: each rank steps whole tensors.
    pub fn tensor_aligned(cut: Cut, sizes: &[usize], world: usize, rank: usize) -> Self {
        match cut {
            Cut::Nothing => Self::whole(sizes.iter().sum()),
            cut => Self::of(cut, FlatPartition::tensor_aligned(sizes, world), rank),
        }
    }

    fn whole(numel: usize) -> Self {
        Self {
            cut: Cut::Nothing,
            partition: FlatPartition::new(numel, 1),
            own: 0..numel,
        }
    }

    fn of(cut: Cut, partition: FlatPartition, rank: usize) -> Self {
        let own = partition.range(rank);
        Self {
            cut,
            partition,
            own,
        }
    }

    /// Every rank's part length (the whole at stage 0).
    pub fn counts(&self) -> Vec<usize> {
        match self.cut {
            Cut::Nothing => vec![self.own.len()],
            _ => self.partition.sizes(),
        }
    }
}

/// A step's gradient in a place: accumulated per micro-batch, reduced over the ranks to this
/// rank's part (the whole gradient at stage 0, its slice at stages 1-2), and lent to the
/// optimizer. Every method that reduces is a collective.
pub trait GradStore: Send + 'static {
    /// Where the gradient lives.
    type Place: ModelPlace;

    /// Adds one micro-batch's gradients of `model`, marking in `present` the parameters that
    /// have one (stage 2 reduce-scatters here; a failure goes to `deferred` for the step).
    /// Returns the bytes of the transient copies made.
    fn accumulate<M: Module>(
        &mut self,
        place: &Self::Place,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
        deferred: &mut Option<DeepSpeedError>,
    ) -> u64;

    /// Joins what a communication thread reduced (`overlap_comm`); its first failure.
    fn settle(&mut self) -> Option<DeepSpeedError> {
        None
    }

    /// Waits until no collective of this store runs on another thread.
    fn quiesce(&self) {}

    /// Ends the accumulation: the mean that `scaling` describes over the ranks, leaving this
    /// rank's part.
    fn reduce(&mut self, place: &Self::Place, scaling: Scaling) -> Result<()>;

    /// Tensor slicing: from now on [`own_sq`](Self::own_sq) counts what `norm` says.
    fn model_parallel(&mut self, place: &Self::Place, norm: &ModelParallelNorm) {
        let _ = (place, norm);
    }

    /// Σ g² of this rank's part (of what this rank counts under tensor slicing, `slices`).
    fn own_sq(&self, place: &Self::Place, slices: Option<&ModelParallelNorm>) -> Result<f64>;

    /// Multiplies this rank's part by `factor`.
    fn scale_own(&mut self, place: &Self::Place, factor: f32);

    /// This rank's part in f32 (a copy where the store keeps f16).
    fn own(&self) -> Result<Cow<'_, <Self::Place as ModelPlace>::Slice>>;

    /// Bytes the store holds.
    fn bytes(&self) -> u64;

    /// Drops the accumulated gradient.
    fn reset(&mut self);

    /// The gradients' device, once a micro-batch was accumulated.
    fn device(&self) -> Option<Device>;
}

/// Reduces `store`'s gradient over the ranks (the mean `scaling` describes) and clips this
/// rank's part by the global norm: the part's squared sum added over the ranks where each
/// holds a part (`parted`), then over the model-parallel groups of `slices`. Returns the norm
/// before clipping. Collective.
pub(super) fn reduce_and_clip<S: GradStore>(
    store: &mut S,
    place: &S::Place,
    scaling: Scaling,
    parted: bool,
    slices: Option<&ModelParallelNorm>,
    clip: f64,
) -> Result<f64> {
    store.reduce(place, scaling)?;
    let local = store.own_sq(place, slices)?;
    let data = match parted {
        true => sum_across(place.comm(), local)?,
        false => local,
    };
    let norm = match slices {
        Some(slices) => slices.across(data)?.sqrt(),
        None => data.sqrt(),
    };
    if let Some(factor) = clip_factor(norm, clip) {
        store.scale_own(place, factor);
    }
    Ok(norm)
}

/// One step of this rank's part `params` by `optim` (`None`: the caller steps with its own
/// optimizer, refused) with `store`'s reduced gradient, agreed on by the ranks when the
/// optimizer's state lives in a swap file (which can fail on one rank alone, before the
/// gather that follows). Returns the bytes of a transient f32 copy of a 16-bit gradient.
pub(super) fn step_part<S: GradStore>(
    optim: Option<&mut <S::Place as ModelPlace>::Optim>,
    place: &S::Place,
    store: &S,
    params: &mut <S::Place as Place>::Buf,
    present: &[u8],
    lr: f64,
) -> Result<u64> {
    let _span = tracing::debug_span!("optimizer_step", rank = place.rank()).entered();
    let Some(optim) = optim else {
        return Err(no_optimizer());
    };
    let offloaded = optim.is_offloaded();
    let stepped = store.own().and_then(|grads| {
        let widened = match &grads {
            Cow::Owned(widened) => 4 * place.len(widened) as u64,
            Cow::Borrowed(_) => 0,
        };
        optim.step(place, params, &grads, present, lr)?;
        Ok(widened)
    });
    match offloaded {
        true => agreed(place.comm(), "offloaded optimizer step", stepped),
        false => stepped,
    }
}

/// The refusal of a regime without an optimizer of its own asked to step.
pub(super) fn no_optimizer() -> DeepSpeedError {
    DeepSpeedError::Data(
        "this ZeRO regime has no optimizer: the caller steps its tensors and calls \
         finish_external_step"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_is_everything_at_stage_0_and_a_slice_above() {
        let whole = Part::balanced(Cut::Nothing, 10, 4, 3);
        assert_eq!((whole.own.clone(), whole.counts()), (0..10, vec![10]));
        let slice = Part::balanced(Cut::Gradients, 10, 4, 3);
        assert_eq!(slice.own, slice.partition.range(3));
        assert_eq!(slice.counts().iter().sum::<usize>(), 10);
        let aligned = Part::tensor_aligned(Cut::OptimizerStates, &[6, 4], 2, 1);
        assert_eq!(aligned.own, 6..10);
    }
}
