//! ZeRO parity at the acceptance scale: GPT `tiny` for `--steps` steps at several world sizes,
//! every ZeRO stage against stage 0 at the same world size, with AdamW and LAMB and 1 and 4
//! micro-batches per step. Prints, per run, the largest relative loss difference over the
//! steps and the largest absolute difference of the final parameters; exits 1 when a loss
//! differs by more than `--tolerance`.
//!
//! cargo run --release --example zero_parity -- [--steps 50] [--worlds 1,2,4] [--stages 1,2]

use std::process::ExitCode;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_in_threads};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// World sizes (thread ranks).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    worlds: Vec<usize>,
    /// Stages compared with stage 0.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    stages: Vec<u8>,
    /// Largest relative loss difference accepted.
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f64,
}

fn config(stage: u8, optimizer: &str, gas: u64) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 16, "gradient_accumulation_steps": {gas},
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "{optimizer}", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 5e4,
                                   "allgather_bucket_size": 5e4}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn run(world: usize, config: DeepSpeedConfig, steps: u64) -> Result<RunReport, String> {
    let spec = RunSpec::on_embedded_corpus(config, GptShape::TINY, steps, 7, 3);
    run_in_threads(world, &spec, Duration::from_secs(1800)).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut worst = 0.0f64;
    println!("| optimizer | gas | world | stage | max rel loss diff | max param diff |");
    println!("|---|---|---|---|---|---|");
    for optimizer in ["AdamW", "Lamb"] {
        for gas in [1, 4] {
            for &world in &args.worlds {
                let base = match run(world, config(0, optimizer, gas), args.steps) {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("error: stage 0 world {world}: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                for &stage in &args.stages {
                    let z = match run(world, config(stage, optimizer, gas), args.steps) {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!("error: stage {stage} world {world}: {e}");
                            return ExitCode::FAILURE;
                        }
                    };
                    let loss = base
                        .losses
                        .iter()
                        .zip(&z.losses)
                        .map(|(a, b)| (a - b).abs() / a.abs())
                        .fold(0.0, f64::max);
                    let param = base
                        .final_params
                        .iter()
                        .zip(z.final_params.iter())
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    worst = worst.max(loss);
                    println!(
                        "| {optimizer} | {gas} | {world} | {stage} | {loss:.2e} | {param:.2e} |"
                    );
                }
            }
        }
    }
    println!(
        "worst relative loss difference: {worst:.2e} (tolerance {:e})",
        args.tolerance
    );
    if worst <= args.tolerance {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
