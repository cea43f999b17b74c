//! The flops profiler at `flops_profiler.profile_step`, from the engine (DeepSpeed's
//! `flops_profiler` section).

use burn::module::Module;
use burn::tensor::Device;
use burn::train::TrainStep;

use super::base::*;
use crate::profiler::{ProfileOptions, StepFigures, get_model_profile};
use crate::step::{StepLoss, StepReport};

impl<M> DeepSpeedEngine<M>
where
    M: Module + TrainStep,
    M::Output: StepLoss,
{
    /// The forward the flops profiler runs (`flops_profiler.enabled`): given the model and a
    /// device, build one micro-batch's input there and run the forward (DeepSpeed's profiler
    /// hooks the engine's own forward; Burn's `TrainStep` runs forward and backward in one
    /// call, so the engine asks for the forward alone). See
    /// [`get_model_profile`](crate::profiler::get_model_profile).
    pub fn set_profile_forward(&mut self, forward: impl Fn(&M, &Device) + Send + 'static) {
        self.profile_forward = Some(Box::new(forward));
    }

    /// `flops_profiler`: at `profile_step`, global rank 0 profiles the model's forward and
    /// prints it (or writes `output_file`) with the step's measured times. A profile that
    /// cannot be made is reported and training goes on: it changes nothing other ranks see.
    pub(super) fn profile_at_step(&mut self, report: &StepReport) {
        let section = &self.config.flops_profiler;
        if !section.enabled || report.step != section.profile_step || self.grid.world().rank() != 0
        {
            return;
        }
        let Some(forward) = &self.profile_forward else {
            eprintln!(
                "flops profiler: step {}: no forward to profile; call \
                 `DeepSpeedEngine::set_profile_forward` with one micro-batch's forward",
                report.step
            );
            return;
        };
        let options = ProfileOptions::from(section);
        let profile = get_model_profile(&self.model, |m, d| forward(m, d), &options).map(|p| {
            p.with_step(StepFigures {
                fwd: report.forward,
                bwd: report.backward,
                step: report.step_time,
                samples: self.batch.train_batch_size,
                micro_batches: self.batch.gradient_accumulation_steps,
            })
        });
        let text = match profile {
            Ok(p) => p.report(),
            Err(e) => {
                eprintln!("flops profiler: step {}: {e}", report.step);
                return;
            }
        };
        match &section.output_file {
            Some(path) => {
                if let Err(e) = std::fs::write(path, &text) {
                    eprintln!("flops profiler: cannot write {path}: {e}");
                }
            }
            None => print!("{text}"),
        }
    }
}
