//! [`ModelParallelNorm`]: the global gradient norm when the model itself is cut (tensor
//! slices, pipeline stages), as DeepSpeed computes it with an `mpu` (`get_global_norm`,
//! `get_grad_norm_direct`): each logical parameter counts once. A sliced parameter's slices
//! are disjoint parts of it and all count; a parameter replicated over the tensor-parallel
//! group (a LayerNorm, a row-parallel bias) has the same gradient on every rank of the group
//! and counts on its rank 0 only; a tied layer's copies on several stages count on the first;
//! the squared sums are then added over each model-parallel group.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::Communicator;

use super::GradElem;
use super::scale::{squared_sum, sum_across};
use crate::Result;
use crate::flat::ParamLayout;
use crate::tensor_parallel::TensorParallel;

/// The model-parallel half of a gradient norm: which flat ranges this rank leaves out, and
/// the groups that sum the rest (after the data-parallel sum of the regime's parts).
#[derive(Clone, Default)]
pub struct ModelParallelNorm {
    groups: Vec<Arc<dyn Communicator>>,
    /// Flat ranges (in layout order) this rank leaves out.
    skipped: Vec<Range<usize>>,
}

impl std::fmt::Debug for ModelParallelNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelParallelNorm")
            .field("groups", &self.groups.len())
            .field("skipped", &self.skipped.len())
            .finish()
    }
}

impl ModelParallelNorm {
    /// No model-parallel group: the norm of what the data-parallel ranks hold.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds the tensor-parallel group `comm`, over which the parameters in `layout` that `tp`
    /// recorded a layout for are slices and the others are replicated (counted on the
    /// group's first rank).
    pub fn with_tensor(
        mut self,
        comm: Arc<dyn Communicator>,
        layout: &ParamLayout,
        tp: &TensorParallel,
    ) -> Self {
        if comm.rank() > 0 {
            let replicated = layout.slots.iter().filter(|s| tp.layout(s.id).is_none());
            self.skipped
                .extend(replicated.map(|s| s.offset..s.offset + s.numel));
        }
        self.with_group(comm, std::iter::empty())
    }

    /// Adds a model-parallel group (e.g. the pipeline's stages) whose ranks hold disjoint
    /// parts of the model, this rank leaving `skipped` out (copies counted elsewhere).
    pub fn with_group(
        mut self,
        comm: Arc<dyn Communicator>,
        skipped: impl IntoIterator<Item = Range<usize>>,
    ) -> Self {
        self.skipped.extend(skipped);
        self.skipped.sort_by_key(|r| r.start);
        if comm.world_size() > 1 {
            self.groups.push(comm);
        }
        self
    }

    /// The ranges of a buffer this rank leaves out, where the buffer is made of segments
    /// given as (where the segment starts in the buffer, the flat range of the layout it
    /// holds).
    pub fn skipped_local(
        &self,
        windows: impl IntoIterator<Item = (usize, Range<usize>)>,
    ) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for (at, window) in windows {
            for r in &self.skipped {
                let (a, b) = (r.start.max(window.start), r.end.min(window.end));
                if a < b {
                    out.push(at + a - window.start..at + b - window.start);
                }
            }
        }
        out
    }

    /// Σ g² of `values`, the flat range starting at `offset`, without the parts this rank
    /// leaves out.
    pub fn host_sq<G: GradElem>(&self, values: &[G], offset: usize) -> f64 {
        let window = offset..offset + values.len();
        self.host_sq_windows(values, [(0, window)])
    }

    /// Σ g² of `values`, a buffer of segments (see [`skipped_local`](Self::skipped_local)),
    /// without the parts this rank leaves out.
    pub fn host_sq_windows<G: GradElem>(
        &self,
        values: &[G],
        windows: impl IntoIterator<Item = (usize, Range<usize>)>,
    ) -> f64 {
        let skipped: f64 = self
            .skipped_local(windows)
            .into_iter()
            .map(|r| squared_sum(&values[r]))
            .sum();
        (squared_sum(values) - skipped).max(0.0)
    }

    /// A 0/1 f32 mask over the flat range `window` (1 where this rank counts), on `device`;
    /// `None` when it counts everything.
    pub fn mask(&self, window: Range<usize>, device: &Device) -> Option<Tensor<1>> {
        self.mask_windows(window.len(), [(0, window)], device)
    }

    /// A 0/1 f32 mask over a buffer of `len` elements made of segments (see
    /// [`skipped_local`](Self::skipped_local)), on `device`; `None` when this rank counts
    /// everything.
    pub fn mask_windows(
        &self,
        len: usize,
        windows: impl IntoIterator<Item = (usize, Range<usize>)>,
        device: &Device,
    ) -> Option<Tensor<1>> {
        let skipped = self.skipped_local(windows);
        if skipped.is_empty() {
            return None;
        }
        let mut mask = vec![1.0f32; len];
        for r in skipped {
            mask[r].fill(0.0);
        }
        Some(Tensor::from_data(TensorData::new(mask, [len]), device))
    }

    /// The squared sums added over every group (a collective over each, in order).
    pub fn across(&self, local_sq: f64) -> Result<f64> {
        let mut sq = local_sq;
        for group in &self.groups {
            sq = sum_across(group.as_ref(), sq)?;
        }
        Ok(sq)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::module::{Module, Param};
    use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
    use burn::tensor::Device;
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::*;
    use crate::launch::launch;
    use crate::tensor_parallel::ColumnParallelLinear;

    #[derive(Module, Debug)]
    struct Net {
        norm: LayerNorm,
        col: ColumnParallelLinear,
    }

    /// A LayerNorm (replicated) and a column slice over 2 ranks: the summed norm counts the
    /// LayerNorm once and the slices each once, which is the whole model's norm.
    #[test]
    fn replicated_parameters_count_once() {
        let device = Device::flex();
        let whole: Linear = LinearConfig::new(3, 4).init(&device);
        let norm: LayerNorm = LayerNormConfig::new(3).init(&device);
        let ones = |p: &Param<Tensor<1>>| p.val().dims()[0];
        // Gradients: 1 on the LayerNorm's 6 values, 2 on the weight's 12 and the bias's 4.
        let want = 6.0 + 4.0 * 16.0;
        let (_, ranks) = launch(2, Duration::from_secs(60), |comm| {
            let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm.clone())));
            let net = Net {
                norm: norm.clone(),
                col: ColumnParallelLinear::from_linear(&whole, tp.clone()).expect("it splits"),
            };
            let layout = ParamLayout::of(&net);
            let n = 2 * ones(&net.norm.gamma);
            let mut grads = vec![1.0f32; n];
            grads.resize(layout.numel, 2.0);
            let slice_norm = ModelParallelNorm::none().with_tensor(comm, &layout, &tp);
            let host = slice_norm.across(slice_norm.host_sq(&grads, 0))?;
            // The second half of the buffer alone, as a partition would hold it.
            let half = layout.numel / 2;
            let part =
                slice_norm.host_sq(&grads[half..], half) + slice_norm.host_sq(&grads[..half], 0);
            let mask = slice_norm.mask(0..layout.numel, &Device::flex());
            Ok((
                host,
                slice_norm.across(part)?,
                mask.map(|m| m.sum().into_scalar::<f32>()),
            ))
        })
        .expect("the ranks run");
        for (rank, (host, part, mask)) in ranks.into_iter().enumerate() {
            assert_eq!(host, want);
            assert_eq!(part, want);
            // Rank 0 counts everything; rank 1 leaves the LayerNorm's 6 values out of its 14.
            assert_eq!(mask, (rank == 1).then_some(8.0));
        }
    }
}
