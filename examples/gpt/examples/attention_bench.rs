//! Attention on the CPU, forward and backward: the GPT's decomposition (scores kept for the
//! backward) against the blockwise attention's kernel, alternating in one process.
//!
//! cargo run --release --example attention_bench -- [--reps 15] [--json]

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use burn_deepspeed::fused::{attention_keeping_scores, blockwise_attention};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Timed repetitions of each, after one untimed.
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    let device = Device::flex().autodiff();
    let mut rows = Vec::new();
    // (name, batch, heads, positions, d_head): GPT `tiny` and `small` at 16 sequences.
    for (name, b, h, t, d) in [("tiny", 16, 4, 128, 32), ("small", 16, 8, 256, 32)] {
        let x = || {
            Tensor::<4>::random([b, t, h, d], Distribution::Normal(0.0, 1.0), &device)
                .swap_dims(1, 2)
        };
        let (q, k, v, w) = (x(), x(), x(), x());
        let mut times = [(Vec::new(), Vec::new()), (Vec::new(), Vec::new())];
        for rep in 0..=args.reps {
            for (i, kernel) in [false, true].into_iter().enumerate() {
                let [q, k, v] = [&q, &k, &v].map(|t| t.clone().detach().require_grad());
                let start = Instant::now();
                let y = match kernel {
                    false => attention_keeping_scores(q.clone(), k, v, true),
                    true => blockwise_attention(q.clone(), k, v, true),
                };
                let loss = (y * w.clone()).sum();
                let _ = loss.clone().into_scalar::<f32>();
                let forward = start.elapsed().as_secs_f64();
                let at = Instant::now();
                let grads = loss.backward();
                let _ = q.grad(&grads).map(|g| g.into_data());
                let backward = at.elapsed().as_secs_f64();
                if rep > 0 {
                    times[i].0.push(forward * 1e3);
                    times[i].1.push(backward * 1e3);
                }
            }
        }
        let [(df, db), (kf, kb)] = times.map(|(f, b)| (median(f), median(b)));
        println!(
            "{name}: decomposition {df:.1} + {db:.1} ms, kernel {kf:.1} + {kb:.1} ms ({:.2}x)",
            (df + db) / (kf + kb)
        );
        rows.push(json!({"model": name, "shape": [b, h, t, d],
            "decomposition_ms": [df, db], "kernel_ms": [kf, kb]}));
    }
    if args.json {
        println!("{}", json!({"rows": rows, "reps": args.reps}));
    }
}
