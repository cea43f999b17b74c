//! Integration tests live in `tests/tests/`. This library holds what several of them share: a
//! small regression model whose batches a test can poison with NaN or inf, and the configs and
//! comparisons of the offload tests.

pub mod cgroup;
pub mod fuzz;
pub mod offload;

use burn::module::{Module, Param};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use burn::train::{RegressionOutput, TrainOutput, TrainStep};

/// Inputs per sample of [`Toy`].
pub const TOY_IN: usize = 8;

/// A two-layer regression network, small enough to train on many ranks in a unit test.
#[derive(Module, Debug)]
pub struct Toy {
    /// Hidden layer.
    pub hidden: Linear,
    /// Output layer.
    pub out: Linear,
}

/// One micro-batch of [`Toy`]: inputs `[rows, TOY_IN]` and targets `[rows, 1]`.
#[derive(Debug, Clone)]
pub struct ToyBatch {
    /// Inputs.
    pub inputs: Tensor<2>,
    /// Targets.
    pub targets: Tensor<2>,
}

impl Toy {
    /// The network with weights drawn from `seed` (the same on every call).
    pub fn new(seed: u64, device: &Device) -> Self {
        Self {
            hidden: linear(TOY_IN, 16, seed, device),
            out: linear(16, 1, seed ^ 1, device),
        }
    }

    /// Predictions `[rows, 1]`, in the parameters' dtype (the inputs are cast to it, so a
    /// 16-bit working copy runs too).
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = x.cast(self.hidden.weight.val().dtype());
        self.out.forward(relu(self.hidden.forward(x)))
    }
}

impl TrainStep for Toy {
    type Input = ToyBatch;
    type Output = RegressionOutput;

    fn step(&self, batch: ToyBatch) -> TrainOutput<RegressionOutput> {
        // The loss in f32, whatever the working dtype.
        let output = self.forward(batch.inputs).cast(FloatDType::F32);
        let loss = MseLoss::new().forward(output.clone(), batch.targets.clone(), Reduction::Mean);
        let grads = burn_deepspeed::precision::backward(&loss);
        TrainOutput::new(
            self,
            grads,
            RegressionOutput::new(loss, output, batch.targets),
        )
    }
}

fn linear(d_in: usize, d_out: usize, seed: u64, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(d_in, d_out).init(device);
    let mut draw = uniform(seed);
    let scale = 1.0 / (d_in as f32).sqrt();
    let weights: Vec<f32> = (0..d_in * d_out).map(|_| draw() * scale).collect();
    layer.weight = Param::from_tensor(Tensor::from_data(
        TensorData::new(weights, [d_in, d_out]),
        device,
    ));
    layer.bias = Some(Param::from_tensor(Tensor::zeros([d_out], device)));
    layer
}

/// SplitMix64 from `seed`: a reproducible stream of 64-bit draws.
pub fn splitmix(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Uniform draws in [-1, 1) from `seed`.
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut next = splitmix(seed);
    move || (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

/// Micro-batch `micro` of step `step` for rank `rank`: `rows` samples of a fixed linear target
/// with a little structure, the same on every call with the same arguments. With `poison`, the
/// first input is that value (NaN or inf), which makes the gradient non-finite.
pub fn toy_batch(
    step: u64,
    rank: usize,
    micro: u64,
    rows: usize,
    poison: Option<f32>,
    device: &Device,
) -> ToyBatch {
    let mut next = uniform((step << 32) ^ ((rank as u64) << 16) ^ micro);
    let mut inputs: Vec<f32> = (0..rows * TOY_IN).map(|_| next()).collect();
    let targets: Vec<f32> = inputs
        .chunks_exact(TOY_IN)
        .map(|x| {
            x.iter()
                .enumerate()
                .map(|(i, v)| v * (i as f32 - 3.5) / 4.0)
                .sum()
        })
        .collect();
    if let Some(v) = poison {
        inputs[0] = v;
    }
    ToyBatch {
        inputs: Tensor::from_data(TensorData::new(inputs, [rows, TOY_IN]), device),
        targets: Tensor::from_data(TensorData::new(targets, [rows, 1]), device),
    }
}

/// A GPT small enough for many runs in one test (d 32, 2 layers, 2 heads, context 16).
pub const GPT_MINI: burn_deepspeed_example_gpt::model::GptShape =
    burn_deepspeed_example_gpt::model::GptShape {
        d_model: 32,
        layers: 2,
        heads: 2,
        seq_len: 16,
        moe: None,
    };

/// The run the crash tests kill and resume: [`GPT_MINI`] on the embedded corpus at ZeRO `stage`,
/// 2 sequences per rank and step, `steps` steps.
pub fn crash_spec(stage: u8, steps: u64) -> burn_deepspeed_example_gpt::run::RunSpec {
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let (config, _) =
        burn_deepspeed::DeepSpeedConfig::from_json_str(&text).expect("a valid config");
    burn_deepspeed_example_gpt::run::RunSpec::on_embedded_corpus(config, GPT_MINI, steps, 4, 9)
}

/// The GPT example's loss on `sequences` held-out windows of the embedded corpus (seed 99).
pub fn gpt_eval_loss(
    model: &burn_deepspeed_example_gpt::model::Gpt,
    seq_len: usize,
    sequences: usize,
) -> f64 {
    use burn::train::InferenceStep;
    use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 99);
    let batch = corpus.batch(0, 0, sequences, seq_len, &Device::flex());
    let out = InferenceStep::step(model, batch);
    out.loss.into_scalar::<f32>() as f64
}
