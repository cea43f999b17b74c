//! Mixed precision and activation checkpointing, measured in one process.
//!
//! `--part precision`: fp32, fp16 (dynamic loss scaling) and bf16 at ZeRO stages 0-3 on thread
//! ranks: tokens/s over fp32 stage 0's (runs interleaved round by round), the model state a
//! rank holds (measured, beside its formula), stage 3's gather bytes, the activation heap, and
//! the final mean loss (last 20 steps) against fp32's at the same stage.
//!
//! `--part activation`: one rank with and without `activation_checkpointing` (each block a
//! checkpoint): the most heap one micro-batch's forward and backward hold (measured by the
//! counting allocator this binary installs), tokens/s, and the losses' largest difference.
//!
//! cargo run --release --example precision_bench -- --part precision|activation [--model tiny]
//! [--world 2] [--steps 300] [--rounds 1] [--micro-batch 16] [--json];
//! `scripts/bench-precision.sh` runs both and writes the precision section of BENCHMARKS.md.

use std::process::ExitCode;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::memory::heap::CountingAllocator;
use burn_deepspeed::progress::TaskProgress;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, run_in_threads};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator(std::alloc::System);

#[derive(Parser, Debug)]
struct Args {
    /// `precision` or `activation`.
    #[arg(long, value_parser = ["precision", "activation"])]
    part: String,
    /// Model preset.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Thread ranks (the activation part always runs one, so the heap is the rank's).
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Optimizer steps per run; the first is a warm-up and is not timed.
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// Interleaved rounds (each runs every variant once).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Sequences per micro-batch (one micro-batch per rank and step).
    #[arg(long, default_value_t = 8)]
    micro_batch: u64,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn config(precision: &str, stage: u8, batch: u64, checkpointing: bool) -> DeepSpeedConfig {
    let (fp16, bf16) = (precision == "fp16", precision == "bf16");
    let section = if checkpointing {
        r#", "activation_checkpointing": {}"#
    } else {
        ""
    };
    let text = format!(
        r#"{{"train_batch_size": {batch}, "gradient_clipping": 1.0,
            "fp16": {{"enabled": {fp16}}}, "bf16": {{"enabled": {bf16}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 5e5,
                                   "allgather_bucket_size": 5e5,
                                   "stage3_param_persistence_threshold": 0,
                                   "stage3_prefetch_bucket_size": 5e5}}{section}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn run(
    world: usize,
    shape: GptShape,
    config: DeepSpeedConfig,
    steps: u64,
) -> Result<RunReport, String> {
    let spec = RunSpec::on_embedded_corpus(config, shape, steps, 3, 1);
    run_in_threads(world, &spec, Duration::from_secs(3600)).map_err(|e| e.to_string())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Mean loss of the last 20 steps (all of them in a shorter run).
fn tail_loss(r: &RunReport) -> f64 {
    let n = r.losses.len().min(20);
    mean(&r.losses[r.losses.len() - n..])
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// Runs each variant once per round, interleaved; returns each one's mean tokens/s over the
/// rounds and its last report.
fn interleaved(
    args: &Args,
    world: usize,
    shape: GptShape,
    variants: &[(String, DeepSpeedConfig)],
) -> Result<Vec<(f64, RunReport)>, String> {
    let mut speeds = vec![Vec::new(); variants.len()];
    let mut last = vec![None; variants.len()];
    let runs = (args.rounds * variants.len()) as u64;
    let bar = TaskProgress::items("precision_bench", runs, !args.json);
    for round in 0..args.rounds {
        for (i, (name, config)) in variants.iter().enumerate() {
            bar.set_message(format!("round {round} {name}"));
            let report = run(world, shape, config.clone(), args.steps)
                .map_err(|e| format!("{name}: {e}"))?;
            let tps = report.timed_tokens_per_s(shape.seq_len);
            bar.println(format!("round {round} {name}: {tps:.0} tokens/s"));
            bar.inc(1);
            speeds[i].push(tps);
            last[i] = Some(report);
        }
    }
    bar.finish();
    Ok(speeds
        .iter()
        .zip(last)
        .map(|(s, r)| (mean(s), r.expect("every variant ran")))
        .collect())
}

fn precision_part(args: &Args, shape: GptShape) -> Result<Value, String> {
    let batch = args.micro_batch * args.world as u64;
    let mut variants = Vec::new();
    for precision in ["fp32", "fp16", "bf16"] {
        for stage in 0..4u8 {
            variants.push((
                format!("{precision} stage {stage}"),
                config(precision, stage, batch, false),
            ));
        }
    }
    let results = interleaved(args, args.world, shape, &variants)?;
    let base = results[0].0;
    let rows: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (tps, r))| {
            let fp32 = &results[i % 4].1;
            json!({
                "precision": r.dtype,
                "stage": i % 4,
                "params": r.params,
                "tokens_per_s": tps,
                "ratio_to_fp32_stage0": tps / base,
                "model_state_bytes_per_rank": r.model_state_bytes_per_rank,
                "model_state_bytes_formula": r.model_state_bytes_formula,
                "gather_bytes_sent": r.gather_stats.as_ref().map(|g| g.gather_bytes_sent),
                "peak_activation_bytes": r.peak_activation_bytes,
                "losses": r.losses,
                "tail_loss": tail_loss(r),
                "tail_loss_rel_to_fp32": (tail_loss(r) - tail_loss(fp32)).abs() / tail_loss(fp32),
                "skipped_steps": r.skipped_steps,
                "final_loss_scale": r.loss_scale.last(),
            })
        })
        .collect();
    // The same precision at every stage: the largest difference of the tail losses.
    let across: Vec<Value> = (0..3)
        .map(|p| {
            let tails: Vec<f64> = (0..4).map(|s| tail_loss(&results[p * 4 + s].1)).collect();
            let spread = tails
                .iter()
                .map(|t| (t - tails[0]).abs() / tails[0])
                .fold(0.0, f64::max);
            json!({"precision": results[p * 4].1.dtype, "max_rel_across_stages": spread})
        })
        .collect();
    Ok(json!({"rows": rows, "across_stages": across}))
}

fn activation_part(args: &Args, shape: GptShape) -> Result<Value, String> {
    let variants = [
        (
            "without".to_string(),
            config("fp32", 0, args.micro_batch, false),
        ),
        (
            "with".to_string(),
            config("fp32", 0, args.micro_batch, true),
        ),
    ];
    let results = interleaved(args, 1, shape, &variants)?;
    let [(plain_tps, plain), (ckpt_tps, ckpt)] = [results[0].clone(), results[1].clone()];
    let (with, without) = (
        ckpt.peak_activation_bytes
            .ok_or("the heap was not measured")?,
        plain
            .peak_activation_bytes
            .ok_or("the heap was not measured")?,
    );
    Ok(json!({
        "params": plain.params,
        "without_tokens_per_s": plain_tps,
        "with_tokens_per_s": ckpt_tps,
        "tokens_per_s_ratio": ckpt_tps / plain_tps,
        "without_peak_activation_bytes": without,
        "with_peak_activation_bytes": with,
        "peak_activation_ratio": with as f64 / without as f64,
        "losses_max_rel": max_rel(&ckpt.losses, &plain.losses),
        "peak_rss_without": plain.peak_rss_bytes,
    }))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}`", args.model);
        return ExitCode::FAILURE;
    };
    if args.steps < 2 || args.rounds == 0 || args.world == 0 {
        eprintln!("error: --steps must be at least 2, --rounds and --world at least 1");
        return ExitCode::FAILURE;
    }
    let part = match args.part.as_str() {
        "precision" => precision_part(&args, shape),
        _ => activation_part(&args, shape),
    };
    let result = match part {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = json!({
        "part": args.part,
        "model": args.model,
        "seq_len": shape.seq_len,
        "world": if args.part == "activation" { 1 } else { args.world },
        "steps": args.steps,
        "rounds": args.rounds,
        "micro_batch": args.micro_batch,
        "result": result,
    });
    if !args.json {
        eprintln!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    }
    println!("{out}");
    ExitCode::SUCCESS
}
