//! Slicing a user's own model (not the GPT): an MLP written with the sliced layers, whole at
//! tp = 1 and cut by `slice` over a grid's tensor-parallel group, trained by
//! `DeepSpeedEngine::with_grid`; the sliced runs follow the whole one.

use std::time::Duration;

use burn::module::Module;
use burn::nn::LinearConfig;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::{InferenceStep, RegressionOutput, TrainOutput, TrainStep};
use burn_deepspeed::grid::Grid;
use burn_deepspeed::launch::launch;
use burn_deepspeed::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};

// ANCHOR: user_model
/// A user's MLP, written with the sliced layers: whole while its group is
/// `TensorParallel::none()`, every op then Burn's own.
#[derive(Module, Debug)]
pub struct Mlp {
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

impl Mlp {
    /// The whole model (the same on every rank: seed Burn's RNG, or initialise from data).
    pub fn new(d: usize, hidden: usize, device: &Device) -> burn_deepspeed::Result<Self> {
        let none = TensorParallel::none();
        let (up, down) = (LinearConfig::new(d, hidden), LinearConfig::new(hidden, d));
        Ok(Self {
            up: ColumnParallelLinear::from_linear(&up.init(device), none.clone())?,
            down: RowParallelLinear::from_linear(&down.init(device), none)?,
        })
    }

    /// This rank's slice: the hidden features cut across `tp` (one all-reduce forward, one
    /// backward). An error when `tp` does not divide the hidden features.
    pub fn sliced(&self, tp: &TensorParallel) -> burn_deepspeed::Result<Self> {
        Ok(Self {
            up: self.up.slice(tp.clone())?,
            down: self.down.slice(tp.clone())?,
        })
    }

    /// The MLP on rows `x`, whole on every rank.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.down.forward(gelu(self.up.forward(x)))
    }
}

impl TrainStep for Mlp {
    type Input = (Tensor<2>, Tensor<2>);
    type Output = RegressionOutput;

    fn step(&self, (x, y): (Tensor<2>, Tensor<2>)) -> TrainOutput<RegressionOutput> {
        let output = self.forward(x);
        let loss = (output.clone() - y.clone()).powi_scalar(2).mean();
        let grads = loss.backward();
        let item = RegressionOutput {
            loss,
            output,
            targets: y,
        };
        TrainOutput::new(self, grads, item)
    }
}
// ANCHOR_END: user_model

impl InferenceStep for Mlp {
    type Input = (Tensor<2>, Tensor<2>);
    type Output = RegressionOutput;

    fn step(&self, (x, y): (Tensor<2>, Tensor<2>)) -> RegressionOutput {
        let output = self.forward(x);
        let loss = (output.clone() - y.clone()).powi_scalar(2).mean();
        RegressionOutput {
            loss,
            output,
            targets: y,
        }
    }
}

const D: usize = 6;
const HIDDEN: usize = 12;
const ROWS: usize = 8;

/// Rows `first..first + n` of a fixed regression problem.
fn rows(first: usize, n: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..n * D)
        .map(|i| (((first * D + i) * 37 % 23) as f32 - 11.0) / 11.0)
        .collect();
    let y: Vec<f32> = x.iter().map(|v| (v * 3.0).sin()).collect();
    let t = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [n, D]), device);
    (t(x), t(y))
}

/// Trains the MLP from the values `whole` on `world` thread ranks with `tp` slices for
/// `steps` steps; returns the losses and the whole parameters after the run (rank 0's).
fn train(
    whole: &burn::store::ModuleRecord,
    world: usize,
    tp: usize,
    stage: u8,
    steps: u64,
) -> (Vec<f64>, Vec<f32>) {
    let text = format!(
        r#"{{"train_batch_size": {ROWS}, "gradient_clipping": 0.5,
            "optimizer": {{"type": "Adam", "params": {{"lr": 1e-2}}}},
            "tensor_parallel": {{"tp_size": {tp}}}, "zero_optimization": {{"stage": {stage}}}}}"#
    );
    let config = DeepSpeedConfig::from_json_str(&text).expect("valid").0;
    let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        // ANCHOR: user_engine
        let grid = Grid::from_config(&config, comm, &device)?;
        let model = Mlp::new(D, HIDDEN, &device)?
            .load_record(whole.clone())
            .sliced(grid.tensor_parallel())?;
        let mut engine = DeepSpeedEngine::with_grid(model, config.clone(), &grid)?;
        // ANCHOR_END: user_engine
        let (dp, replica) = (grid.topology().data, grid.coord().data);
        let micro = ROWS / dp;
        let mut losses = Vec::new();
        for step in 0..steps as usize {
            let batch = rows(step * ROWS + replica * micro, micro, &device);
            losses.push(engine.train_batch([batch])?.loss);
        }
        Ok((losses, engine.flat_params()?))
    })
    .expect("the ranks run");
    ranks.into_iter().next().expect("rank 0")
}

#[test]
fn a_users_mlp_sliced_over_2_ranks_follows_the_whole_one() {
    // One whole model's values, made once, for every rank of every run.
    let whole = Mlp::new(D, HIDDEN, &Device::flex())
        .expect("the whole model")
        .into_record();
    let (losses, params) = train(&whole, 1, 1, 0, 12);
    assert!(losses[11] < losses[0], "it learns: {losses:?}");
    for (world, tp, stage) in [(2, 2, 0), (4, 2, 1), (4, 4, 0)] {
        let (l, p) = train(&whole, world, tp, stage, 12);
        let dl = l
            .iter()
            .zip(&losses)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        let dp = p
            .iter()
            .zip(&params)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        println!("world {world} tp {tp} stage {stage}: loss {dl:.2e}, params {dp:.2e}");
        assert!(dl <= 1e-5 && dp <= 1e-5, "world {world} tp {tp}: {dl} {dp}");
    }
}
