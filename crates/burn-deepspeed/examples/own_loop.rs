//! Your own Burn model, trained with ZeRO stage 3 from your own loop: two ranks as threads
//! (`cargo run --example own_loop`), or one per process under `mpirun -n 2` (with `--features
//! mpi`). Each rank holds half of the parameters and of the Adam state.
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::{RegressionOutput, TrainOutput, TrainStep};
use burn_deepspeed::prelude::*;

// ANCHOR: model
/// Any Burn module that implements `TrainStep` trains as it is.
#[derive(Module, Debug)]
struct Mlp {
    up: Linear,
    act: Relu,
    down: Linear,
}

impl TrainStep for Mlp {
    type Input = (Tensor<2>, Tensor<2>);
    type Output = RegressionOutput;

    fn step(&self, (x, y): Self::Input) -> TrainOutput<RegressionOutput> {
        let output = self.down.forward(self.act.forward(self.up.forward(x)));
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
// ANCHOR_END: model

// ANCHOR: config
const CONFIG: &str = r#"{
    "train_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3}
}"#;
// ANCHOR_END: config

/// Micro-batch `i` of this rank: 8 features in [-1, 1], and `y = sin(3 x0) + x1 x2`.
fn micro_batch(i: u64, rank: usize, rows: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let first = (i * 2 + rank as u64) * (rows * 8) as u64;
    let x: Vec<f32> = (first..first + (rows * 8) as u64)
        .map(|k| (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 8_388_608.0 - 1.0)
        .collect();
    let y: Vec<f32> = x
        .chunks(8)
        .map(|r| (3.0 * r[0]).sin() + r[1] * r[2])
        .collect();
    let x = Tensor::from_data(TensorData::new(x, [rows, 8]), device);
    (x, Tensor::from_data(TensorData::new(y, [rows, 1]), device))
}

// ANCHOR: loop
fn main() -> Result<()> {
    let (config, _warnings) = DeepSpeedConfig::from_json_str(CONFIG)?;
    let (_, losses) = launch(2, Duration::from_secs(120), |comm| {
        let device = Device::flex().autodiff();
        let model = Mlp {
            up: LinearConfig::new(8, 64).init(&device),
            act: Relu::new(),
            down: LinearConfig::new(64, 1).init(&device),
        };
        let rank = comm.rank();
        // Rank 0's parameters are broadcast; each rank then keeps its shard of them.
        let mut engine = DeepSpeedEngine::new(model, config.clone(), comm)?;
        let rows = engine.batch().train_micro_batch_size_per_gpu as usize;
        // Where the step's inputs go: stage 3 trains its shards with gradient checkpointing.
        let device = engine.device().unwrap_or(device);
        let mut last = f64::NAN;
        for step in 0..200 {
            let micro = (0..2).map(|m| micro_batch(step * 2 + m, rank, rows, &device));
            let report = engine.train_batch(micro)?;
            if rank == 0 && (report.step == 1 || report.step % 50 == 0) {
                println!("step {}: loss {:.4}", report.step, report.loss);
            }
            last = report.loss;
        }
        Ok(last)
    })?;
    println!(
        "final loss {:.4} (the same on every rank: {losses:?})",
        losses[0]
    );
    Ok(())
}
// ANCHOR_END: loop
