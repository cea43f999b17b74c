//! [`FlatOptimizer`]: Adam, AdamW or LAMB on one rank's slice of the flat fp32 parameters, in
//! a place: [`PartitionedOptimizer`] on the host (the CPU fused kernels; ZeRO-Infinity's swap
//! file for offload), [`DeviceFlatOptimizer`] on the model's device (the fused CubeCL Adam;
//! LAMB by device ops, see [`device_step`]).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::Tensor;
use burn_deepspeed_strategies::Result as StrategiesResult;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace, Place};
use burn_deepspeed_strategies::swap::SwapSummary;
use burn_deepspeed_strategies::zero::{
    FlatPartition, PartitionState, PartitionedKind, PartitionedOptimizer, Segment,
};

use super::ModelPlace;
use super::device_step::{DeviceOptimizer, StepState, device_step};
use crate::Result;
use crate::checkpoint::{SliceState, f32_bytes, partition_state_bytes, partition_state_head};

/// Where an offloaded step hands each stepped tile: its range of the slice and its values.
pub type TileSink<'a> = dyn FnMut(Range<usize>, &[f32]) -> StrategiesResult<()> + 'a;

/// The optimizer of one rank's slice of the flat parameters, in place `P`. Its state is the
/// same [`PartitionState`] in every place, so that checkpoints move between them.
pub trait FlatOptimizer<P: ModelPlace>: Send {
    /// One step of `params` (this rank's slice, fp32) with its reduced gradient `grads` at
    /// `lr`; tensors whose mark in `present` is 0 keep their values and state. Collective for
    /// LAMB where tensors are cut across ranks.
    fn step(
        &mut self,
        place: &P,
        params: &mut P::Buf,
        grads: &P::Slice,
        present: &[u8],
        lr: f64,
    ) -> Result<()>;

    /// Bytes of optimizer state held in memory.
    fn state_bytes(&self) -> u64;

    /// Bytes of optimizer state in a swap file.
    fn disk_bytes(&self) -> u64 {
        0
    }

    /// The slice's state (steps, m and v), read into host memory.
    fn export(&self, place: &P) -> Result<PartitionState>;

    /// The slice's state as its checkpoint file ([`partition_state_bytes`]'s layout).
    fn export_file(&self, place: &P) -> Result<SliceState<'_>> {
        Ok(SliceState::held(partition_state_bytes(
            &self.export(place)?,
        )))
    }

    /// Restores the slice's state (and, when offloaded, its fp32 `masters`). Fails only as
    /// [`check_restore`](Self::check_restore) says, or writing an offloaded state's swap file
    /// (which then refuses every step until a restore succeeds).
    fn restore(&mut self, place: &P, state: PartitionState, masters: Option<&[f32]>) -> Result<()>;

    /// The error [`restore`](Self::restore) would return for a state (or masters) of another
    /// slice, found before anything changes: the first phase of an all-or-nothing load.
    fn check_restore(&self, state: &PartitionState, masters: Option<&[f32]>) -> Result<()>;

    /// Whether the state lives in a swap file (ZeRO-Infinity).
    fn is_offloaded(&self) -> bool {
        false
    }

    /// The fp32 masters an offloaded optimizer keeps in its swap file.
    fn masters(&self) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }

    /// The swap file's summary, when offloaded.
    fn swap_summary(&self) -> Option<SwapSummary> {
        None
    }

    /// An offloaded step tile by tile: each stepped range of the slice goes to `done` as soon
    /// as it is stepped, so that no buffer of the whole slice is made (ZeRO-Infinity with
    /// `offload_param`). Only an optimizer offloaded to a swap file has tiles.
    fn step_tiles(
        &mut self,
        grads: &P::Slice,
        present: &[u8],
        lr: f64,
        done: &mut TileSink<'_>,
    ) -> Result<()> {
        let _ = (grads, present, lr, done);
        Err(crate::DeepSpeedError::Regime(
            "only an optimizer offloaded to a swap file steps tile by tile".into(),
        ))
    }
}

/// The host's flat optimizer: the [`PartitionedOptimizer`] and the communicator its LAMB norms
/// are summed over (a world of the rank alone where every rank holds whole tensors).
#[derive(Debug)]
pub struct HostFlatOptimizer {
    /// The slice's optimizer (offloaded to a swap file by the regime under ZeRO-Infinity).
    pub inner: PartitionedOptimizer,
    comm: Arc<dyn Communicator>,
}

impl HostFlatOptimizer {
    /// `kind` on `rank`'s slice of `partition` over tensors of `sizes` elements, its norms
    /// summed over `comm`.
    pub fn new(
        kind: PartitionedKind,
        partition: &FlatPartition,
        rank: usize,
        sizes: &[usize],
        comm: Arc<dyn Communicator>,
    ) -> Self {
        Self {
            inner: PartitionedOptimizer::new(kind, partition, rank, sizes),
            comm,
        }
    }
}

impl HostFlatOptimizer {
    /// `kind` on a rank's buffer of `own_len` elements made of the pieces `segments` of
    /// `tensors` tensors (ZeRO stage 3), its norms summed over `comm`.
    pub fn over_segments(
        kind: PartitionedKind,
        segments: Vec<Segment>,
        own_len: usize,
        tensors: usize,
        comm: Arc<dyn Communicator>,
    ) -> Self {
        Self {
            inner: PartitionedOptimizer::over_segments(kind, segments, 0..own_len, tensors),
            comm,
        }
    }
}

impl FlatOptimizer<HostPlace> for HostFlatOptimizer {
    fn step(
        &mut self,
        _place: &HostPlace,
        params: &mut Vec<f32>,
        grads: &[f32],
        present: &[u8],
        lr: f64,
    ) -> Result<()> {
        (self.inner).step(self.comm.as_ref(), params, grads, present, lr)?;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.inner.state_bytes()
    }

    fn disk_bytes(&self) -> u64 {
        self.inner.disk_bytes()
    }

    fn export(&self, _place: &HostPlace) -> Result<PartitionState> {
        Ok(self.inner.export()?.into_owned())
    }

    /// Written as it is read: an offloaded slice's moments come from the swap file a tile at
    /// a time (one pass), each tile's m and v written where they belong in the file.
    fn export_file(&self, _place: &HostPlace) -> Result<SliceState<'_>> {
        let len = self.inner.own().len();
        let head = partition_state_head(self.inner.steps(), len);
        let at = head.len() as u64;
        Ok(SliceState::streamed(at + 8 * len as u64, move |sink| {
            sink(0, &head)?;
            self.inner.export_tiles(|r, m, v| {
                sink(at + 4 * r.start as u64, &f32_bytes(m))?;
                sink(at + 4 * (len + r.start) as u64, &f32_bytes(v))
            })
        }))
    }

    fn restore(
        &mut self,
        _place: &HostPlace,
        state: PartitionState,
        masters: Option<&[f32]>,
    ) -> Result<()> {
        self.inner.restore(state, masters)?;
        Ok(())
    }

    fn check_restore(&self, state: &PartitionState, masters: Option<&[f32]>) -> Result<()> {
        Ok(self.inner.check_restore(state, masters)?)
    }

    fn is_offloaded(&self) -> bool {
        self.inner.is_offloaded()
    }

    fn masters(&self) -> Result<Option<Vec<f32>>> {
        Ok(self.inner.masters()?)
    }

    fn swap_summary(&self) -> Option<SwapSummary> {
        self.inner.swap_summary()
    }

    fn step_tiles(
        &mut self,
        grads: &[f32],
        present: &[u8],
        lr: f64,
        done: &mut TileSink<'_>,
    ) -> Result<()> {
        Ok(self.inner.step_tiles(grads, present, lr, done)?)
    }
}

/// The device's flat optimizer: m and v of the slice as device tensors, each tensor's step
/// count, and the fused step of `device_step`.
#[derive(Debug)]
pub struct DeviceFlatOptimizer {
    kind: DeviceOptimizer,
    m: Tensor<1>,
    v: Tensor<1>,
    steps: Vec<u32>,
    /// Each tensor's part of the slice, in slice coordinates.
    pieces: Vec<(usize, Range<usize>)>,
    /// LAMB's norms are summed over the ranks (the tensors are cut across them).
    across: bool,
}

impl DeviceFlatOptimizer {
    /// `kind` on the slice `own` of flat parameters of `sizes` elements per tensor, in
    /// `place`; `across`: the tensors are cut across the ranks.
    pub fn new(
        kind: PartitionedKind,
        place: &DevicePlace,
        own: Range<usize>,
        sizes: &[usize],
        across: bool,
    ) -> Self {
        let mut offset = 0;
        let pieces = (sizes.iter().enumerate())
            .filter_map(|(i, &n)| {
                let (a, b) = (offset.max(own.start), (offset + n).min(own.end));
                offset += n;
                (a < b).then(|| (i, a - own.start..b - own.start))
            })
            .collect();
        Self::over_pieces(kind, place, pieces, own.len(), sizes.len(), across)
    }

    /// `kind` on a buffer of `len` elements whose `pieces` (tensor, range in the buffer, in
    /// buffer order) cover it, of `tensors` tensors in all.
    pub fn over_pieces(
        kind: PartitionedKind,
        place: &DevicePlace,
        pieces: Vec<(usize, Range<usize>)>,
        len: usize,
        tensors: usize,
        across: bool,
    ) -> Self {
        let kind = match kind {
            PartitionedKind::Adam(adam) => DeviceOptimizer::Adam(adam),
            PartitionedKind::Lamb(lamb) => DeviceOptimizer::Lamb(lamb),
        };
        Self {
            kind,
            m: place.zeros(len),
            v: place.zeros(len),
            steps: vec![0; tensors],
            pieces,
            across,
        }
    }
}

impl FlatOptimizer<DevicePlace> for DeviceFlatOptimizer {
    fn step(
        &mut self,
        place: &DevicePlace,
        params: &mut Tensor<1>,
        grads: &Tensor<1>,
        present: &[u8],
        lr: f64,
    ) -> Result<()> {
        let state = StepState {
            m: &mut self.m,
            v: &mut self.v,
            steps: &mut self.steps,
            present,
        };
        // LAMB's norm all-reduce counts its own staging.
        let across = self.across.then_some(place.collectives().as_ref());
        let (kind, pieces, device) = (&self.kind, &self.pieces, place.device());
        *params = device_step(
            kind,
            lr,
            params.clone(),
            grads,
            state,
            pieces,
            across,
            device,
        )?;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        8 * self.m.dims()[0] as u64
    }

    fn export(&self, place: &DevicePlace) -> Result<PartitionState> {
        Ok(PartitionState {
            steps: self.steps.clone(),
            m: place.read(&self.m),
            v: place.read(&self.v),
        })
    }

    fn restore(
        &mut self,
        place: &DevicePlace,
        state: PartitionState,
        masters: Option<&[f32]>,
    ) -> Result<()> {
        self.check_restore(&state, masters)?;
        self.m = place.write(state.m);
        self.v = place.write(state.v);
        self.steps = state.steps;
        Ok(())
    }

    fn check_restore(&self, state: &PartitionState, _masters: Option<&[f32]>) -> Result<()> {
        let len = self.m.dims()[0];
        if state.m.len() != len || state.v.len() != len || state.steps.len() != self.steps.len() {
            return Err(crate::DeepSpeedError::Checkpoint(format!(
                "the optimizer state holds {} elements in {} tensors; this rank's part is {} \
                 elements of {} tensors",
                state.m.len(),
                state.steps.len(),
                len,
                self.steps.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use burn_deepspeed_cubecl_kernels::adam::AdamParams;
    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};
    use burn_deepspeed_strategies::swap::{AioOptions, IoEngine, SwapOptions, SwapStore, TilePlan};

    use super::*;

    #[test]
    fn an_offloaded_slice_is_saved_tile_by_tile_as_the_same_bytes() {
        let sizes = [700usize, 3, 1300];
        let numel: usize = sizes.iter().sum();
        let kind = PartitionedKind::Adam(AdamParams {
            lr: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
            bias_correction: true,
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let comm = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("world");
        let comm: Arc<dyn Communicator> = Arc::new(comm.communicators().remove(0));
        let part = FlatPartition::new(numel, 2);
        let place = HostPlace::new(comm.clone());
        let mut ram = HostFlatOptimizer::new(kind, &part, 1, &sizes, comm.clone());
        let mut disk = HostFlatOptimizer::new(kind, &part, 1, &sizes, comm);
        let own = ram.inner.own();
        let init: Vec<f32> = (0..own.len()).map(|i| (i % 13) as f32 / 7.0).collect();
        let plan = TilePlan::new(own.len(), 128, 3);
        let options = SwapOptions {
            aio: AioOptions::default(),
            engine: IoEngine::select().expect("an I/O engine"),
            pipeline_read: true,
            pipeline_write: true,
        };
        let swap = SwapStore::create(&dir.path().join("s.swp"), plan, options);
        disk.inner
            .offload(swap.expect("swap"), &init)
            .expect("offload");
        let (mut p_ram, mut p_disk) = (init.clone(), init);
        let grads: Vec<f32> = (0..own.len()).map(|i| (i % 5) as f32 - 2.0).collect();
        for _ in 0..2 {
            ram.step(&place, &mut p_ram, &grads, &[1, 1, 1], 0.01)
                .expect("step");
            disk.step(&place, &mut p_disk, &grads, &[1, 1, 1], 0.01)
                .expect("step");
        }
        let expected = partition_state_bytes(&ram.export(&place).expect("export"));
        for optim in [&ram, &disk] {
            let file = optim.export_file(&place).expect("export");
            assert_eq!(file.bytes, expected.len() as u64);
            assert!(file.into_bytes().expect("bytes") == expected);
        }
    }
}
