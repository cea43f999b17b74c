//! 3D-parallelism benchmark: every grid of 8 ranks (tp x pp x dp) that GPT `tiny` splits
//! into, on the same global batch, in this process with interleaved rounds: tokens/s against
//! pure data parallelism (tp 1, pp 1, dp 8), each rank's model state (measured, beside ZeRO
//! stage 1's formula for its slice of its stage), and the bytes each rank sent per step along
//! each axis (measured by the communicators).
//!
//! cargo run --release --example grid_bench -- [--model tiny] [--steps 4] [--rounds 2]
//! [--json]; `scripts/bench-3d.sh` runs it and writes the 3D section of BENCHMARKS.md.

use std::process::ExitCode;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::progress::TaskProgress;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_in_threads};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Model (`tiny` or `small`).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Optimizer steps per run (the whole run is timed).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Interleaved rounds over the grids.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

const RANKS: usize = 8;

/// ZeRO stage 1 on the data axis, 16 sequences per step in micro-batches of 2, through the
/// pipeline engine (one stage when pp is 1).
fn config(tp: usize, pp: usize) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "tensor_parallel": {{"tp_size": {tp}}},
            "pipeline": {{"stages": {pp}, "partition": "parameters"}},
            "zero_optimization": {{"stage": 1}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn run(shape: GptShape, tp: usize, pp: usize, steps: u64) -> RunReport {
    let mut spec = RunSpec::on_embedded_corpus(config(tp, pp), shape, steps, 3, 1);
    spec.keep_final_state = false;
    run_in_threads(RANKS, &spec, Duration::from_secs(1200)).expect("benchmark run")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}` (tiny, small)", args.model);
        return ExitCode::FAILURE;
    };
    // Every (tp, pp) whose product divides 8, whose tp divides the heads and whose pp fits the
    // layers (the embedding, the blocks and the head).
    let grids: Vec<(usize, usize)> = [1, 2, 4, 8]
        .into_iter()
        .flat_map(|tp| [1, 2, 4, 8].map(move |pp| (tp, pp)))
        .filter(|&(tp, pp)| {
            RANKS.is_multiple_of(tp * pp)
                && shape.heads.is_multiple_of(tp)
                && pp <= shape.layers + 2
        })
        .collect();
    let mut speeds = vec![Vec::new(); grids.len()];
    let mut last = Vec::new();
    let bar = TaskProgress::items("grid_bench", (args.rounds * grids.len()) as u64, !args.json);
    for round in 0..args.rounds {
        last.clear();
        for (i, &(tp, pp)) in grids.iter().enumerate() {
            bar.set_message(format!("round {round}: tp {tp} pp {pp}"));
            let report = run(shape, tp, pp, args.steps);
            bar.inc(1);
            speeds[i].push(report.tokens_per_s);
            last.push(report);
        }
    }
    bar.finish();
    let base = median(speeds[0].clone());
    let mut rows = Vec::new();
    println!(
        "| tp | pp | dp | tokens/s | vs dp 8 | model state per rank (max) | formula | tensor B/step | pipe B/step | data B/step |"
    );
    for (i, (&(tp, pp), report)) in grids.iter().zip(&last).enumerate() {
        let tokens = median(speeds[i].clone());
        let per_step = |f: &dyn Fn(&burn_deepspeed::grid::AxisBytes) -> u64| {
            let total: u64 = report.comm_bytes_per_axis.iter().map(f).sum();
            total as f64 / (RANKS as f64 * report.steps as f64)
        };
        let (tensor, pipe, data) = (
            per_step(&|a| a.tensor),
            per_step(&|a| a.pipe),
            per_step(&|a| a.data),
        );
        println!(
            "| {tp} | {pp} | {} | {tokens:.0} | {:.3} | {} | {} | {tensor:.0} | {pipe:.0} | {data:.0} |",
            report.data_parallel,
            tokens / base,
            report.model_state_bytes_per_rank,
            report.model_state_bytes_formula
        );
        rows.push(json!({
            "tp": tp, "pp": pp, "dp": report.data_parallel,
            "tokens_per_s": tokens, "tokens_per_s_rounds": speeds[i],
            "ratio_to_dp8": tokens / base,
            "model_state_bytes_per_rank": report.model_state_bytes_per_rank,
            "model_state_bytes_formula": report.model_state_bytes_formula,
            "tensor_bytes_per_rank_step": tensor,
            "pipe_bytes_per_rank_step": pipe,
            "data_bytes_per_rank_step": data,
            "losses": report.losses,
        }));
    }
    if args.json {
        let out = json!({
            "model": args.model, "params": last[0].params, "steps": args.steps,
            "rounds": args.rounds, "ranks": RANKS, "train_batch_size": last[0].train_batch_size,
            "grids": rows,
        });
        println!("{out}");
    }
    ExitCode::SUCCESS
}
