//! Engine overhead: the GPT trained by a plain Burn loop (one model, Burn's AdamW, no
//! engine) and by [`DeepSpeedEngine`] at one rank, on the same model, batches and
//! hyper-parameters, alternating in one process. Each step is split into phases (forward,
//! backward, the engine's gradient accumulation and reduction, the optimizer step, and the
//! rest), and tokens/s of the two are compared.
//!
//! With `--unfused` a third loop runs: the plain Burn loop on the same GPT with Burn's own
//! softmax and layer norm (decomposed under autodiff) instead of `burn_deepspeed::fused`'s,
//! which measures what the fused ops buy.
//!
//! cargo run --release --example overhead_bench -- --model tiny [--stage 0] [--unfused]
//!     [--device flex|wgpu|cuda] [--json]
//!
//! On a GPU (`--device cuda`, feature `cuda`) both loops run on GPU 0: the plain loop with
//! Burn's AdamW on the device, the engine device-resident with the fused CubeCL AdamW.
//!
//! `scripts/bench-overhead.sh` runs it for `tiny` and `small` and writes the
//! engine-overhead section of BENCHMARKS.md.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use burn::optim::{AdamWConfig, GradientsParams};
use burn_deepspeed::fused::set_blas;
use burn_deepspeed::launch::launch;
use burn_deepspeed::memory::caching::{self, CachingAllocator};
use burn_deepspeed::progress::TaskProgress;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::DEFAULT_CONFIG;
use burn_deepspeed_example_gpt::model::{Gpt, GptShape, LongContext, set_fused_ops};
use burn_deepspeed_example_gpt::run::{ModelDevice, RunSpec, train_step};
use clap::Parser;
use serde_json::json;

/// Large freed blocks kept for reuse when `--host-cache` is on (off otherwise).
#[global_allocator]
static HEAP: CachingAllocator = CachingAllocator;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Model (`tiny`, `small`).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// The engine's ZeRO stage (one rank).
    #[arg(long, default_value_t = 0)]
    stage: u8,
    /// Optimizer steps per run, the first `--warm-up` of them untimed.
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// Steps run before the timed ones.
    #[arg(long, default_value_t = 5)]
    warm_up: u64,
    /// Runs of each loop, alternating.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also run the plain loop with Burn's own softmax and layer norm.
    #[arg(long)]
    unfused: bool,
    /// Attention by the fused kernel (`blockwise_attention`: on Flex the CPU flash-attention
    /// kernel) instead of the decomposition that keeps the scores.
    #[arg(long)]
    flash: bool,
    /// Keep large freed blocks for reuse (`burn_deepspeed::memory::caching`).
    #[arg(long)]
    host_cache: bool,
    /// Instead of the engine comparison: the plain loop with each CPU lever off and on
    /// (host cache, fused attention, and with the `blas` feature OpenBLAS), alternating,
    /// round by round.
    #[arg(long)]
    levers: bool,
    /// The device both loops train on (`wgpu` and `cuda` need the example's feature).
    #[arg(long, default_value = "flex", value_parser = ["flex", "wgpu", "cuda"])]
    device: String,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// The example's default config (AdamW, WarmupLR, global batch 16) at `stage`, without
/// gradient clipping: Burn's clips each tensor by its own norm and the engine by the global
/// norm, so the two loops compute the same steps only without it.
fn config(stage: u8) -> DeepSpeedConfig {
    let mut value: serde_json::Value = serde_json::from_str(DEFAULT_CONFIG).expect("json");
    value["zero_optimization"]["stage"] = json!(stage);
    value["gradient_clipping"] = json!(0.0);
    DeepSpeedConfig::from_json_str(&value.to_string())
        .expect("valid config")
        .0
}

/// Summed phase times and losses of one loop's timed steps.
#[derive(Debug, Default, Clone)]
struct Timed {
    phases: Vec<(&'static str, Duration)>,
    wall: Duration,
    steps: u64,
    losses: Vec<f64>,
}

impl Timed {
    /// Adds `took` to the phase `name`'s sum.
    fn sum_into(&mut self, name: &'static str, took: Duration) {
        match self.phases.iter_mut().find(|(n, _)| *n == name) {
            Some((_, sum)) => *sum += took,
            None => self.phases.push((name, took)),
        }
    }

    /// Adds one step: its `phases` and, as `other`, the rest of its `wall` clock.
    fn add(&mut self, phases: &[(&'static str, Duration)], wall: Duration) {
        for &(name, took) in phases {
            self.sum_into(name, took);
        }
        let measured: Duration = phases.iter().map(|(_, d)| *d).sum();
        self.sum_into("other", wall.saturating_sub(measured));
        self.wall += wall;
        self.steps += 1;
    }

    fn merge(&mut self, other: &Timed) {
        for &(name, took) in &other.phases {
            self.sum_into(name, took);
        }
        self.wall += other.wall;
        self.steps += other.steps;
    }

    fn tokens_per_s(&self, tokens_per_step: u64) -> f64 {
        (self.steps * tokens_per_step) as f64 / self.wall.as_secs_f64().max(1e-12)
    }

    fn ms_per_step(&self) -> serde_json::Value {
        let n = self.steps.max(1) as f64;
        let mut map = serde_json::Map::new();
        for (name, took) in &self.phases {
            map.insert(name.to_string(), json!(took.as_secs_f64() * 1e3 / n));
        }
        map.insert("step".into(), json!(self.wall.as_secs_f64() * 1e3 / n));
        serde_json::Value::Object(map)
    }
}

/// `spec`'s GPT, initialized from its seed, with the fused attention under `--flash`.
fn gpt(spec: &RunSpec, args: &Args, device: &burn::tensor::Device) -> Gpt {
    let model = Gpt::new(spec.shape, spec.seed, device);
    match args.flash {
        true => model.with_long_context(LongContext {
            blockwise_attention: true,
            tile: None,
        }),
        false => model,
    }
}

/// The plain loop: `spec`'s model, batches and schedule, with Burn's AdamW at the config's
/// hyper-parameters.
fn plain(spec: &RunSpec, args: &Args, on: ModelDevice) -> Timed {
    let shape = spec.shape;
    let device = on.device(0);
    let inner = device.clone().inner();
    let mut model = gpt(spec, args, &device);
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init();
    let mut timed = Timed::default();
    for step in 0..args.steps {
        let batch = spec.corpus.batch(step, 0, 16, shape.seq_len, &inner);
        let start = Instant::now();
        let out = model.forward_loss(batch);
        let loss = out.loss.clone().into_scalar::<f32>() as f64;
        let forward = start.elapsed();
        let at = Instant::now();
        let grads = out.loss.backward();
        let backward = at.elapsed();
        let at = Instant::now();
        let grads = GradientsParams::from_grads(grads, &model);
        // The config's learning-rate schedule, as the engine follows it.
        model = optim.step(spec.config.lr_at(step), model, grads);
        let optimizer = at.elapsed();
        let wall = start.elapsed();
        if step >= args.warm_up {
            timed.add(
                &[
                    ("forward", forward),
                    ("backward", backward),
                    ("optimizer", optimizer),
                ],
                wall,
            );
            timed.losses.push(loss);
        }
    }
    timed
}

/// The engine at one rank on `spec`: the plain loop's model, batches and hyper-parameters.
fn engine(spec: &RunSpec, args: &Args, on: ModelDevice) -> Result<Timed, String> {
    let outcome = launch(1, Duration::from_secs(3600), |comm| {
        let device = on.device(0);
        let inner = device.clone().inner();
        let model = gpt(spec, args, &device);
        let mut engine = DeepSpeedEngine::new(model, spec.config.clone(), comm)?;
        let mut timed = Timed::default();
        for step in 0..args.steps {
            let start = Instant::now();
            let report = train_step(&mut engine, spec, step, &inner)?;
            let wall = start.elapsed();
            if step >= args.warm_up {
                // The engine's own split of the step, less the whole step itself.
                let phases: Vec<_> = report
                    .phases()
                    .into_iter()
                    .filter(|(name, _)| *name != "step")
                    .collect();
                timed.add(&phases, wall);
                timed.losses.push(report.loss);
            }
        }
        Ok(timed)
    });
    match outcome {
        Ok((_, mut results)) => Ok(results.remove(0)),
        Err(e) => Err(e.to_string()),
    }
}

/// The plain loop with the CPU levers off and on, alternating within each round: tokens/s
/// and phases of each, and the largest loss difference from the loop without them.
fn levers(spec: &RunSpec, args: &Args, on: ModelDevice, tokens_per_step: u64) -> ExitCode {
    // (name, host cache, fused attention, OpenBLAS); the OpenBLAS rows only when built with
    // the example's `blas` feature.
    let mut variants = vec![
        ("none", false, false, false),
        ("host cache", true, false, false),
        ("fused attention", false, true, false),
        ("cache + attention", true, true, false),
    ];
    if cfg!(feature = "blas") {
        variants.push(("OpenBLAS", false, false, true));
        variants.push(("all three", true, true, true));
    }
    let mut all: Vec<Timed> = variants.iter().map(|_| Timed::default()).collect();
    for round in 0..args.rounds {
        for (i, &(name, cache, flash, blas)) in variants.iter().enumerate() {
            caching::set_enabled(cache);
            set_blas(blas);
            let run_args = Args {
                flash,
                ..args.clone()
            };
            let t = plain(spec, &run_args, on);
            eprintln!(
                "round {round}: {name}: {:.0} tokens/s",
                t.tokens_per_s(tokens_per_step)
            );
            if round == 0 {
                all[i].losses = t.losses.clone();
            }
            all[i].merge(&t);
        }
    }
    set_blas(true);
    caching::set_enabled(false);
    let base = all[0].tokens_per_s(tokens_per_step);
    let rows: Vec<_> = (variants.iter().zip(&all))
        .map(|(&(name, cache, flash, blas), t)| {
            let diff = (t.losses.iter().zip(&all[0].losses))
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f64, f64::max);
            let tps = t.tokens_per_s(tokens_per_step);
            json!({"levers": name, "host_cache": cache, "fused_attention": flash, "openblas": blas,
                "tokens_per_s": tps, "ratio": tps / base, "ms_per_step": t.ms_per_step(),
                "max_loss_difference": diff})
        })
        .collect();
    let report = json!({"model": args.model, "device": on.name(), "steps": args.steps,
        "warm_up": args.warm_up, "rounds": args.rounds, "levers": rows});
    println!("{report}");
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("error: unknown model `{}` (tiny, small)", args.model);
        return ExitCode::FAILURE;
    };
    let on = match ModelDevice::parse(&args.device) {
        Ok(on) => on,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.warm_up >= args.steps || args.rounds == 0 {
        eprintln!("error: --warm-up must be below --steps, and --rounds at least 1");
        return ExitCode::FAILURE;
    }
    // Windows drawn with seed 7, the model initialized with seed 5, for both loops.
    let mut spec = RunSpec::on_embedded_corpus(config(args.stage), shape, args.steps, 7, 5);
    spec.keep_final_state = false;
    let tokens_per_step = 16 * shape.seq_len as u64;
    caching::set_enabled(args.host_cache);
    if args.levers {
        return levers(&spec, &args, on, tokens_per_step);
    }
    let loops = if args.unfused { 3 } else { 2 };
    let bar = TaskProgress::items("overhead_bench", loops * args.rounds as u64, !args.json);
    let (mut plain_all, mut engine_all) = (Timed::default(), Timed::default());
    let mut unfused_all = Timed::default();
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        bar.set_message(format!("round {round}: plain Burn loop"));
        let p = plain(&spec, &args, on);
        bar.inc(1);
        bar.set_message(format!("round {round}: engine, stage {}", args.stage));
        let e = match engine(&spec, &args, on) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        bar.inc(1);
        let (pt, et) = (
            p.tokens_per_s(tokens_per_step),
            e.tokens_per_s(tokens_per_step),
        );
        bar.println(format!(
            "round {round}: plain {pt:.0} tokens/s, engine {et:.0} tokens/s ({:.3})",
            et / pt
        ));
        let mut row = json!({"plain_tokens_per_s": pt, "engine_tokens_per_s": et});
        if args.unfused {
            bar.set_message(format!("round {round}: plain Burn loop, Burn's own ops"));
            set_fused_ops(false);
            let u = plain(&spec, &args, on);
            set_fused_ops(true);
            bar.inc(1);
            let ut = u.tokens_per_s(tokens_per_step);
            bar.println(format!(
                "round {round}: plain, unfused {ut:.0} tokens/s (fused / unfused {:.3})",
                pt / ut
            ));
            row["unfused_tokens_per_s"] = json!(ut);
            unfused_all.merge(&u);
            if round == 0 {
                unfused_all.losses = u.losses.clone();
            }
        }
        rounds.push(row);
        plain_all.merge(&p);
        engine_all.merge(&e);
        if round == 0 {
            plain_all.losses = p.losses.clone();
            engine_all.losses = e.losses.clone();
        }
    }
    bar.finish();
    let (pt, et) = (
        plain_all.tokens_per_s(tokens_per_step),
        engine_all.tokens_per_s(tokens_per_step),
    );
    // The same steps: the first round's losses agree to float rounding.
    let max_diff = plain_all
        .losses
        .iter()
        .zip(&engine_all.losses)
        .map(|(p, e)| (p - e).abs())
        .fold(0.0f64, f64::max);
    let mut report = json!({
        "model": args.model,
        "device": on.name(),
        "stage": args.stage,
        "steps": args.steps,
        "warm_up": args.warm_up,
        "rounds": rounds,
        "plain_tokens_per_s": pt,
        "engine_tokens_per_s": et,
        "engine_over_plain": et / pt,
        "plain_ms_per_step": plain_all.ms_per_step(),
        "engine_ms_per_step": engine_all.ms_per_step(),
        "max_loss_difference": max_diff,
        "plain_losses": plain_all.losses,
        "engine_losses": engine_all.losses,
    });
    if args.unfused {
        let ut = unfused_all.tokens_per_s(tokens_per_step);
        // Float rounding apart, the same steps.
        let diff = plain_all
            .losses
            .iter()
            .zip(&unfused_all.losses)
            .map(|(p, u)| (p - u).abs())
            .fold(0.0f64, f64::max);
        report["unfused_tokens_per_s"] = json!(ut);
        report["fused_over_unfused"] = json!(pt / ut);
        report["unfused_ms_per_step"] = unfused_all.ms_per_step();
        report["unfused_max_loss_difference"] = json!(diff);
    }
    let text = match args.json {
        true => report.to_string(),
        false => serde_json::to_string_pretty(&report).unwrap_or_default(),
    };
    println!("{text}");
    ExitCode::SUCCESS
}
