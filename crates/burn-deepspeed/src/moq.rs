//! MoQ (Mixture-of-Quantization) in training: after each optimizer step, the model's weight
//! matrices are replaced by their quantized values at the precision of DeepSpeed's schedule
//! ([`burn_deepspeed_compress::moq`]), configured by `quantize_training` or
//! `compression_training.weight_quantization`.
//!
//! As in DeepSpeed, what is quantized is the weights the model computes with: at ZeRO stage 0
//! the parameters the optimizer steps (so the update continues from the quantized values),
//! at stages 1 and 2 the working copy written from the fp32 master partitions (the masters
//! stay exact, as DeepSpeed's fp16 and ZeRO paths do). Only parameters of two or more
//! dimensions are quantized; a parameter is in the first group whose module patterns match
//! its path (substring match, `*` for all; DeepSpeed matches regular expressions).
//! Overflowed steps do not count.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use burn_deepspeed_compress::moq::{FakeQuantizer, MixedRatio, MoqState};

pub use burn_deepspeed_compress::moq::{MoqSchedule, fake_quantize};

use crate::config::{MoqSettings, QuantizationType, Rounding};
use crate::flat::param_entries;
use crate::inference::{Sampler, Sampling};
use crate::{DeepSpeedError, Result};

/// One quantized parameter and where it stands in its group's schedule.
#[derive(Debug, Clone)]
struct Weight {
    path: String,
    group: usize,
    state: MoqState,
}

/// MoQ's state in an engine: the weights it quantizes, their schedules, the step count.
#[derive(Debug, Clone)]
pub struct Moq {
    settings: MoqSettings,
    weights: HashMap<ParamId, Weight>,
    /// Quantizing steps taken (DeepSpeed's `qsteps`).
    qsteps: u64,
    mixed: Option<MixedRatio>,
}

impl Moq {
    /// MoQ for `model` under `settings`: every float parameter of two or more dimensions whose
    /// path a group names.
    ///
    /// # Errors
    /// When a weight's values do not split into `quantize_groups` equal groups (naming it),
    /// or no weight matches any group.
    pub fn new<M: Module>(model: &M, settings: MoqSettings) -> Result<Self> {
        let mut weights = HashMap::new();
        let matrices = param_entries(model)
            .into_iter()
            .filter(|(.., dims)| dims.len() >= 2);
        for (id, path, dims) in matrices {
            let Some(group) = settings.groups.iter().position(|g| {
                g.modules
                    .iter()
                    .any(|m| m == "*" || path.contains(m.as_str()))
            }) else {
                continue;
            };
            let numel: usize = dims.iter().product();
            if !numel.is_multiple_of(settings.quantize_groups) {
                return Err(DeepSpeedError::InvalidValue {
                    path: "quantize_groups".into(),
                    message: format!(
                        "{path} {dims:?} has {numel} values, which do not split into {} equal \
                         groups",
                        settings.quantize_groups
                    ),
                });
            }
            let g = &settings.groups[group];
            let schedule = MoqSchedule {
                start_bits: g.start_bits as u32,
                target_bits: g.target_bits as u32,
                period: g.period,
            };
            let state = schedule.start();
            weights.insert(id, Weight { path, group, state });
        }
        if weights.is_empty() {
            let patterns: Vec<&str> = settings
                .groups
                .iter()
                .flat_map(|g| g.modules.iter().map(String::as_str))
                .collect();
            return Err(DeepSpeedError::InvalidValue {
                path: "weight_quantization.different_groups".into(),
                message: format!(
                    "no weight matrix of the model matches the module patterns {patterns:?}"
                ),
            });
        }
        let mixed = settings
            .mixed_change_ratio
            .map(|r| MixedRatio::new(r as f32));
        Ok(Self {
            settings,
            weights,
            qsteps: 0,
            mixed,
        })
    }

    /// Quantizes `model`'s weights after optimizer step `step` (1-based; the steps taken,
    /// skipped ones excluded), when the schedule has started (`step > schedule_offset`):
    /// one quantizing step, at each weight's bits after any drop this step brings.
    pub fn after_step<M: Module>(&mut self, model: M, step: u64) -> M {
        if step <= self.settings.schedule_offset {
            return model;
        }
        self.qsteps += 1;
        if let Some(mixed) = &mut self.mixed {
            mixed.step();
        }
        let mut mapper = Quantize { moq: self };
        model.map(&mut mapper)
    }

    /// The lowest bits any weight is at (its start bits before the first quantizing step).
    pub fn bits(&self) -> u32 {
        self.weights
            .values()
            .map(|w| w.state.bits)
            .min()
            .unwrap_or(0)
    }

    /// Quantizing steps taken.
    pub fn qsteps(&self) -> u64 {
        self.qsteps
    }

    /// The paths of the weights it quantizes, sorted.
    pub fn paths(&self) -> Vec<String> {
        let mut paths: Vec<String> = self.weights.values().map(|w| w.path.clone()).collect();
        paths.sort();
        paths
    }

    /// One weight's new values (its schedule advanced by this quantizing step).
    fn quantize(&mut self, id: ParamId, values: &mut [f32]) {
        let qstep = self.qsteps;
        let Some(weight) = self.weights.get_mut(&id) else {
            return;
        };
        let before = weight.state.bits;
        let bits = weight.state.advance(qstep);
        if bits != before {
            if let Some(mixed) = &mut self.mixed {
                mixed.ratio = 1.0;
            }
            if self.settings.verbose {
                tracing::info!(
                    weight = %weight.path,
                    bits,
                    qstep,
                    next_drop = weight.state.period,
                    group = %self.settings.groups[weight.group].name,
                    "MoQ: one bit less"
                );
            }
        }
        let how = FakeQuantizer {
            symmetric: self.settings.quantization_type == QuantizationType::Symmetric,
            groups: self.settings.quantize_groups,
        };
        let original = self.mixed.map(|_| values.to_vec());
        match self.settings.rounding {
            Rounding::Nearest => fake_quantize(values, bits, how, None),
            Rounding::Stochastic => {
                // The same draws on every replica: seeded by the step and the weight.
                let seed = qstep.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id.val();
                let mut sampler = Sampler::new(Sampling::Random {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    seed,
                });
                let mut draw = || sampler.uniform() as f32 - 0.5;
                fake_quantize(values, bits, how, Some(&mut draw));
            }
        }
        if let (Some(mixed), Some(original)) = (self.mixed, original) {
            mixed.blend(&original, values);
        }
    }
}

struct Quantize<'a> {
    moq: &'a mut Moq,
}

impl ModuleMapper for Quantize<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if D < 2 || !self.moq.weights.contains_key(&param.id) {
            return param;
        }
        let id = param.id;
        param.map(|t| {
            let (device, dtype, grad) = (t.device(), t.dtype(), t.is_require_grad());
            let shape = t.dims();
            let mut values = t
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("converted to f32");
            self.moq.quantize(id, &mut values);
            let t = Tensor::<D>::from_data(TensorData::new(values, shape), &device).cast(dtype);
            if grad { t.require_grad() } else { t }
        })
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    use super::*;
    use crate::config::MoqGroupSettings;

    fn settings(start: u64, target: u64, period: u64, offset: u64) -> MoqSettings {
        MoqSettings {
            groups: vec![MoqGroupSettings {
                name: "all".into(),
                modules: vec!["*".into()],
                start_bits: start,
                target_bits: target,
                period,
            }],
            schedule_offset: offset,
            quantize_groups: 2,
            quantization_type: QuantizationType::Symmetric,
            rounding: Rounding::Nearest,
            mixed_change_ratio: None,
            verbose: false,
        }
    }

    fn values(t: Tensor<2>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().expect("f32")
    }

    /// The weight (not the bias) lands on the grid of its step's bits, from the step after
    /// the offset; the bits follow the schedule.
    #[test]
    fn weights_land_on_the_schedules_grid() {
        let device = Device::flex();
        let mut layer: Linear = LinearConfig::new(4, 6).init(&device);
        let bias = layer.bias.as_ref().map(|b| b.val().into_data());
        let mut moq = Moq::new(&layer, settings(8, 3, 2, 1)).expect("a weight");
        assert_eq!(moq.paths(), ["weight"]);
        let before = values(layer.weight.val());
        layer = moq.after_step(layer, 1);
        assert_eq!(
            values(layer.weight.val()),
            before,
            "the offset's step is left alone"
        );
        // Quantizing steps 1..: bits 8, 7 (step 2), 7, 6 (step 4), 6, 6, 6, 5 (step 8).
        let mut bits = Vec::new();
        for step in 2..=9 {
            let mut want = values(layer.weight.val());
            layer = moq.after_step(layer, step);
            bits.push(moq.bits());
            let how = FakeQuantizer {
                symmetric: true,
                groups: 2,
            };
            fake_quantize(&mut want, moq.bits(), how, None);
            assert_eq!(
                values(layer.weight.val()),
                want,
                "on the grid at step {step}"
            );
        }
        assert_eq!(bits, [8, 7, 7, 6, 6, 6, 6, 5]);
        assert_eq!(moq.qsteps(), 8);
        let bias_after = layer.bias.as_ref().map(|b| b.val().into_data());
        assert_eq!(bias, bias_after, "one-dimensional parameters stay");
    }

    #[test]
    fn groups_that_do_not_divide_a_weight_are_refused() {
        let layer: Linear = LinearConfig::new(3, 3).init(&Device::flex());
        let e = Moq::new(&layer, settings(8, 8, 1, 0)).expect_err("9 values in 2 groups");
        assert!(e.to_string().contains("weight [3, 3]"), "{e}");
        let mut s = settings(8, 8, 1, 0);
        s.groups[0].modules = vec!["attention".into()];
        s.quantize_groups = 1;
        let e = Moq::new(&layer, s).expect_err("no match");
        assert!(e.to_string().contains("attention"), "{e}");
    }
}
