//! Knowledge distillation, and DeepSpeed-MoE's Mixture-of-Students (MoS, arXiv 2201.05596
//! §5): a shallower student (an MoE model with fewer layers) learns from the labels and from
//! a trained teacher's softened next-token distributions, with the teacher's term switched
//! off partway through training ("staged KD": the paper finds that a student which keeps
//! imitating a teacher larger than itself ends worse than one that stops).
//!
//! The loss of a step with the teacher on is Hinton et al.'s (arXiv 1503.02531):
//! `alpha_ce · CE(student, labels) + beta_kd · T² · KL(softmax(teacher/T) ‖ softmax(student/T))`,
//! the KL averaged over tokens. The teacher runs in evaluation mode beside the engine, never
//! inside it: its parameters are not trained, partitioned or checkpointed, and its logits
//! reach the loss as constants (see the GPT example's `--teacher`).

use burn::config::Config;
use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, Tensor};

use crate::DeepSpeedError;

/// How a student learns from its teacher: the weights of the two terms, the temperature and
/// the step where the teacher's term stops.
#[derive(Config, Debug, PartialEq)]
pub struct DistillationConfig {
    /// Weight of the cross-entropy with the labels.
    #[config(default = 1.0)]
    pub alpha_ce: f64,
    /// Weight of the teacher's term.
    #[config(default = 1.0)]
    pub beta_kd: f64,
    /// Temperature of both softmaxes (the KL is multiplied by its square, so that the
    /// gradient's scale does not depend on it).
    #[config(default = 1.0)]
    pub temperature: f64,
    /// Staged KD: the teacher's term is dropped from this optimizer step on, and the loss is
    /// the cross-entropy alone. `None`: the teacher teaches to the end.
    #[config(default = "None")]
    pub stop_step: Option<u64>,
}

impl DistillationConfig {
    /// Refuses weights below 0 and a temperature that is not positive, by name.
    pub fn validate(&self) -> crate::Result<()> {
        let refuse = |key: &str, value: f64, want: &str| {
            Err(DeepSpeedError::Unsupported {
                key: format!("distillation.{key}"),
                reason: format!("{value} must be {want}"),
            })
        };
        if !(self.alpha_ce >= 0.0 && self.alpha_ce.is_finite()) {
            return refuse("alpha_ce", self.alpha_ce, "finite and at least 0");
        }
        if !(self.beta_kd >= 0.0 && self.beta_kd.is_finite()) {
            return refuse("beta_kd", self.beta_kd, "finite and at least 0");
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return refuse("temperature", self.temperature, "finite and above 0");
        }
        Ok(())
    }

    /// Whether optimizer step `step` (0-based) learns from the teacher.
    pub fn teaches_at(&self, step: u64) -> bool {
        self.stop_step.is_none_or(|stop| step < stop)
    }

    /// The loss of a step: `ce` alone when the teacher is off, else both terms weighted.
    pub fn loss(&self, ce: Tensor<1>, kd: Option<Tensor<1>>) -> Tensor<1> {
        match kd {
            Some(kd) => {
                let dtype = ce.dtype();
                ce.mul_scalar(self.alpha_ce) + kd.cast(dtype).mul_scalar(self.beta_kd)
            }
            None => ce,
        }
    }
}

/// `T² · KL(softmax(teacher/T) ‖ softmax(student/T))` averaged over the rows of the
/// `[rows, vocab]` logits (computed in f32; the teacher's logits are constants). Its
/// gradient with respect to the student's logits is `T · (q − p) / rows`.
pub fn distillation_loss(student: Tensor<2>, teacher: Tensor<2>, temperature: f64) -> Tensor<1> {
    let [rows, _] = student.dims();
    let inv = 1.0 / temperature;
    let log_q = log_softmax(student.cast(FloatDType::F32).mul_scalar(inv), 1);
    let log_p = log_softmax(teacher.cast(FloatDType::F32).mul_scalar(inv), 1);
    let p = log_p.clone().exp();
    (p * (log_p - log_q))
        .sum()
        .mul_scalar(temperature * temperature / rows.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    fn logits(values: &[f32], device: &Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values.to_vec(), [2, 3]), device)
    }

    /// Hand-computed KL of two rows at T = 2, with its gradient `T · (q − p) / rows`; zero
    /// when the student says what the teacher says.
    #[test]
    fn the_loss_is_the_tempered_kl_and_its_gradient() {
        let device = Device::flex().autodiff();
        let (s, t) = (
            [1.0f32, 2.0, 0.5, -1.0, 0.0, 3.0],
            [0.0f32, 1.0, 2.0, 1.0, 1.0, 1.0],
        );
        let temp = 2.0;
        let softmax = |x: &[f32]| -> Vec<f64> {
            let e: Vec<f64> = x.iter().map(|v| (f64::from(*v) / temp).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|v| v / z).collect()
        };
        let mut want = 0.0;
        let mut grad = Vec::new();
        for r in 0..2 {
            let (q, p) = (softmax(&s[3 * r..3 * r + 3]), softmax(&t[3 * r..3 * r + 3]));
            want += p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum::<f64>();
            grad.extend(q.iter().zip(&p).map(|(q, p)| temp * (q - p) / 2.0));
        }
        want *= temp * temp / 2.0;
        let student = logits(&s, &device).require_grad();
        let loss = distillation_loss(student.clone(), logits(&t, &device), temp);
        let got = f64::from(loss.clone().into_scalar::<f32>());
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        let grads = loss.backward();
        let g = student.grad(&grads).expect("a gradient");
        let g: Vec<f32> = g.into_data().try_to_vec::<f32>().expect("f32");
        for (a, b) in g.iter().zip(&grad) {
            assert!((f64::from(*a) - b).abs() < 1e-6, "{g:?} vs {grad:?}");
        }
        let same = distillation_loss(logits(&t, &device), logits(&t, &device), temp);
        assert!(same.into_scalar::<f32>().abs() < 1e-7);
    }

    /// The teacher's term stops at `stop_step`; bad weights and temperatures are refused by
    /// key.
    #[test]
    fn staged_kd_stops_and_bad_settings_are_refused() {
        let config = DistillationConfig::new().with_stop_step(Some(3));
        assert!(config.teaches_at(2) && !config.teaches_at(3));
        assert!(DistillationConfig::new().teaches_at(u64::MAX));
        let err = DistillationConfig::new()
            .with_temperature(0.0)
            .validate()
            .unwrap_err();
        assert!(
            err.to_string().contains("distillation.temperature"),
            "{err}"
        );
        let err = DistillationConfig::new()
            .with_beta_kd(-1.0)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("distillation.beta_kd"), "{err}");
        let device = Device::flex();
        let one = |v: f32| Tensor::<1>::from_data(TensorData::new(vec![v], [1]), &device);
        let loss = DistillationConfig::new()
            .with_alpha_ce(0.5)
            .with_beta_kd(2.0)
            .loss(one(4.0), Some(one(1.0)));
        assert_eq!(loss.into_scalar::<f32>(), 4.0);
    }
}
