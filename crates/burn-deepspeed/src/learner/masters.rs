//! The fp32 masters of the Learner strategy, kept apart from the `Learner`'s model in 16-bit
//! and when the optimizer is offloaded to host memory, and the step that updates them.

use burn::tensor::{Device, FloatDType};
use burn::train::LearnerModel;

use super::base::RankRun;
use crate::config::OffloadDevice;
use crate::precision::cast_module;
use crate::sync::GradSync;

/// The fp32 masters the Learner's optimizer steps when they are not the Learner's model
/// itself (a whole module on every rank: Burn's optimizer steps a whole module). Two reasons
/// keep them apart, alone or together:
/// - 16-bit: the Learner computes with their working copy in `dtype`;
/// - optimizer offload to host memory (ZeRO-Offload, arXiv 2101.06840): the masters and the
///   optimizer's state live on `home`, the host, where the optimizer steps them; the device
///   keeps the working copy and the gradients. Burn's optimizers step on the device of the
///   gradients they are given, and keep each parameter's state there.
pub(super) struct Masters<M> {
    /// The working copy's dtype (f32 when the masters are apart only for offload).
    pub(super) dtype: FloatDType,
    /// Host memory, when the optimizer is offloaded from another device.
    pub(super) home: Option<Device>,
    /// The device the Learner's model computes on.
    pub(super) working: Device,
    pub(super) masters: M,
}

/// Where an offloaded optimizer steps when the model computes on `device`: the host (Flex),
/// or `None` when `device` keeps its tensors in host memory already.
pub(super) fn offload_home(device: &Device) -> Option<Device> {
    let host = Device::flex();
    (device.clone().inner() != host).then_some(host)
}

impl<M: LearnerModel> RankRun<'_, M> {
    /// In 16-bit or with the optimizer offloaded: keeps the (broadcast) f32 model as fp32
    /// masters (at stage 3 this rank's chunks), in host memory when offloaded, and hands the
    /// Learner their working copy; `None` otherwise.
    pub(super) fn separate_masters(
        &mut self,
        sync: &mut dyn GradSync<M>,
    ) -> crate::Result<Option<Masters<M>>> {
        let config = &self.settings.config;
        let masters = self.learner.model();
        let working = masters.devices().into_iter().next().unwrap_or_default();
        let offload = config.zero_optimization.optimizer_offload() == OffloadDevice::Cpu;
        let home = offload.then(|| offload_home(&working)).flatten();
        let dtype = match (config.working_dtype(), &home) {
            (None, None) => return Ok(None),
            (dtype, _) => dtype.unwrap_or(FloatDType::F32),
        };
        let copy = cast_module(masters.clone(), dtype);
        sync.track_working_copy(&copy, dtype);
        self.learner.load_model(copy.into_record());
        let masters = match &home {
            Some(host) => masters.fork(host),
            None => masters,
        };
        Ok(Some(Masters {
            dtype,
            home,
            working,
            masters,
        }))
    }

    /// The optimizer step of separate masters: the regime's reduced gradients step the fp32
    /// masters with the Learner's optimizer, and the Learner holds their working copy again.
    pub(super) fn step_masters(
        &mut self,
        sync: &mut dyn GradSync<M>,
        mixed: &mut Masters<M>,
    ) -> crate::Result<()> {
        // Separate masters: the Learner's optimizer steps the fp32 masters (its state is
        // created for them, in f32), then holds their working copy again. Offloaded, the
        // Learner's model moves to host memory for the step (a `Learner` takes a new model
        // only as a record loaded where its model is) and the gradients with it, and the
        // working copy goes back to the device after.
        let mut grads = sync.reduced_gradients(&mixed.masters)?;
        if let Some(host) = &mixed.home {
            self.learner.fork(host);
            grads = grads.to_device(host, &mixed.masters);
        }
        self.learner.load_model(mixed.masters.clone().into_record());
        self.learner.lr_step();
        self.learner.optimizer_step(grads);
        let mut masters = self.learner.model();
        if let Some(updated) = sync.finish_external_step(&masters)? {
            masters = updated;
        }
        self.learner
            .load_model(cast_module(masters.clone(), mixed.dtype).into_record());
        if mixed.home.is_some() {
            self.learner.fork(&mixed.working);
        }
        sync.track_working_copy(&self.learner.model(), mixed.dtype);
        mixed.masters = masters;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An offloaded optimizer moves to the host from a device, and stays where it is on one
    /// that keeps its tensors in host memory.
    #[test]
    fn an_offloaded_optimizer_steps_in_host_memory() {
        assert_eq!(offload_home(&Device::flex()), None);
        assert_eq!(offload_home(&Device::flex().autodiff()), None);
        #[cfg(feature = "wgpu")]
        {
            let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
            assert_eq!(offload_home(&wgpu.clone().autodiff()), Some(Device::flex()));
            assert_eq!(offload_home(&wgpu), Some(Device::flex()));
        }
    }
}
