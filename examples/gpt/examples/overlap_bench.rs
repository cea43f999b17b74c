//! `overlap_comm` benchmark, alternating run by run in one process on the same model, data
//! and schedule. At ZeRO stage 2 (`--stage 2`, with gradient accumulation) each micro-batch's
//! buckets are reduced on the rank thread (off) or on a communication thread while the next
//! micro-batch runs (on); at stage 3 (`--stage 3`) the forward's next prefetch bundle is
//! all-gathered on the rank thread when it is needed (off) or on the communication thread
//! while the current layer computes (on). Reports tokens/s of each (median over rounds, the first step of each run
//! untimed), their ratio, the largest loss difference (the two must compute the same steps),
//! the time each rank's own thread spends handing gradients over, and the peak model state.
//!
//! cargo run --release --example overlap_bench -- [--model small] [--ranks 2] [--stage 2]
//! [--accumulation 4] [--steps 6] [--rounds 4] [--json]; `scripts/bench-overlap.sh` runs it
//! (and the same comparison under `mpirun`) and writes the section of BENCHMARKS.md.

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
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// ZeRO stage: 2 (bucket reductions) or 3 (parameter prefetch).
    #[arg(long, default_value_t = 2)]
    stage: u8,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    accumulation: u64,
    /// Global batch in sequences.
    #[arg(long, default_value_t = 16)]
    batch: u64,
    /// Optimizer steps per run; the first is a warm-up and is not timed.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Rounds; each runs overlap off, then on.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// The GPT example's stage-2 or stage-3 config with `overlap_comm` set.
fn config(args: &Args, overlap: bool) -> Result<DeepSpeedConfig, String> {
    let text = format!(
        r#"{{"train_batch_size": {}, "gradient_accumulation_steps": {},
            "gradient_clipping": 1.0, "wall_clock_breakdown": true,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {}, "reduce_bucket_size": 5e5,
                                   "overlap_comm": {overlap} {}}}}}"#,
        args.batch,
        args.accumulation,
        args.stage,
        // Stage 3 as `configs/zero3.json`: bundles of 5e5 elements (DeepSpeed's default 5e7
        // would fetch the whole model at its first miss) and every tensor partitioned.
        match args.stage {
            3 => r#", "stage3_prefetch_bucket_size": 5e5, "stage3_param_persistence_threshold": 0"#,
            _ => "",
        }
    );
    DeepSpeedConfig::from_json_str(&text)
        .map(|(c, _)| c)
        .map_err(|e| e.to_string())
}

fn run(args: &Args, shape: GptShape, overlap: bool) -> Result<RunReport, String> {
    let spec = RunSpec::on_embedded_corpus(config(args, overlap)?, shape, args.steps, 3, 1);
    run_in_threads(args.ranks, &spec, Duration::from_secs(1800)).map_err(|e| e.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Milliseconds per step that the slowest rank's own thread spent handing gradients to the
/// regime (for off, this includes the reductions and the waits for the other ranks).
fn accumulate_ms(r: &RunReport) -> f64 {
    r.breakdown_per_rank
        .iter()
        .map(|b| b.accumulate)
        .fold(0.0, f64::max)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}`", args.model);
        return ExitCode::FAILURE;
    };
    if args.steps < 2 || args.rounds == 0 || args.ranks < 2 || !matches!(args.stage, 2 | 3) {
        eprintln!(
            "error: --steps must be at least 2, --rounds at least 1, --ranks at least 2, \
             --stage 2 or 3"
        );
        return ExitCode::FAILURE;
    }
    let bar = TaskProgress::items("overlap_bench", 2 * args.rounds as u64, !args.json);
    let mut speeds = [Vec::new(), Vec::new()];
    let mut accumulate = [Vec::new(), Vec::new()];
    let mut last: [Option<RunReport>; 2] = [None, None];
    for round in 0..args.rounds {
        for (i, overlap) in [false, true].into_iter().enumerate() {
            bar.set_message(format!("round {round} overlap_comm {overlap}"));
            let report = match run(&args, shape, overlap) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: overlap_comm {overlap}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let tps = report.timed_tokens_per_s(shape.seq_len);
            bar.println(format!(
                "round {round} overlap_comm {overlap}: {tps:.0} tokens/s"
            ));
            bar.inc(1);
            speeds[i].push(tps);
            accumulate[i].push(accumulate_ms(&report));
            last[i] = Some(report);
        }
    }
    bar.finish();
    let (Some(off), Some(on)) = (&last[0], &last[1]) else {
        eprintln!("error: no run finished");
        return ExitCode::FAILURE;
    };
    let max_loss_diff = off
        .losses
        .iter()
        .zip(&on.losses)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let [off_tps, on_tps] = speeds.clone().map(median);
    let row = |name: &str, i: usize, r: &RunReport| {
        json!({
            "overlap_comm": name,
            "tokens_per_s": median(speeds[i].clone()),
            "tokens_per_s_rounds": speeds[i],
            "accumulate_ms_per_step": median(accumulate[i].clone()),
            "peak_model_state_bytes_per_rank": r.peak_model_state_bytes_per_rank,
            "final_loss": r.losses.last(),
        })
    };
    let out = json!({
        "model": args.model,
        "ranks": args.ranks,
        "stage": args.stage,
        "gathered_ahead": on.gather_stats.map(|s| s.gathered_ahead),
        "batch": args.batch,
        "accumulation": args.accumulation,
        "steps": args.steps,
        "rounds": args.rounds,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "ratio_on_over_off": on_tps / off_tps,
        "max_loss_diff": max_loss_diff,
        "rows": [row("off", 0, off), row("on", 1, on)],
    });
    if !args.json {
        println!(
            "overlap_comm off {off_tps:.0} tokens/s, on {on_tps:.0} tokens/s ({:.3}x); \
             accumulate {:.1} -> {:.1} ms per step; peak state {} -> {} B; max loss \
             difference {max_loss_diff:e}",
            on_tps / off_tps,
            median(accumulate[0].clone()),
            median(accumulate[1].clone()),
            off.peak_model_state_bytes_per_rank,
            on.peak_model_state_bytes_per_rank,
        );
    }
    println!("{out}");
    ExitCode::SUCCESS
}
