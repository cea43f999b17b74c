//! The `burn-deepspeed` command line.
//!
//! `burn-deepspeed config check FILE [--world N] [--entry engine|pipeline|learner]` prints the
//! resolved config (every default filled in) as JSON and exits 0, or prints why it cannot be
//! used (by that entry point: its refusals are the ones it runs) and exits 1.
//!
//! `burn-deepspeed estimate-memory --params N --world W --stage S` prints the per-rank model
//! state ZeRO's formulas predict, like DeepSpeed's `estimate_zero*_model_states_mem_needs`.
//!
//! `burn-deepspeed checkpoint consolidate DIR --out FILE [--tag TAG]` writes a checkpoint of
//! any ZeRO stage and world size as one safetensors file of whole fp32 weights that plain
//! Burn loads, like DeepSpeed's `zero_to_fp32.py`.
//!
//! `burn-deepspeed launch --ranks N | --mpi N [--hostfile FILE] | --gpus -- PROGRAM ARGS...`
//! runs a training program as the ranks of one run (see [`launch`]).
//!
//! `burn-deepspeed report` prints what this machine and build offer a run, like DeepSpeed's
//! `ds_report` (see [`report`]).

mod launch;
mod report;

use std::process::ExitCode;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::checkpoint::consolidate;
use burn_deepspeed::config::{EntryPoint, check_supported};
use burn_deepspeed::memory::{StatePrecision, estimate_model_states, offload_estimates};
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
    /// Per-rank model-state memory at a ZeRO stage (ZeRO paper §5), plus this
    /// implementation's in-step overheads.
    EstimateMemory(EstimateArgs),
    /// Work with engine checkpoints.
    Checkpoint {
        #[command(subcommand)]
        command: CheckpointCommand,
    },
    /// Run a training program as the ranks of one run: thread ranks, MPI processes (on this
    /// machine or a hostfile's hosts), or one process per GPU.
    Launch(launch::LaunchArgs),
    /// Print what this machine and this build offer a run (like DeepSpeed's `ds_report`).
    Report {
        /// Where swap files would go (`nvme_path`): its free space is reported.
        #[arg(long)]
        nvme_path: Option<std::path::PathBuf>,
    },
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Write a checkpoint (any ZeRO stage and world size) as one safetensors file of whole
    /// fp32 weights named by module path, which plain Burn loads with burn-store.
    Consolidate {
        /// The checkpoint directory (the one `save_checkpoint` was given).
        dir: std::path::PathBuf,
        /// The safetensors file to write (replaced atomically if it exists).
        #[arg(long)]
        out: std::path::PathBuf,
        /// The checkpoint's tag (default: the one `DIR/latest` names).
        #[arg(long)]
        tag: Option<String>,
    },
}

/// The entry points `config check` can check a config for.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Entry {
    /// `DeepSpeedEngine`.
    Engine,
    /// `PipelineEngine`.
    Pipeline,
    /// `DeepSpeedStrategy` in Burn's `SupervisedTraining`.
    Learner,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load, validate and resolve a config, and run the refusals of the entry point that
    /// would train with it; print it as JSON with every default filled in.
    Check {
        /// The `ds_config.json` file.
        file: std::path::PathBuf,
        /// Data-parallel world size used to resolve the batch sizes.
        #[arg(long, default_value_t = 1)]
        world: usize,
        /// The entry point that would train with it: what it refuses is refused here too.
        #[arg(long, value_enum, default_value_t = Entry::Engine)]
        entry: Entry,
        /// With `--entry learner`: the `SupervisedTraining` has a checkpointer.
        #[arg(long)]
        checkpointer: bool,
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

/// The largest count of parameters (or elements) `estimate-memory` takes.
const MAX_COUNT: f64 = 1e15;

#[derive(clap::Args)]
struct EstimateArgs {
    /// Parameters (Ψ); accepts `7.5e9`.
    #[arg(long)]
    params: f64,
    /// Data-parallel ranks (N).
    #[arg(long, default_value_t = 1)]
    world: u64,
    /// ZeRO stage; every stage when left out.
    #[arg(long)]
    stage: Option<u8>,
    /// `fp32`, `mixed` (the paper's: 16-bit params and grads, fp32 masters, m and v) or
    /// `mixed-fp32-grads` (what the engine keeps in bf16: fp32 gradient buffers; fp16 keeps
    /// `mixed`).
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// `reduce_bucket_size` in elements.
    #[arg(long, default_value_t = 5e8)]
    bucket: f64,
    /// Stage 3: gathered elements alive at once (the largest layer, or
    /// `stage3_max_live_parameters`).
    #[arg(long, default_value_t = 0.0)]
    live_params: f64,
    /// Print one JSON object per stage (per row with `--offload`).
    #[arg(long)]
    json: bool,
    /// Print DeepSpeed's offload table instead (`estimate_zero2_model_states_mem_needs` and
    /// `estimate_zero3_model_states_mem_needs` for every offload option), with `--world` the
    /// devices per node.
    #[arg(long)]
    offload: bool,
    /// `--offload`: parameters of the largest layer.
    #[arg(long, default_value_t = 0.0)]
    largest_layer: f64,
    /// `--offload`: nodes.
    #[arg(long, default_value_t = 1)]
    nodes: u64,
}

/// DeepSpeed's offload table (host and device bytes for each option), by its formulas.
fn estimate_offload(a: &EstimateArgs) -> ExitCode {
    if a.largest_layer.is_nan() || a.largest_layer < 0.0 || a.nodes == 0 {
        eprintln!("error: --largest-layer must be at least 0 and --nodes at least 1");
        return ExitCode::FAILURE;
    }
    let rows = offload_estimates(
        a.params as u64,
        a.largest_layer as u64,
        a.world,
        a.nodes,
        1.5,
    );
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if !a.json {
        println!(
            "DeepSpeed's estimate (formula, fp16 mixed precision with Adam) for Ψ = {} \
             parameters, largest layer {}, {} node(s) x {} device(s):",
            a.params as u64, a.largest_layer as u64, a.nodes, a.world
        );
        println!(
            "{:>5} | {:>12} | {:>12} | options",
            "stage", "per host GiB", "per dev. GiB"
        );
    }
    for r in rows {
        if a.json {
            println!("{}", serde_json::to_value(r).expect("serializes"));
            continue;
        }
        let device = |on: bool| if on { "cpu " } else { "none" };
        let options = match r.stage {
            2 => format!("offload_optimizer={}", device(r.offload_optimizer)),
            _ => format!(
                "offload_param={}, offload_optimizer={}, zero_init={}",
                device(r.offload_param),
                device(r.offload_optimizer),
                u8::from(r.zero_init)
            ),
        };
        println!(
            "{:>5} | {:>12.2} | {:>12.2} | {options}",
            r.stage,
            gib(r.host_bytes),
            gib(r.device_bytes)
        );
    }
    ExitCode::SUCCESS
}

fn estimate_memory(a: EstimateArgs) -> ExitCode {
    let precision = match a.precision.as_str() {
        "fp32" => StatePrecision::Fp32,
        "mixed" => StatePrecision::Mixed,
        "mixed-fp32-grads" => StatePrecision::MixedFp32Grads,
        other => {
            eprintln!(
                "error: --precision must be fp32, mixed or mixed-fp32-grads, found `{other}`"
            );
            return ExitCode::FAILURE;
        }
    };
    if a.params.is_nan() || a.params < 1.0 || a.world == 0 || a.stage.is_some_and(|s| s > 3) {
        eprintln!("error: --params must be at least 1, --world at least 1 and --stage 0-3");
        return ExitCode::FAILURE;
    }
    // Counts past 1e15 (a thousand times the largest models) would overflow the byte counts.
    let counts = [
        ("--params", a.params),
        ("--bucket", a.bucket),
        ("--live-params", a.live_params),
        ("--largest-layer", a.largest_layer),
    ];
    if let Some((flag, v)) = counts.iter().find(|(_, v)| v.is_nan() || *v > MAX_COUNT) {
        eprintln!(
            "error: {flag} {v} is more than {MAX_COUNT:e}, the largest count the estimate takes"
        );
        return ExitCode::FAILURE;
    }
    if a.offload {
        return estimate_offload(&a);
    }
    let gb = |b: u64| b as f64 / 1e9;
    if !a.json {
        println!(
            "Ψ = {} parameters, N = {} ranks, {} states; per rank:",
            a.params as u64, a.world, a.precision
        );
        println!(
            "{:>5} | {:>12} | {:>12} | {:>12} | {:>12} | {:>14}",
            "stage", "params GB", "grads GB", "optim GB", "total GB", "+in-step GB"
        );
    }
    for stage in a.stage.map_or(0..=3, |s| s..=s) {
        let e = estimate_model_states(
            a.params as u64,
            a.world,
            stage,
            precision,
            a.bucket as u64,
            a.live_params as u64,
        );
        if a.json {
            let mut v = serde_json::to_value(e).expect("serializes");
            v["stage"] = stage.into();
            v["world"] = a.world.into();
            v["params_count"] = (a.params as u64).into();
            println!("{v}");
        } else {
            println!(
                "{stage:>5} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>14.3}",
                gb(e.params),
                gb(e.grads),
                gb(e.optimizer),
                gb(e.total),
                gb(e.step_overhead)
            );
        }
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::Report { nvme_path } => {
            report::print(nvme_path);
            ExitCode::SUCCESS
        }
        Command::EstimateMemory(args) => estimate_memory(args),
        Command::Schedule {
            stages,
            micro_batches,
            json,
        } => print_schedule(stages, micro_batches, json),
        Command::Checkpoint {
            command: CheckpointCommand::Consolidate { dir, out, tag },
        } => match consolidate(&dir, tag.as_deref(), &out) {
            Ok(c) => {
                println!(
                    "{}: checkpoint `{}` (step {}): {} tensors, {} values, {} bytes",
                    out.display(),
                    c.tag,
                    c.global_step,
                    c.tensors,
                    c.values,
                    c.bytes
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Config {
            command:
                ConfigCommand::Check {
                    file,
                    world,
                    entry,
                    checkpointer,
                },
        } => {
            let entry = match entry {
                Entry::Engine => EntryPoint::Engine,
                Entry::Pipeline => EntryPoint::Pipeline,
                Entry::Learner => EntryPoint::Strategy { checkpointer },
            };
            let result = DeepSpeedConfig::from_file(&file).and_then(|(mut config, warnings)| {
                config.resolve(world)?;
                check_supported(&config, entry)?;
                Ok((config, warnings))
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
