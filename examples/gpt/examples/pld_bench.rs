//! Progressive layer dropping benchmark (arXiv 2010.13369): trains the GPT with and without
//! PLD in this process, one step of each in turn (the order alternating), and compares the time
//! per sample from step `--measure-from` on, with both runs' losses beside it.
//!
//! cargo run --release --example pld_bench -- [--steps 2200] [--measure-from 2000] [--json];
//! `scripts/bench-onebit.sh` runs it and writes the PLD section of BENCHMARKS.md.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn::train::InferenceStep;
use burn_deepspeed::launch::launch;
use burn_deepspeed::progress::TaskProgress;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine, StepLoss};
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::{RunSpec, train_step};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Model (`tiny` or `small`).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Optimizer steps of each run.
    #[arg(long, default_value_t = 2200)]
    steps: u64,
    /// First step of the timed window.
    #[arg(long, default_value_t = 2000)]
    measure_from: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// θ̄ of the PLD run.
    #[arg(long, default_value_t = 0.5)]
    theta: f64,
    /// γ of the PLD run.
    #[arg(long, default_value_t = 0.001)]
    gamma: f64,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn config(batch: u64, pld: Option<(f64, f64)>) -> DeepSpeedConfig {
    let pld = pld.map_or(String::new(), |(theta, gamma)| {
        format!(
            r#", "progressive_layer_drop": {{"enabled": true, "theta": {theta}, "gamma": {gamma}}}"#
        )
    });
    let text = format!(
        r#"{{"train_batch_size": {batch}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.95],
                           "weight_decay": 0.01}}}},
            "scheduler": {{"type": "WarmupLR", "params": {{"warmup_max_lr": 1e-3,
                           "warmup_num_steps": 20, "warmup_type": "linear"}}}}{pld}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

/// One run's figures.
#[derive(Default)]
struct Run {
    losses: Vec<f64>,
    timed: Duration,
    timed_samples: u64,
    theta: Option<f64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model {}", args.model);
        return ExitCode::FAILURE;
    };
    if args.measure_from >= args.steps {
        eprintln!("error: --measure-from must be below --steps");
        return ExitCode::FAILURE;
    }
    let specs = [None, Some((args.theta, args.gamma))].map(|pld| RunSpec {
        config: config(args.batch, pld),
        shape,
        steps: args.steps,
        corpus: ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7),
        seed: 5,
        progress: false,
        save_dir: None,
        resume_from: None,
        keep_final_state: true,
        device: Default::default(),
        ep_size: 1,
        teacher: None,
        heldout: None,
        long_context: Default::default(),
    });
    let outcome = launch(1, Duration::from_secs(3600), |comm| {
        let device = Device::flex().autodiff();
        let inner = device.clone().inner();
        let mut engines = Vec::new();
        for spec in &specs {
            let model = Gpt::new(shape, spec.seed, &device);
            engines.push(DeepSpeedEngine::new(
                model,
                spec.config.clone(),
                comm.clone(),
            )?);
        }
        let mut runs = [Run::default(), Run::default()];
        let bar = TaskProgress::items("pld_bench", args.steps, !args.json);
        bar.set_message("baseline and PLD, alternating");
        for step in 0..args.steps {
            bar.inc(1);
            // Alternate which run goes first, so neither always follows the other.
            let order = if step % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let start = Instant::now();
                let report = train_step(&mut engines[i], &specs[i], step, &inner)?;
                let took = start.elapsed();
                let run = &mut runs[i];
                run.losses.push(report.loss);
                run.theta = report.pld_theta;
                if step >= args.measure_from {
                    run.timed += took;
                    run.timed_samples += args.batch;
                }
            }
        }
        bar.finish();
        // The same held-out batch through both final models, with every layer (no dropping
        // in evaluation).
        let eval = specs[0]
            .corpus
            .batch(u64::MAX / 2, 0, 32, shape.seq_len, &inner);
        let eval_losses: Vec<f64> = engines
            .iter()
            .map(|e| InferenceStep::step(e.model(), eval.clone()).loss())
            .collect();
        Ok((runs, eval_losses, engines[0].num_params()))
    });
    let (runs, eval_losses, params) = match outcome {
        Ok((_, mut results)) => results.remove(0),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let summary = |run: &Run, eval: f64| {
        let n = run.losses.len().min(20);
        json!({
            "seconds_per_sample": run.timed.as_secs_f64() / run.timed_samples as f64,
            "loss_last20_mean": run.losses[run.losses.len() - n..].iter().sum::<f64>() / n as f64,
            "eval_loss": eval,
            "theta_last": run.theta,
        })
    };
    let (base, pld) = (&runs[0], &runs[1]);
    let ratio = (pld.timed.as_secs_f64() / pld.timed_samples as f64)
        / (base.timed.as_secs_f64() / base.timed_samples as f64);
    let out = json!({
        "model": args.model,
        "params": params,
        "steps": args.steps,
        "measure_from": args.measure_from,
        "batch": args.batch,
        "theta_bar": args.theta,
        "gamma": args.gamma,
        "baseline": summary(base, eval_losses[0]),
        "pld": summary(pld, eval_losses[1]),
        "time_per_sample_ratio": ratio,
    });
    eprintln!(
        "PLD time per sample from step {}: {:.3}x the baseline; eval loss {:.4} (PLD) vs {:.4}",
        args.measure_from, ratio, eval_losses[1], eval_losses[0]
    );
    if args.json {
        println!("{out}");
    }
    ExitCode::SUCCESS
}
