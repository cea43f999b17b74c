//! `swap-bench`: ZeRO-Infinity's swapper against the disk's own `O_DIRECT` bandwidth, and the
//! tiled Adam step from a swap file against the in-memory step, measured in one run.
//!
//! cargo bench -p burn-deepspeed-strategies --bench swap-bench -- [--dir PATH]
//! [--state-mb MB] [--tile ELEMENTS] [--reps R] [--json]
//!
//! - **Disk**: one thread writes, then reads, a file of the state's size sequentially in
//!   8 MiB `O_DIRECT` requests with plain `pwrite`/`pread`, as `dd oflag=direct bs=8M` would.
//!   These are the baselines.
//! - **Swap pass**: a [`SwapStore`] of fp32 masters, m and v (`--state-mb` in all) read and
//!   written back tile by tile with the work left out, pipelined, with DeepSpeed's `aio`
//!   defaults (1 MiB requests, 8 in flight), on io_uring and on `pread`. Its efficiency is the
//!   disk's time to read and write the same bytes (at the baselines' rates) over the pass's
//!   wall time.
//! - **Adam**: one [`PartitionedOptimizer`] step over the same elements, in memory, then from
//!   the swap file (io_uring, pipelined).
//!
//! All data is incompressible noise (a virtual disk may skip zeros). Every figure is the
//! median of `reps` repetitions. `scripts/bench-offload.sh` writes the
//! offload section of BENCHMARKS.md from `--json`.

use std::path::PathBuf;
use std::time::Instant;

use burn_deepspeed_cubecl_kernels::adam::AdamParams;
use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};
use burn_deepspeed_strategies::swap::{
    AioOptions, IoEngine, SwapOptions, SwapStore, TilePlan, disk_baseline, fill_noise,
    io_uring_available,
};
use burn_deepspeed_strategies::zero::{FlatPartition, PartitionedKind, PartitionedOptimizer};

struct Args {
    dir: PathBuf,
    state_mb: usize,
    tile: usize,
    reps: usize,
    json: bool,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        dir: std::env::temp_dir(),
        state_mb: 1536,
        tile: 1 << 24,
        reps: 3,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<String, String> {
            it.next().ok_or(format!("{name} needs a value"))
        };
        let number = |name: &str, v: String| -> Result<usize, String> {
            v.parse::<f64>()
                .map(|x| x as usize)
                .map_err(|e| format!("{name} {v}: {e}"))
        };
        match a.as_str() {
            "--dir" => args.dir = PathBuf::from(value("--dir")?),
            "--state-mb" => args.state_mb = number("--state-mb", value("--state-mb")?)?.max(1),
            "--tile" => args.tile = number("--tile", value("--tile")?)?.max(1),
            "--reps" => args.reps = number("--reps", value("--reps")?)?.max(1),
            "--json" => args.json = true,
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn noisy(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    fill_noise(&mut v, seed);
    v
}

fn adam() -> PartitionedKind {
    PartitionedKind::Adam(AdamParams::adamw(0.0, 0.01))
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let len = args.state_mb * (1 << 20) / 12;
    let plan = TilePlan::new(len, args.tile, 3);
    let bytes = plan.file_bytes() as usize;
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let b = disk_baseline(&args.dir, bytes as u64).expect("the disk baseline");
        writes.push(b.write_secs);
        reads.push(b.read_secs);
    }
    let (raw_write, raw_read) = (median(writes), median(reads));
    let disk_secs = raw_write + raw_read;
    let gbps = |b: usize, s: f64| b as f64 / s / 1e9;

    let mut engines = vec![IoEngine::Pread];
    if io_uring_available() {
        engines.insert(0, IoEngine::Uring);
    }
    let options = |engine| SwapOptions {
        aio: AioOptions::default(),
        engine,
        pipeline_read: true,
        pipeline_write: true,
    };
    let mut passes = Vec::new();
    for &engine in &engines {
        let path = args.dir.join("swap-bench.swp");
        let mut store = SwapStore::create(&path, plan, options(engine)).expect("swap file");
        let (a, b, c) = (noisy(len, 2), noisy(len, 3), noisy(len, 4));
        store
            .write_all(&[Some(&a), Some(&b), Some(&c)])
            .expect("initialise");
        drop((a, b, c));
        let times: Vec<f64> = (0..args.reps)
            .map(|_| {
                let start = Instant::now();
                store.update(|_, _, _| Ok(())).expect("pass");
                start.elapsed().as_secs_f64()
            })
            .collect();
        let wall = median(times);
        passes.push(serde_json_like(&[
            ("engine", format!("\"{}\"", engine.name())),
            ("direct", store.file().is_direct().to_string()),
            ("seconds", format!("{wall:.4}")),
            (
                "read_write_gb_per_s",
                format!("{:.4}", gbps(2 * bytes, wall)),
            ),
            ("efficiency", format!("{:.4}", disk_secs / wall)),
        ]));
    }

    // Adam over the same elements: in memory, then from the swap file.
    let (ram_secs, swap_secs) = ThreadWorld::run(1, ThreadWorldOptions::default(), |comm| {
        let part = FlatPartition::new(len, 1);
        let grads = noisy(len, 5);
        let mut params = noisy(len, 6);
        let present = [1u8];
        let mut ram = PartitionedOptimizer::new(adam(), &part, 0, &[len]);
        let ram_secs = median(
            (0..args.reps)
                .map(|_| {
                    let start = Instant::now();
                    ram.step(&comm, &mut params, &grads, &present, 1e-3)
                        .expect("step");
                    start.elapsed().as_secs_f64()
                })
                .collect(),
        );
        drop(ram);
        let mut disk = PartitionedOptimizer::new(adam(), &part, 0, &[len]);
        let path = args.dir.join("swap-bench-adam.swp");
        let store = SwapStore::create(&path, plan, options(engines[0])).expect("swap file");
        disk.offload(store, &params).expect("offload");
        // Non-zero moments on disk before the timed steps, as after any real step.
        disk.step(&comm, &mut params, &grads, &present, 1e-3)
            .expect("step");
        let swap_secs = median(
            (0..args.reps)
                .map(|_| {
                    let start = Instant::now();
                    disk.step(&comm, &mut params, &grads, &present, 1e-3)
                        .expect("step");
                    start.elapsed().as_secs_f64()
                })
                .collect(),
        );
        (ram_secs, swap_secs)
    })
    .pop()
    .expect("one rank")
    .expect("the rank ran");

    let json = serde_json_like(&[
        ("state_bytes", bytes.to_string()),
        ("elements", len.to_string()),
        ("tile", plan.tile().to_string()),
        ("reps", args.reps.to_string()),
        (
            "raw_write_gb_per_s",
            format!("{:.4}", gbps(bytes, raw_write)),
        ),
        ("raw_read_gb_per_s", format!("{:.4}", gbps(bytes, raw_read))),
        ("swap_passes", format!("[{}]", passes.join(", "))),
        ("adam_in_memory_seconds", format!("{ram_secs:.4}")),
        ("adam_swapped_seconds", format!("{swap_secs:.4}")),
        ("adam_swapped_engine", format!("\"{}\"", engines[0].name())),
        (
            "adam_swapped_efficiency",
            format!("{:.4}", disk_secs / swap_secs),
        ),
    ]);
    if args.json {
        println!("{json}");
    } else {
        println!(
            "state {:.2} GB ({len} elements in tiles of {}), median of {}",
            bytes as f64 / 1e9,
            plan.tile(),
            args.reps
        );
        println!(
            "disk (O_DIRECT, 8 MiB, one thread): write {:.3} GB/s, read {:.3} GB/s",
            gbps(bytes, raw_write),
            gbps(bytes, raw_read)
        );
        for p in &passes {
            println!("swap pass: {p}");
        }
        println!(
            "Adam step: in memory {ram_secs:.3} s, swapped {swap_secs:.3} s ({:.2} of the disk's \
             time to read and write the state)",
            disk_secs / swap_secs
        );
    }
}

/// A JSON object from already-formatted values (the bench has no serde dependency).
fn serde_json_like(fields: &[(&str, String)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!("{{{}}}", body.join(", "))
}
