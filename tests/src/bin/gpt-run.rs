//! Trains the GPT example on one rank and prints its report as JSON (the last line of
//! stdout), for tests that need the run in a process of its own (the memory-capped offload
//! test runs it inside a cgroup).
//!
//! `gpt-run CONFIG MODEL STEPS`: the config file, a preset (`tiny`, `small`, ...), the steps.

use std::process::ExitCode;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunSpec, run_rank};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [config, model, steps] = &args[..] else {
        eprintln!("usage: gpt-run CONFIG MODEL STEPS");
        return ExitCode::from(2);
    };
    let (Some(shape), Ok(steps)) = (GptShape::preset(model), steps.parse::<u64>()) else {
        eprintln!("error: no preset {model:?}, or {steps:?} is not a step count");
        return ExitCode::from(2);
    };
    let run = || -> burn_deepspeed::Result<String> {
        let (config, _) = DeepSpeedConfig::from_file(config)?;
        let mut spec = RunSpec::on_embedded_corpus(config, shape, steps, 5, 9);
        spec.keep_final_state = false;
        let (_, mut reports) = launch(1, Duration::from_secs(600), |comm| run_rank(&spec, comm))?;
        let report = reports.pop().expect("one rank");
        serde_json::to_string(&report)
            .map_err(|e| burn_deepspeed::DeepSpeedError::Data(e.to_string()))
    };
    match run() {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
