//! Generates text with the byte-level GPT from a checkpoint, the model sliced over `--tp`
//! ranks (threads; under mpirun the MPI world), from key/value caches.
//!
//! ```text
//! cargo run --release --example generate -- --checkpoint DIR [--model PRESET]
//!     [--prompt TEXT]... [--max-new-tokens N] [--tp N]
//!     [--temperature T [--top-k K] [--top-p P] [--seed S]] [--compare-recompute] [--json]
//!     [--dtype fp32|fp16|bf16|int8|int4 [--quant-group G]] [--eval HELDOUT_FILE]
//! mpirun -n N target/release/examples/generate ...   # built with --features mpi
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use burn_deepspeed::DeepSpeedError;
use burn_deepspeed::inference::Scheme;
use burn_deepspeed::inference::{GenerateOptions, InferenceDtype, Sampling};
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::generate::{GenerateSpec, generate_rank};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Generate text with a byte-level GPT trained by burn-deepspeed")]
struct Args {
    /// A checkpoint directory (its `latest`), written by any grid; without it the model's
    /// seed-initialized weights (for timing only).
    #[arg(long)]
    checkpoint: Option<std::path::PathBuf>,
    /// The model size the checkpoint was trained with.
    #[arg(long, default_value = "tiny", value_parser = GptShape::PRESETS)]
    model: String,
    /// A prompt (repeat for a batch; lengths may differ).
    #[arg(long, default_values_t = vec!["The ".to_string()])]
    prompt: Vec<String>,
    /// Tokens generated after each prompt.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Tensor-parallel ranks as threads (under mpirun, the MPI world).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sample at this temperature instead of greedy decoding.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sampling: keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling: keep the nucleus of this probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sampling: the seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The dtype the model serves in: fp32, fp16 or bf16 (every parameter), int8 or int4
    /// (weight matrices, group-wise asymmetric, fused dequantize-matmul).
    #[arg(long, default_value = "fp32", value_parser = InferenceDtype::NAMES)]
    dtype: String,
    /// int8/int4: the largest group of values sharing a step and an offset (default 512 for
    /// int8, 64 for int4; a weight's rows take the largest divisor up to it).
    #[arg(long)]
    quant_group: Option<usize>,
    /// int8/int4: symmetric or asymmetric groups (default: symmetric for int8, asymmetric
    /// for int4).
    #[arg(long, value_parser = ["symmetric", "asymmetric"])]
    quant_scheme: Option<String>,
    /// Also report the model's mean next-byte loss over this file's non-overlapping windows
    /// (held-out data).
    #[arg(long)]
    eval: Option<std::path::PathBuf>,
    /// Also time full recomputation (no cache) and check it gives the same greedy tokens.
    #[arg(long)]
    compare_recompute: bool,
    /// Print a JSON summary as the last line of stdout.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> burn_deepspeed::Result<()> {
    let shape = GptShape::preset(&args.model).expect("clap checked the preset");
    let longest = args.prompt.iter().map(String::len).max().unwrap_or(0);
    if longest == 0 || longest.saturating_add(args.max_new_tokens) > shape.seq_len {
        return Err(DeepSpeedError::Data(format!(
            "prompts of 1 to {} bytes and --max-new-tokens must fit the model's context of {} \
             (the longest prompt has {longest})",
            shape.seq_len - args.max_new_tokens.min(shape.seq_len - 1),
            shape.seq_len
        )));
    }
    let params = match &args.checkpoint {
        Some(dir) => GenerateSpec::params_from_checkpoint(dir, shape)?,
        None => {
            let model = Gpt::new(shape, 42, &burn::tensor::Device::flex());
            let layout = burn_deepspeed::flat::ParamLayout::of(&model);
            burn_deepspeed::flat::params_to_flat(&model, &layout)
        }
    };
    let sampling = match args.temperature {
        Some(temperature) => Sampling::Random {
            temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        None => Sampling::Greedy,
    };
    let spec = GenerateSpec {
        shape,
        params: Arc::new(params),
        prompts: args
            .prompt
            .iter()
            .map(|p| p.bytes().map(u32::from).collect())
            .collect(),
        options: GenerateOptions {
            max_new_tokens: args.max_new_tokens,
            sampling,
        },
        dtype: InferenceDtype::parse(&args.dtype)?,
        quant_group: args.quant_group,
        quant_scheme: args.quant_scheme.as_deref().map(|s| match s {
            "symmetric" => Scheme::Symmetric,
            _ => Scheme::Asymmetric,
        }),
        eval: match &args.eval {
            Some(path) => Some(Arc::new(std::fs::read(path).map_err(|e| {
                DeepSpeedError::Data(format!("cannot read {}: {e}", path.display()))
            })?)),
            None => None,
        },
        compare_recompute: args.compare_recompute,
    };
    let (_, reports) = launch(args.tp, Duration::from_secs(600), |comm| {
        let rank = comm.rank();
        generate_rank(&spec, comm).map(|r| (rank, r))
    })?;
    if let Some((_, report)) = reports.into_iter().find(|(rank, _)| *rank == 0) {
        for (prompt, text) in args.prompt.iter().zip(&report.text) {
            eprintln!("{prompt}{text}");
        }
        eprintln!(
            "tp {} ({}): prefill {:.0} tokens/s, decode {:.0} tokens/s, first token {:.3} s, \
             per token p50 {:.4} s p99 {:.4} s, {} weight bytes per rank",
            report.tp,
            report.backend,
            report.prefill_tokens_per_s,
            report.decode_tokens_per_s,
            report.time_to_first_token_s,
            report.token_latency_p50_s,
            report.token_latency_p99_s,
            report.weight_bytes_per_rank
        );
        if let Some(loss) = report.heldout_loss {
            eprintln!(
                "{}: held-out loss {loss:.4} over {} tokens{}",
                report.dtype,
                report.heldout_tokens.unwrap_or(0),
                report
                    .heldout_kl_from_fp32
                    .map_or(String::new(), |kl| format!(", KL from fp32 {kl:.2e}"))
            );
        }
        if args.json {
            println!(
                "{}",
                serde_json::to_string(&report).expect("the report serializes")
            );
        }
    }
    Ok(())
}
