//! Learner-strategy benchmark: one training run inside Burn's `SupervisedTraining`, either
//! with [`DeepSpeedStrategy`] at a ZeRO stage or with Burn's own
//! `MultiDevice(devices, OptimSharded)`, on the same GPT, data and global batch. It prints
//! tokens/s and the process's peak RSS; run each configuration in its own process so that
//! peak RSS belongs to it alone.
//!
//! cargo run --release --example learner_bench -- --strategy deepspeed --stage 3 --world 2
//! cargo run --release --example learner_bench -- --strategy burn-sharded --world 2
//!
//! `scripts/bench-learner.sh` runs the configurations interleaved and writes the
//! Learner-strategy section of BENCHMARKS.md.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn::train::{
    ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim, SupervisedTraining,
    TrainingStrategy,
};
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::learner::DeepSpeedStrategy;
use burn_deepspeed_example_gpt::data::{EMBEDDED_CORPUS, WindowBatcher, windows};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::peak_rss_bytes;
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// `deepspeed` (DeepSpeedStrategy) or `burn-sharded` (Burn's MultiDevice OptimSharded).
    #[arg(long, default_value = "deepspeed")]
    strategy: String,
    /// ZeRO stage for `deepspeed` (0-3).
    #[arg(long, default_value_t = 0)]
    stage: u8,
    /// Ranks (threads) or Burn devices.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Model (`tiny`, `small`, `medium`).
    #[arg(long, default_value = "small")]
    model: String,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Optimizer steps (one epoch of `steps * world * batch` sequences).
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(shape) = GptShape::preset(&args.model) else {
        eprintln!("unknown model `{}` (tiny, small, medium)", args.model);
        return ExitCode::FAILURE;
    };
    if args.world == 0 || args.batch == 0 || args.steps == 0 {
        eprintln!("--world, --batch and --steps must be at least 1");
        return ExitCode::FAILURE;
    }
    // The corpus repeated as needed: every configuration sees the same sequences.
    let needed = args.steps * args.world * args.batch + args.batch;
    let mut data = Vec::with_capacity(needed);
    while data.len() < needed {
        data.extend(windows(EMBEDDED_CORPUS, shape.seq_len));
    }
    data.truncate(needed);
    let valid_data = data.split_off(needed - args.batch);
    let loader = |items: Vec<Vec<u8>>| {
        DataLoaderBuilder::new(WindowBatcher)
            .batch_size(args.batch)
            .set_device(Device::flex())
            .build(InMemDataset::new(items))
    };
    let (train, valid) = (loader(data), loader(valid_data.clone()));
    let model = Gpt::new(shape, 5, &Device::flex().autodiff());
    let params = model.num_params();

    let strategy = match args.strategy.as_str() {
        "deepspeed" => {
            let text = format!(
                r#"{{"train_batch_size": {}, "gradient_clipping": 1.0,
                    "zero_optimization": {{"stage": {}, "reduce_bucket_size": 5e5,
                        "allgather_bucket_size": 5e5, "stage3_param_persistence_threshold": 0,
                        "stage3_prefetch_bucket_size": 5e5}}}}"#,
                args.world * args.batch,
                args.stage
            );
            let config = match DeepSpeedConfig::from_json_str(&text) {
                Ok((c, _)) => c,
                Err(e) => {
                    eprintln!("config: {e}");
                    return ExitCode::FAILURE;
                }
            };
            Some(DeepSpeedStrategy::new(config, args.world))
        }
        "burn-sharded" => None,
        other => {
            eprintln!("unknown strategy `{other}` (deepspeed, burn-sharded)");
            return ExitCode::FAILURE;
        }
    };
    let (model, training_strategy) = match strategy {
        Some(s) => (
            s.prepare_model(model),
            TrainingStrategy::Custom(Arc::new(s)),
        ),
        None => (
            model,
            TrainingStrategy::Default(ExecutionStrategy::MultiDevice(
                vec![Device::flex(); args.world],
                MultiDeviceOptim::OptimSharded,
            )),
        ),
    };
    let dir = std::env::temp_dir().join(format!("learner-bench-{}", std::process::id()));
    let start = Instant::now();
    let result = SupervisedTraining::new(&dir, train, valid)
        .with_training_strategy(training_strategy)
        .num_epochs(1)
        .launch(Learner::new(model, AdamWConfig::new().init(), 1e-3));
    let seconds = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(e) = result.error {
        eprintln!("training failed: {e:?}");
        return ExitCode::FAILURE;
    }
    let batch = WindowBatcher;
    let held_out =
        burn::data::dataloader::batcher::Batcher::batch(&batch, valid_data, &Device::flex());
    let loss = InferenceStep::step(&result.model.valid(), held_out)
        .loss
        .into_scalar::<f32>();
    let tokens = (args.steps * args.world * args.batch * shape.seq_len) as f64;
    let report = json!({
        "strategy": args.strategy,
        "stage": if args.strategy == "deepspeed" { Some(args.stage) } else { None },
        "world": args.world,
        "model": args.model,
        "params": params,
        "steps": args.steps,
        "global_batch": args.world * args.batch,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "held_out_loss": loss,
        "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    }
    ExitCode::SUCCESS
}
