//! ZeRO benchmark: each stage's tokens/s over stage 0's from the same process (stages
//! interleaved round by round), bytes sent per rank per step (measured, beside the ring
//! model's and the ZeRO paper's volumes), and the model state each rank holds (measured,
//! beside ZeRO's formula), at several world sizes.
//!
//! cargo run --release --example zero_bench -- [--model small] [--worlds 2,4]
//! [--stages 0,1,2,3] [--steps 6] [--rounds 2] [--json]; `scripts/bench-zero.sh` runs it and
//! writes the ZeRO section of BENCHMARKS.md.

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
    #[arg(long, default_value = "small")]
    model: String,
    /// World sizes (thread ranks).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    worlds: Vec<usize>,
    /// ZeRO stages; stage 0 is the baseline and always runs.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    stages: Vec<u8>,
    /// Optimizer steps per run; the first is a warm-up and is not timed.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Interleaved rounds (each runs every stage once).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Global batch in sequences.
    #[arg(long, default_value_t = 16)]
    batch: u64,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn config(stage: u8, batch: u64) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": {batch}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 5e5,
                                   "allgather_bucket_size": 5e5,
                                   "stage3_param_persistence_threshold": 0,
                                   "stage3_prefetch_bucket_size": 5e5}}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn run(world: usize, shape: GptShape, stage: u8, args: &Args) -> Result<RunReport, String> {
    let spec = RunSpec::on_embedded_corpus(config(stage, args.batch), shape, args.steps, 3, 1);
    run_in_threads(world, &spec, Duration::from_secs(1800)).map_err(|e| e.to_string())
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}`", args.model);
        return ExitCode::FAILURE;
    };
    if args.steps < 2 || args.rounds == 0 {
        eprintln!("error: --steps must be at least 2 and --rounds at least 1");
        return ExitCode::FAILURE;
    }
    let mut stages = args.stages.clone();
    if !stages.contains(&0) {
        stages.insert(0, 0);
    }
    let mut rows = Vec::new();
    let runs = args.worlds.len() * args.rounds * stages.len();
    let bar = TaskProgress::items("zero_bench", runs as u64, !args.json);
    for &world in &args.worlds {
        let mut speeds = vec![Vec::new(); stages.len()];
        let mut last = vec![None; stages.len()];
        for round in 0..args.rounds {
            for (i, &stage) in stages.iter().enumerate() {
                bar.set_message(format!("world {world} round {round} stage {stage}"));
                let report = match run(world, shape, stage, &args) {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("error: world {world} stage {stage}: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let tps = report.timed_tokens_per_s(shape.seq_len);
                bar.println(format!(
                    "world {world} round {round} stage {stage}: {tps:.0} tokens/s"
                ));
                bar.inc(1);
                speeds[i].push(tps);
                last[i] = Some(report);
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let base = mean(&speeds[0]);
        let base_bytes = median(last[0].as_ref().expect("ran").comm_bytes_per_step.clone());
        for (i, &stage) in stages.iter().enumerate() {
            let r = last[i].as_ref().expect("ran");
            let psi = r.params as f64;
            let n = world as f64;
            // The paper's volume per rank per step: an all-reduce (or reduce-scatter +
            // all-gather) sends 2 (N-1)/N Ψ values; stage 3 adds another all-gather,
            // 3 (N-1)/N Ψ. A formula, reported beside the measured bytes.
            let paper_values = if stage == 3 { 3.0 } else { 2.0 } * (n - 1.0) / n * psi;
            let bytes = median(r.comm_bytes_per_step.clone());
            rows.push(json!({
                "world": world,
                "stage": stage,
                "params": r.params,
                "tokens_per_s": mean(&speeds[i]),
                "tokens_per_s_rounds": speeds[i],
                "ratio_to_stage0": mean(&speeds[i]) / base,
                "bytes_per_step": bytes,
                "ring_model_bytes_per_step": median(r.comm_bytes_model_per_step.clone()),
                "paper_bytes_per_step": 4.0 * paper_values,
                "bytes_over_stage0": bytes as f64 / base_bytes as f64,
                "model_state_bytes_per_rank": r.model_state_bytes_per_rank,
                "model_state_bytes_formula": r.model_state_bytes_formula,
                "peak_model_state_bytes_per_rank": r.peak_model_state_bytes_per_rank,
            }));
        }
    }
    bar.finish();
    let out = json!({
        "model": args.model,
        "steps": args.steps,
        "rounds": args.rounds,
        "batch": args.batch,
        "rows": rows,
    });
    if !args.json {
        for r in &rows {
            println!(
                "world {} stage {}: {:.0} tokens/s ({:.3} of stage 0), {} B/step measured \
                 (ring model {}, paper {:.0}), state {} B measured (formula {}), peak {} B",
                r["world"],
                r["stage"],
                r["tokens_per_s"].as_f64().unwrap_or(0.0),
                r["ratio_to_stage0"].as_f64().unwrap_or(0.0),
                r["bytes_per_step"],
                r["ring_model_bytes_per_step"],
                r["paper_bytes_per_step"].as_f64().unwrap_or(0.0),
                r["model_state_bytes_per_rank"],
                r["model_state_bytes_formula"],
                r["peak_model_state_bytes_per_rank"]
            );
        }
    }
    println!("{out}");
    ExitCode::SUCCESS
}
