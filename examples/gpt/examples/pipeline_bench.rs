//! Pipeline benchmark: tokens/s of pp = 2 against dp = 2 on the same global batch
//! (interleaved rounds, in this process), and the measured bubble of S = 4 stages at
//! M = 4, 8, 16 micro-batches beside the schedule's (S − 1)/(M + S − 1).
//!
//! cargo run --release --example pipeline_bench -- [--model small] [--steps 4] [--rounds 2]
//! [--json]; `scripts/bench-pipeline.sh` runs it and writes the pipeline section of
//! BENCHMARKS.md.

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
    /// Model of the throughput comparison (`tiny` or `small`).
    #[arg(long, default_value = "small")]
    model: String,
    /// Optimizer steps per run (the whole run is timed).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Interleaved rounds of (dp = 2, pp = 2).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn config(micro: u64, accumulation: u64, stages: Option<usize>) -> DeepSpeedConfig {
    let pipeline = stages.map_or(String::new(), |s| {
        format!(r#", "pipeline": {{"stages": {s}, "partition": "parameters"}}"#)
    });
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {accumulation},
            "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}{pipeline}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn run(ranks: usize, shape: GptShape, config: DeepSpeedConfig, steps: u64) -> RunReport {
    let spec = RunSpec::on_embedded_corpus(config, shape, steps, 3, 1);
    run_in_threads(ranks, &spec, Duration::from_secs(600)).expect("benchmark run")
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}` (tiny, small)", args.model);
        return ExitCode::FAILURE;
    };
    // Throughput: the same global batch (2 replicas' worth: 2 x 8 micro-batches of 2) as
    // dp = 2 (each rank 8 micro-batches) and as pp = 2 (one pipeline of 16 micro-batches).
    let mut dp = Vec::new();
    let mut pp = Vec::new();
    let bubble_runs = [4u64, 8, 16];
    let runs = 2 * args.rounds as u64 + bubble_runs.len() as u64;
    let bar = TaskProgress::items("pipeline_bench", runs, !args.json);
    for round in 0..args.rounds {
        bar.set_message(format!("round {round}: dp=2"));
        let d = run(2, shape, config(2, 8, None), args.steps);
        bar.inc(1);
        bar.set_message(format!("round {round}: pp=2"));
        let p = run(2, shape, config(2, 16, Some(2)), args.steps);
        bar.inc(1);
        bar.println(format!(
            "round {round}: dp=2 {:.0} tokens/s, pp=2 {:.0} tokens/s (bubble {:.3})",
            d.tokens_per_s,
            p.tokens_per_s,
            p.bubble_fraction.unwrap_or(0.0)
        ));
        dp.push(d);
        pp.push(p);
    }
    let mean = |rs: &[RunReport]| rs.iter().map(|r| r.tokens_per_s).sum::<f64>() / rs.len() as f64;
    let (dp_tps, pp_tps) = (mean(&dp), mean(&pp));

    // Bubble: 4 stages of the tiny model, micro-batches of one sample.
    let mut bubbles = Vec::new();
    for m in bubble_runs {
        bar.set_message(format!("bubble: S=4 M={m}"));
        let r = run(4, GptShape::TINY, config(1, m, Some(4)), args.steps);
        bar.inc(1);
        let theory = 3.0 / (m as f64 + 3.0);
        let measured = r.bubble_fraction.unwrap_or(f64::NAN);
        let live = r
            .peak_live_activations_per_stage
            .clone()
            .unwrap_or_default();
        bar.println(format!(
            "S=4 M={m}: bubble {measured:.3} (schedule {theory:.3}), live activations {live:?}"
        ));
        bubbles.push(json!({
            "stages": 4, "micro_batches": m, "measured": measured, "theory": theory,
            "peak_live_activations_per_stage": live, "tokens_per_s": r.tokens_per_s,
        }));
    }
    bar.finish();
    let report = json!({
        "model": args.model,
        "params": dp[0].params,
        "steps": args.steps,
        "rounds": args.rounds,
        "global_batch": dp[0].train_batch_size,
        "dp2_tokens_per_s": dp_tps,
        "pp2_tokens_per_s": pp_tps,
        "pp2_over_dp2": pp_tps / dp_tps,
        "pp2_bubble_fraction": pp.iter().filter_map(|r| r.bubble_fraction).sum::<f64>() / pp.len() as f64,
        "dp2_model_state_bytes_per_rank": dp[0].model_state_bytes_per_rank,
        "pp2_model_state_bytes_per_rank": pp[0].model_state_bytes_per_rank,
        "dp2_comm_bytes_per_rank": dp[0].comm_bytes_per_rank,
        "pp2_comm_bytes_per_rank": pp[0].comm_bytes_per_rank,
        "bubble": bubbles,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
    }
    ExitCode::SUCCESS
}
