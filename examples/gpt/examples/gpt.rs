//! Trains the byte-level GPT with burn-deepspeed.
//!
//! ```text
//! cargo run --release --example gpt -- [--config FILE] [--model PRESET] [--layers N]
//!     [--device flex|wgpu|cuda] [--ranks N] [--ep-size N]
//!     [--steps N] [--data PATH] [--heldout-bytes N] [--seed S] [--json]
//!     [--teacher DIR --teacher-model PRESET [--kd-stop-step N] [--kd-temperature T]]
//!     [--trace FILE] [--params-digest]
//!     [--seq-len N] [--blockwise-attention] [--tile N]
//! mpirun -n N target/release/examples/gpt ...        # built with --features mpi
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::distill::DistillationConfig;
use burn_deepspeed::launch::{launch, mpirun_rank};
use burn_deepspeed::memory::caching::{self, CachingAllocator};
use burn_deepspeed::memory::heap::CountingAllocator;
use burn_deepspeed::trace::ChromeTrace;
use burn_deepspeed_example_gpt::DEFAULT_CONFIG;
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{GptShape, LongContext};
use burn_deepspeed_example_gpt::run::{
    DiskBaselineReport, ModelDevice, RunSpec, Teacher, run_rank,
};
use clap::Parser;

/// Counts the heap, so that the report's `peak_activation_bytes` is measured; below it, large
/// freed blocks are kept for reuse when `--host-cache` is given.
#[global_allocator]
static HEAP: CountingAllocator<CachingAllocator> = CountingAllocator(CachingAllocator);

#[derive(Parser)]
#[command(about = "Train a byte-level GPT with burn-deepspeed")]
struct Args {
    /// A `ds_config.json`; the example's default config when absent.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Model size.
    #[arg(long, default_value = "tiny", value_parser = GptShape::PRESETS)]
    model: String,
    /// Expert parallelism of a GPT-MoE (`tiny-moe`, `small-moe`): ranks that split each MoE
    /// layer's experts; it must divide the data-parallel ranks and the experts.
    #[arg(long, default_value_t = 1)]
    ep_size: usize,
    /// Overrides the preset's context: the sequence length trained on, and the positions the
    /// model learns (longer than the preset for long-context runs).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Attention computes its scores one block of queries at a time and again in the
    /// backward, with memory linear in the sequence instead of quadratic (on the CPU, the
    /// flash-attention kernel: also the fastest attention at any length).
    #[arg(long)]
    blockwise_attention: bool,
    /// Keep large freed host blocks for the next step's allocations of the same size
    /// (`burn_deepspeed::memory::caching`), instead of mapping fresh pages every step.
    #[arg(long)]
    host_cache: bool,
    /// Positions per tile of the MLP and the loss, each tile an activation checkpoint
    /// (ALST's tiled compute, for long sequences).
    #[arg(long)]
    tile: Option<usize>,
    /// Overrides the preset's number of transformer blocks (e.g. the `xl` width at a depth
    /// that fits in memory without offload).
    #[arg(long)]
    layers: Option<usize>,
    /// The device the model trains on (`wgpu` and `cuda` need the example's feature of that
    /// name).
    #[arg(long, default_value = "flex", value_parser = ["flex", "wgpu", "cuda"])]
    device: String,
    /// Data-parallel ranks as threads (under mpirun, the MPI world decides).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// Train on the bytes of this file instead of the embedded corpus.
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Seed of the initialization and the batch sampling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print a JSON summary as the last line of stdout.
    #[arg(long)]
    json: bool,
    /// Overrides the config's `train_batch_size` (sequences per optimizer step).
    #[arg(long)]
    train_batch_size: Option<u64>,
    /// Save a checkpoint in this directory after the last step.
    #[arg(long)]
    save_dir: Option<std::path::PathBuf>,
    /// Resume from the latest checkpoint in this directory (`--steps` counts from step 0).
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Before training, measure the disk's own `O_DIRECT` bandwidth on this many GB in the
    /// config's `offload_param` (or `offload_optimizer`) `nvme_path`, the baseline the
    /// report's swap throughput is judged against.
    #[arg(long)]
    measure_disk_gb: Option<f64>,
    /// Hold out the last N bytes of the training data: train on the rest and report the
    /// held-out loss on them after the last step.
    #[arg(long)]
    heldout_bytes: Option<usize>,
    /// Mixture-of-Students: distil from the teacher in this checkpoint directory (its
    /// latest), a GPT of `--teacher-model`.
    #[arg(long, requires = "teacher_model")]
    teacher: Option<std::path::PathBuf>,
    /// The teacher's preset.
    #[arg(long, value_parser = GptShape::PRESETS)]
    teacher_model: Option<String>,
    /// Layers of the teacher, when it was trained with `--layers`.
    #[arg(long)]
    teacher_layers: Option<usize>,
    /// Staged distillation: the teacher's term stops at this step (absent: never).
    #[arg(long)]
    kd_stop_step: Option<u64>,
    /// Softmax temperature of the distillation.
    #[arg(long, default_value_t = 1.0)]
    kd_temperature: f64,
    /// Weight of the cross-entropy with the labels.
    #[arg(long, default_value_t = 1.0)]
    kd_alpha_ce: f64,
    /// Weight of the teacher's term.
    #[arg(long, default_value_t = 1.0)]
    kd_beta: f64,
    /// Seconds a rank waits for the others before failing.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Write a Chrome/Perfetto timeline of the run here (one track per rank; under
    /// `mpirun`, each process writes FILE.rank<r>).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Gather the parameters after the last step and add their digest to the JSON summary
    /// (`params_digest`, FNV-1a over the f32 bits; pipelined runs: rank 0's stage), so that
    /// two builds can be compared bit for bit.
    #[arg(long)]
    params_digest: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    caching::set_enabled(args.host_cache);
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> burn_deepspeed::Result<()> {
    let (mut config, warnings) = match &args.config {
        Some(path) => DeepSpeedConfig::from_file(path)?,
        None => DeepSpeedConfig::from_json_str(DEFAULT_CONFIG)?,
    };
    if let Some(n) = args.train_batch_size {
        config.train_batch_size = Some(n);
    }
    let bytes = match &args.data {
        Some(path) => std::fs::read(path).map_err(|e| {
            burn_deepspeed::DeepSpeedError::Data(format!("cannot read {}: {e}", path.display()))
        })?,
        None => EMBEDDED_CORPUS.to_vec(),
    };
    let baseline = match args.measure_disk_gb {
        Some(gb) => Some(measure_disk(&config, gb)?),
        None => None,
    };
    let device = ModelDevice::parse(&args.device)?;
    let mut shape = GptShape::preset(&args.model).expect("clap checked the preset");
    if let Some(layers) = args.layers {
        if layers == 0 {
            return Err(burn_deepspeed::DeepSpeedError::Data(
                "--layers must be at least 1".into(),
            ));
        }
        shape.layers = layers;
    }
    if args.tile == Some(0) {
        return Err(burn_deepspeed::DeepSpeedError::Data(
            "--tile must be at least 1 position".into(),
        ));
    }
    if let Some(seq_len) = args.seq_len {
        if seq_len == 0 || seq_len + 1 >= bytes.len() {
            return Err(burn_deepspeed::DeepSpeedError::Data(format!(
                "--seq-len {seq_len} needs at least 1 position and fewer than the {} bytes of \
                 the training data (give a longer file with --data)",
                bytes.len()
            )));
        }
        shape.seq_len = seq_len;
    }
    let (bytes, heldout) = match args.heldout_bytes {
        Some(n) if n >= bytes.len() => {
            return Err(burn_deepspeed::DeepSpeedError::Data(format!(
                "--heldout-bytes {n} leaves nothing to train on in {} bytes",
                bytes.len()
            )));
        }
        Some(n) => {
            let cut = bytes.len() - n;
            (bytes[..cut].to_vec(), Some(Arc::new(bytes[cut..].to_vec())))
        }
        None => (bytes, None),
    };
    let teacher = match (&args.teacher, &args.teacher_model) {
        (Some(dir), Some(model)) => {
            let mut shape = GptShape::preset(model).expect("clap checked the preset");
            if let Some(layers) = args.teacher_layers {
                shape.layers = layers;
            }
            let distill = DistillationConfig::new()
                .with_alpha_ce(args.kd_alpha_ce)
                .with_beta_kd(args.kd_beta)
                .with_temperature(args.kd_temperature)
                .with_stop_step(args.kd_stop_step);
            Some(Teacher::from_checkpoint(dir, shape, distill)?)
        }
        _ => None,
    };
    // Before any rank starts, so that every span of the run is recorded.
    let trace = match &args.trace {
        Some(path) => {
            let path = match mpirun_rank() {
                Some(rank) => {
                    let mut name = path.clone().into_os_string();
                    name.push(format!(".rank{rank}"));
                    PathBuf::from(name)
                }
                None => path.clone(),
            };
            Some(ChromeTrace::start(&path)?)
        }
        None => None,
    };
    let spec = RunSpec {
        config,
        shape,
        steps: args.steps,
        corpus: ByteCorpus::new(bytes, args.seed),
        seed: args.seed,
        progress: !args.json,
        save_dir: args.save_dir.clone(),
        resume_from: args.resume.clone(),
        keep_final_state: args.params_digest,
        device,
        ep_size: args.ep_size,
        teacher,
        heldout,
        long_context: LongContext {
            blockwise_attention: args.blockwise_attention,
            tile: args.tile,
        },
    };
    // ANCHOR: launch
    let (_, reports) = launch(args.ranks, Duration::from_secs(args.timeout), |comm| {
        if comm.rank() == 0 {
            for w in &warnings {
                eprintln!("warning: {w}");
            }
        }
        let rank = comm.rank();
        run_rank(&spec, comm).map(|r| (rank, r))
    })?;
    // ANCHOR_END: launch
    if let Some(trace) = trace {
        eprintln!("trace written to {}", trace.finish().display());
    }
    // Every rank's report is the same; rank 0 (in this process) prints it.
    if let Some((_, mut report)) = reports.into_iter().find(|(rank, _)| *rank == 0) {
        report.disk_baseline = baseline;
        eprintln!(
            "trained {} params for {} steps on {} rank(s) ({}): loss {:.4} -> {:.4}, {:.0} tokens/s",
            report.params,
            report.steps,
            report.world,
            report.backend,
            report.losses.first().copied().unwrap_or(f64::NAN),
            report.losses.last().copied().unwrap_or(f64::NAN),
            report.tokens_per_s
        );
        if let (Some(loss), Some(tokens)) = (report.heldout_loss, report.heldout_tokens) {
            eprintln!("held-out loss {loss:.4} over {tokens} tokens");
        }
        if let Some(comms) = &report.comms {
            eprint!("communication of rank 0:\n{}", comms.summary);
        }
        if args.json {
            let mut json = serde_json::to_value(&report).expect("the report serializes");
            if args.params_digest {
                json["params_digest"] = report.final_params.digest().into();
            }
            println!("{json}");
        }
    }
    Ok(())
}

/// The disk's `O_DIRECT` bandwidth in the config's swap folder, on `gb` GB.
fn measure_disk(config: &DeepSpeedConfig, gb: f64) -> burn_deepspeed::Result<DiskBaselineReport> {
    let z = &config.zero_optimization;
    let dir = z
        .offload_param
        .as_ref()
        .and_then(|o| o.nvme_path.clone())
        .or_else(|| {
            z.offload_optimizer
                .as_ref()
                .and_then(|o| o.nvme_path.clone())
        })
        .ok_or_else(|| {
            burn_deepspeed::DeepSpeedError::Data(
                "--measure-disk-gb needs an nvme_path in the config's offload sections".into(),
            )
        })?;
    let b = burn_deepspeed::swap::disk_baseline(dir.as_ref(), (gb * 1e9) as u64)?;
    eprintln!(
        "disk baseline in {dir} (O_DIRECT, 8 MiB requests, {:.1} GB): write {:.3} GB/s, read \
         {:.3} GB/s",
        b.bytes as f64 / 1e9,
        b.write_gb_per_s(),
        b.read_gb_per_s()
    );
    Ok(DiskBaselineReport::from(b))
}
