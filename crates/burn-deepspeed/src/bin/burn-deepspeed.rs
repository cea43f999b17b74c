//! The `burn-deepspeed` command line.
//!
//! `burn-deepspeed config check FILE [--world N]` prints the resolved config (every default
//! filled in) as JSON and exits 0, or prints why it cannot be used and exits 1.

use std::process::ExitCode;

use burn_deepspeed::DeepSpeedConfig;
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
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
