//! A classifier as Burn users write one: an MLP, a dataset of items, a batcher, and the
//! `TrainStep`/`InferenceStep` that Burn's `SupervisedTraining` calls. Nothing here knows about
//! burn-deepspeed; `main.rs` trains it with `DeepSpeedStrategy`.
//!
//! The data are the two interleaved half-moons of scikit-learn's `make_moons`, generated with a
//! fixed seed, so the example needs no download.

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

/// A point of the plane and its class (0: the upper moon, 1: the lower one).
#[derive(Debug, Clone, Copy)]
pub struct Point {
    /// The coordinates.
    pub xy: [f32; 2],
    /// The class.
    pub label: u8,
}

/// `n` points on two interleaved half-moons, with Gaussian-like noise of scale `noise`, in a
/// shuffled order fixed by `seed`.
pub fn two_moons(n: usize, noise: f32, seed: u64) -> Vec<Point> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        // xorshift64*: enough randomness for a toy dataset, and the same on every machine.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut points: Vec<Point> = (0..n)
        .map(|i| {
            let label = (i % 2) as u8;
            let t = std::f32::consts::PI * uniform();
            let (x, y) = if label == 0 {
                (t.cos(), t.sin())
            } else {
                (1.0 - t.cos(), 0.5 - t.sin())
            };
            // The sum of three uniforms, centred: a cheap bell-shaped noise.
            let mut bell = || (uniform() + uniform() + uniform() - 1.5) * noise;
            Point {
                xy: [x + bell(), y + bell()],
                label,
            }
        })
        .collect();
    for i in (1..points.len()).rev() {
        let j = (uniform() * (i + 1) as f32) as usize % (i + 1);
        points.swap(i, j);
    }
    points
}

/// A batch of points on a device.
#[derive(Debug, Clone)]
pub struct PointBatch {
    /// `[batch, 2]` coordinates.
    pub inputs: Tensor<2>,
    /// `[batch]` classes.
    pub targets: Tensor<1, Int>,
}

/// Stacks points into a [`PointBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PointBatcher;

impl Batcher<Point, PointBatch> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> PointBatch {
        let n = items.len();
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let labels: Vec<i64> = items.iter().map(|p| p.label as i64).collect();
        PointBatch {
            inputs: Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// A multi-layer perceptron: 2 inputs, two hidden layers, 2 classes.
#[derive(Module, Debug)]
pub struct Classifier {
    hidden1: Linear,
    hidden2: Linear,
    out: Linear,
    act: Relu,
}

impl Classifier {
    /// A classifier with `width` units per hidden layer, initialized on `device`.
    pub fn new(width: usize, device: &Device) -> Self {
        Self {
            hidden1: LinearConfig::new(2, width).init(device),
            hidden2: LinearConfig::new(width, width).init(device),
            out: LinearConfig::new(width, 2).init(device),
            act: Relu::new(),
        }
    }

    /// The logits of `inputs`.
    pub fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let x = self.act.forward(self.hidden1.forward(inputs));
        let x = self.act.forward(self.hidden2.forward(x));
        self.out.forward(x)
    }

    /// The cross-entropy loss of a batch, with its logits.
    pub fn forward_loss(&self, batch: PointBatch) -> ClassificationOutput {
        let logits = self.forward(batch.inputs);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl TrainStep for Classifier {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointBatch) -> TrainOutput<ClassificationOutput> {
        let out = self.forward_loss(batch);
        let grads = out.loss.backward();
        TrainOutput::new(self, grads, out)
    }
}

impl InferenceStep for Classifier {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointBatch) -> ClassificationOutput {
        self.forward_loss(batch)
    }
}

/// The mean loss and the accuracy of `model` over `points`, in one batch.
pub fn evaluate(model: &Classifier, points: &[Point], device: &Device) -> (f32, f32) {
    let batch = PointBatcher.batch(points.to_vec(), device);
    let targets = batch.targets.clone();
    let out = model.forward_loss(batch);
    let loss = out.loss.into_scalar::<f32>();
    let predicted = out.output.argmax(1).squeeze_dim::<1>(1);
    let correct = predicted.equal(targets).int().sum().into_scalar::<i64>();
    (loss, correct as f32 / points.len() as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_moons_are_balanced_and_fixed_by_the_seed() {
        let a = two_moons(200, 0.1, 7);
        let b = two_moons(200, 0.1, 7);
        assert_eq!(a.len(), 200);
        assert_eq!(a.iter().filter(|p| p.label == 1).count(), 100);
        assert!(
            a.iter()
                .zip(&b)
                .all(|(p, q)| p.xy == q.xy && p.label == q.label)
        );
        assert!(
            a.iter()
                .zip(&two_moons(200, 0.1, 8))
                .any(|(p, q)| p.xy != q.xy)
        );
    }
}
