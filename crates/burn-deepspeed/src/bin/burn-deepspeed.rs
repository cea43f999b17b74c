//! The `burn-deepspeed` command line.
//!
//! `burn-deepspeed config check FILE [--world N]` prints the resolved config (every default
//! filled in) as JSON and exits 0, or prints why it cannot be used and exits 1.

use std::process::ExitCode;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed_strategies::pipe::{PipeInstruction, TrainSchedule};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "burn-deepspeed",
    version,
    about = "DeepSpeed's training techniques for Burn"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Work with `ds_config.json` files.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Print DeepSpeed's 1F1B pipeline schedule (TrainSchedule) for every stage.
    Schedule {
        /// Pipeline stages.
        #[arg(long)]
        stages: usize,
        /// Micro-batches per optimizer step.
        #[arg(long)]
        micro_batches: usize,
        /// Print one JSON object: `{"stages", "micro_batches", "schedule"}`, where
        /// `schedule[stage][step]` lists `[name, buffer_id]` pairs.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load, validate and resolve a config; print it as JSON with every default filled in.
    Check {
        /// The `ds_config.json` file.
        file: std::path::PathBuf,
        /// Data-parallel world size used to resolve the batch sizes.
        #[arg(long, default_value_t = 1)]
        world: usize,
    },
}

fn print_schedule(stages: usize, micro_batches: usize, json: bool) -> ExitCode {
    if stages == 0 || micro_batches == 0 {
        eprintln!("error: --stages and --micro-batches must be at least 1");
        return ExitCode::FAILURE;
    }
    let per_stage: Vec<Vec<Vec<PipeInstruction>>> = (0..stages)
        .map(|s| TrainSchedule::new(micro_batches, stages, s).steps())
        .collect();
    if json {
        let schedule: Vec<Vec<Vec<serde_json::Value>>> = per_stage
            .iter()
            .map(|steps| {
                steps
                    .iter()
                    .map(|cmds| {
                        cmds.iter()
                            .map(|c| serde_json::json!([c.name(), c.buffer()]))
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let out = serde_json::json!({
            "stages": stages,
            "micro_batches": micro_batches,
            "schedule": schedule,
        });
        println!("{out}");
    } else {
        print!("{:>4}", "step");
        for s in 0..stages {
            print!(" | {:<40}", format!("stage {s}"));
        }
        println!();
        for step in 0..per_stage[0].len() {
            print!("{step:>4}");
            for steps in &per_stage {
                let cell: Vec<String> = steps[step].iter().map(|c| c.to_string()).collect();
                print!(" | {:<40}", cell.join(" "));
            }
            println!();
        }
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Schedule {
            stages,
            micro_batches,
            json,
        } => print_schedule(stages, micro_batches, json),
        Command::Config {
            command: ConfigCommand::Check { file, world },
        } => {
            let result = DeepSpeedConfig::from_file(&file).and_then(|(mut config, warnings)| {
                config.resolve(world).map(|_| (config, warnings))
            });
            match result {
                Ok((config, warnings)) => {
                    for w in warnings {
                        eprintln!("warning: {w}");
                    }
                    println!("{}", config.to_json_pretty());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {}: {e}", file.display());
                    ExitCode::FAILURE
                }
            }
        }
    }
}
