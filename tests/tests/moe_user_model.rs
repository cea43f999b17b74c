//! An MoE layer in a user's own model (not the GPT): a regression model with a
//! `MoE<ExpertMlp>` between two linear layers, its experts split by
//! `MoE::expert_parallel` over a grid's expert-parallel group, trained by
//! `DeepSpeedEngine::with_grid`; ep 2 and 4 follow ep 1.

use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::{InferenceStep, RegressionOutput, TrainOutput, TrainStep};
use burn_deepspeed::grid::Grid;
use burn_deepspeed::launch::launch;
use burn_deepspeed::moe::{ExpertMlp, ExpertParallel, MoE, MoeConfig};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};

// ANCHOR: user_model
/// A user's model with a Mixture-of-Experts layer in the middle.
#[derive(Module, Debug)]
pub struct Net {
    embed: Linear,
    moe: MoE<ExpertMlp>,
    out: Linear,
}

impl Net {
    /// The whole model: every expert (the same on every rank: seed Burn's RNG, or load a
    /// record).
    pub fn new(d: usize, experts: usize, device: &Device) -> burn_deepspeed::Result<Self> {
        let config = MoeConfig::new(d, experts).with_k(2).with_min_capacity(2);
        let mlps = (0..experts)
            .map(|_| ExpertMlp::new(d, 2 * d, device))
            .collect();
        Ok(Self {
            embed: LinearConfig::new(d, d).init(device),
            moe: config.init(mlps, None, device)?,
            out: LinearConfig::new(d, d).init(device),
        })
    }

    /// This rank's part: its experts of the group (each rank seeds its own draws).
    pub fn expert_parallel(
        mut self,
        ep: &ExpertParallel,
        seed: u64,
    ) -> burn_deepspeed::Result<Self> {
        self.moe = self.moe.expert_parallel(ep)?.with_seed(seed);
        Ok(self)
    }

    /// The output and the MoE layer's load-balancing loss.
    pub fn forward(&self, x: Tensor<3>) -> (Tensor<3>, Tensor<1>) {
        let moe = self.moe.forward(self.embed.forward(x));
        (self.out.forward(moe.output), moe.l_aux)
    }
}

impl TrainStep for Net {
    type Input = (Tensor<3>, Tensor<3>);
    type Output = RegressionOutput;

    fn step(&self, (x, y): (Tensor<3>, Tensor<3>)) -> TrainOutput<RegressionOutput> {
        let (output, l_aux) = self.forward(x);
        let mse = (output.clone() - y.clone()).powi_scalar(2).mean();
        // DeepSpeed-MoE adds the load-balancing loss with a small coefficient.
        let loss = mse + l_aux.mul_scalar(0.01);
        let grads = loss.backward();
        let [b, t, d] = output.dims();
        let item = RegressionOutput {
            loss,
            output: output.reshape([b * t, d]),
            targets: y.reshape([b * t, d]),
        };
        TrainOutput::new(self, grads, item)
    }
}
// ANCHOR_END: user_model

impl InferenceStep for Net {
    type Input = (Tensor<3>, Tensor<3>);
    type Output = RegressionOutput;

    fn step(&self, (x, y): (Tensor<3>, Tensor<3>)) -> RegressionOutput {
        let (output, _) = self.forward(x);
        let loss = (output.clone() - y.clone()).powi_scalar(2).mean();
        let [b, t, d] = output.dims();
        RegressionOutput {
            loss,
            output: output.reshape([b * t, d]),
            targets: y.reshape([b * t, d]),
        }
    }
}

const D: usize = 8;
const EXPERTS: usize = 4;
const SEQ: usize = 6;
const ROWS: usize = 8;

/// Sequences `first..first + n` of a fixed regression problem.
fn batch(first: usize, n: usize, device: &Device) -> (Tensor<3>, Tensor<3>) {
    let x: Vec<f32> = (0..n * SEQ * D)
        .map(|i| (((first * SEQ * D + i) * 37 % 23) as f32 - 11.0) / 11.0)
        .collect();
    let y: Vec<f32> = x.iter().map(|v| (v * 3.0).sin()).collect();
    let t = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [n, SEQ, D]), device);
    (t(x), t(y))
}

/// Trains the net from `whole` on 4 thread ranks with `ep_size` for `steps` steps; returns
/// rank 0's losses.
fn train(whole: &burn::store::ModuleRecord, ep_size: usize, steps: u64) -> Vec<f64> {
    let text = format!(
        r#"{{"train_batch_size": {ROWS}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "Adam", "params": {{"lr": 1e-2}}}}}}"#
    );
    let config = DeepSpeedConfig::from_json_str(&text).expect("valid").0;
    let (_, ranks) = launch(4, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        // ANCHOR: user_engine
        let grid =
            Grid::from_config(&config, comm, &device)?.with_expert_parallel(ep_size, &device)?;
        let model = Net::new(D, EXPERTS, &device)?
            .load_record(whole.clone())
            .expert_parallel(grid.expert_parallel(), 100 + rank as u64)?;
        let mut engine = DeepSpeedEngine::with_grid(model, config.clone(), &grid)?;
        // ANCHOR_END: user_engine
        let micro = ROWS / 4;
        let mut losses = Vec::new();
        for step in 0..steps as usize {
            let data = batch(step * ROWS + rank * micro, micro, &device);
            losses.push(engine.train_batch([data])?.loss);
        }
        Ok(losses)
    })
    .expect("the ranks run");
    ranks.into_iter().next().expect("rank 0")
}

#[test]
fn a_users_moe_model_at_ep_2_and_4_follows_ep_1() {
    let whole = Net::new(D, EXPERTS, &Device::flex())
        .expect("a valid layer")
        .into_record();
    let losses = train(&whole, 1, 10);
    assert!(losses[9] < losses[0], "it learns: {losses:?}");
    for ep in [2, 4] {
        let cut = train(&whole, ep, 10);
        let diff = cut
            .iter()
            .zip(&losses)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        println!("ep {ep}: max rel loss diff {diff:.2e}");
        assert!(diff <= 1e-5, "ep {ep}: {cut:?} vs {losses:?}");
    }
}
