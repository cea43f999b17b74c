//! Trains the GPT example on one rank and prints its report as JSON (the last line of
//! stdout), for tests that need the run in a process of its own (the memory-capped offload
//! test runs it inside a cgroup).
//!
//! `gpt-run CONFIG MODEL STEPS [RANKS [save|resume DIR]]`: the config file, a preset (`tiny`,
//! `small`, ...), the steps, the thread ranks (1 by default), and a checkpoint directory to
//! save to at the end or to resume from.

use std::process::ExitCode;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunSpec, run_rank};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: gpt-run CONFIG MODEL STEPS [RANKS [save|resume DIR]]";
    let (config, model, steps, rest) = match &args[..] {
        [config, model, steps, rest @ ..] if rest.len() <= 3 => (config, model, steps, rest),
        _ => {
            eprintln!("{usage}");
            return ExitCode::from(2);
        }
    };
    let ranks = rest.first().map_or(Ok(1), |r| r.parse::<usize>());
    let (Some(shape), Ok(steps), Ok(ranks)) = (
        GptShape::preset(model),
        steps.parse::<u64>(),
        ranks.map(|r| r.max(1)),
    ) else {
        eprintln!("error: no preset {model:?}, or a step or rank count is not a number");
        return ExitCode::from(2);
    };
    let (save, resume) = match &rest.get(1..).unwrap_or_default() {
        [] => (None, None),
        [what, dir] if what == "save" => (Some(dir.into()), None),
        [what, dir] if what == "resume" => (None, Some(dir.into())),
        _ => {
            eprintln!("{usage}");
            return ExitCode::from(2);
        }
    };
    let run = || -> burn_deepspeed::Result<String> {
        let (config, _) = DeepSpeedConfig::from_file(config)?;
        let mut spec = RunSpec::on_embedded_corpus(config, shape, steps, 5, 9);
        spec.keep_final_state = false;
        spec.save_dir = save;
        spec.resume_from = resume;
        let (_, mut reports) = launch(ranks, Duration::from_secs(600), |comm| {
            run_rank(&spec, comm)
        })?;
        reports.truncate(1);
        let report = reports.pop().expect("rank 0");
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
