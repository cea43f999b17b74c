//! `kernel-bench`: throughput of the CPU kernels against the memory bandwidth and Burn's own
//! AdamW, measured in one run.
//!
//! cargo bench -p burn-deepspeed-cubecl-kernels --bench kernel-bench -- [--params N]
//! [--reps R] [--json] [--device wgpu|cuda]
//!
//! `--device` (with the `wgpu` or `cuda` feature) adds the CubeCL kernels on that device:
//! fused AdamW against a device copy of the same bytes, both timed to completion.
//!
//! Every figure is the median of `reps` timed repetitions after one warm-up. Bandwidths count
//! the bytes each pass must move: AdamW 28 per fp32 parameter (read p, g, m, v; write p, m,
//! v), a copy 8 per value (read and write), quantization 4 in and 1 (int8) or ½ (int4) out per
//! value, the 1-bit compression 4 (x) + 8 (error in and out) + ⅛ (signs) per value.
//! The fused dequantize-matmul (int8 and int4 weights, groups of 64) is timed against Burn's
//! f32 matmul on Flex for a 1024 x 4096 layer at 4 rows (a decode step) and 256 (a prefill),
//! the three in turn within each repetition: each then finds its weight out of cache, as a
//! model's layers find theirs (timed back to back, Burn's 16 MB f32 weight stays in the L3).
//! `scripts/bench-kernels.sh` writes the kernel section of BENCHMARKS.md from `--json`.

use std::time::Instant;

use burn::module::{Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::adam::{AdamParams, adam_step};
use burn_deepspeed_cubecl_kernels::fill::uniform as values;
use burn_deepspeed_cubecl_kernels::qmatmul::dequant_matmul;
use burn_deepspeed_cubecl_kernels::quantize::{Bits, Quantized, Quantizer, Scheme};
use burn_deepspeed_cubecl_kernels::sign::{onebit_compress, packed_len};
use rayon::prelude::*;

#[derive(Module, Debug)]
struct Flat {
    w: Param<Tensor<1>>,
}

struct Args {
    params: usize,
    reps: usize,
    json: bool,
    device: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        params: 1 << 24,
        reps: 7,
        json: false,
        device: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse::<f64>()
                .map(|x| x as usize)
                .map_err(|e| format!("{name} {v}: {e}"))
        };
        match a.as_str() {
            "--params" => args.params = value("--params")?,
            "--reps" => args.reps = value("--reps")?.max(1),
            "--json" => args.json = true,
            "--device" => args.device = Some(it.next().ok_or("--device needs a value")?),
            // `cargo bench` passes `--bench` to every bench target.
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.params == 0 {
        return Err("--params must be at least 1".into());
    }
    Ok(args)
}

/// Median seconds of `reps` runs of `f` after one warm-up; `setup` runs untimed before each.
fn time<S, F: FnMut(S)>(reps: usize, mut setup: impl FnMut() -> S, mut f: F) -> f64 {
    let s = setup();
    f(s);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let s = setup();
            let t = Instant::now();
            f(s);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn gbps(bytes: f64, seconds: f64) -> f64 {
    bytes / seconds / 1e9
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kernel-bench: {e}");
            std::process::exit(2);
        }
    };
    let n = args.params;
    let reps = args.reps;
    let nf = n as f64;

    // A parallel copy as large as the four buffers the optimizer reads, as the bandwidth
    // bound: one large `memcpy` per thread, so the C library can use streaming stores.
    let src = values(4 * n, 1);
    let mut dst = vec![0.0f32; 4 * n];
    let per_thread = (4 * n).div_ceil(rayon::current_num_threads());
    let copy = time(
        reps,
        || (),
        |_| {
            dst.par_chunks_mut(per_thread)
                .zip(src.par_chunks(per_thread))
                .for_each(|(d, s)| d.copy_from_slice(s));
        },
    );
    let memcpy_gbps = gbps(8.0 * 4.0 * nf, copy);
    drop((src, dst));

    // The fused CPU AdamW.
    let h = AdamParams::adamw(1e-3, 0.01);
    let mut p = values(n, 2);
    let g = values(n, 3);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut step = 0;
    let fused = time(
        reps,
        || (),
        |_| {
            step += 1;
            adam_step(&h, step, &mut p, &g, &mut m, &mut v);
        },
    );
    let adamw_gbps = gbps(28.0 * nf, fused);
    drop((p, m, v));

    // Burn's AdamW through ModuleOptimizer on Flex, same parameters and hyper-parameters.
    // The module lives on the autodiff device, as in training; gradients on the plain one.
    let device = Device::flex();
    let mut module = Some(Flat {
        w: Param::from_tensor(Tensor::<1>::from_data(
            TensorData::new(values(n, 2), [n]),
            &device.clone().autodiff(),
        )),
    });
    let mut optim: ModuleOptimizer = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init();
    let grad = Tensor::<1>::from_data(TensorData::new(g.clone(), [n]), &device);
    // The optimizer keeps the parameter's id across steps.
    let id = module.as_ref().map(|m| m.w.id).expect("module");
    let burn = time(
        reps,
        || {
            let mut grads = GradientsParams::new();
            grads.register::<1>(id, grad.clone());
            grads
        },
        |grads| {
            let m = optim.step(1e-3, module.take().expect("module"), grads);
            // Burn may run lazily: reading one value waits for the step.
            let _ = m.w.val().slice(0..1).into_data();
            module = Some(m);
        },
    );
    let burn_adamw_gbps = gbps(28.0 * nf, burn);
    drop((module, optim, grad));

    // Group-wise quantization (groups of 2048) and the 1-bit compression.
    let x = values(n, 4);
    let quantize = |bits: Bits, out_bytes: f64| {
        let q = Quantizer::new(bits, Scheme::Symmetric, 2048).expect("valid quantizer");
        let mut last = None;
        let t = time(reps, || (), |_| last = Some(q.quantize(&x)));
        let quantized = last.expect("ran");
        let mut y = vec![0.0f32; n];
        let d = time(reps, || (), |_| quantized.dequantize_into(&mut y));
        (
            gbps((4.0 + out_bytes) * nf, t),
            gbps((4.0 + out_bytes) * nf, d),
        )
    };
    let (quantize_int8_gbps, dequantize_int8_gbps) = quantize(Bits::Int8, 1.0);
    let (quantize_int4_gbps, dequantize_int4_gbps) = quantize(Bits::Int4, 0.5);
    let mut error = vec![0.0f32; n];
    let mut packed = vec![0u8; packed_len(n)];
    let compress = time(
        reps,
        || (),
        |_| {
            let _ = onebit_compress(&x, &mut error, &mut packed);
        },
    );
    let onebit_compress_gbps = gbps((12.0 + 0.125) * nf, compress);

    let device = match &args.device {
        Some(name) => match on_device(name, n, reps) {
            Ok(figures) => Some(figures),
            Err(e) => {
                eprintln!("kernel-bench: {e}");
                std::process::exit(2);
            }
        },
        None => None,
    };

    let qmatmul = qmatmul_figures(reps);

    let threads = rayon::current_num_threads();
    let mut report = format!(
        concat!(
            "{{\"params\":{},\"reps\":{},\"threads\":{},\"memcpy_gbps\":{:.3},",
            "\"adamw_gbps\":{:.3},\"burn_adamw_gbps\":{:.3},\"adamw_over_memcpy\":{:.3},",
            "\"adamw_over_burn\":{:.3},\"adamw_ms\":{:.3},\"burn_adamw_ms\":{:.3},",
            "\"quantize_int8_gbps\":{:.3},\"dequantize_int8_gbps\":{:.3},",
            "\"quantize_int4_gbps\":{:.3},\"dequantize_int4_gbps\":{:.3},",
            "\"onebit_compress_gbps\":{:.3}}}"
        ),
        n,
        reps,
        threads,
        memcpy_gbps,
        adamw_gbps,
        burn_adamw_gbps,
        adamw_gbps / memcpy_gbps,
        adamw_gbps / burn_adamw_gbps,
        fused * 1e3,
        burn * 1e3,
        quantize_int8_gbps,
        dequantize_int8_gbps,
        quantize_int4_gbps,
        dequantize_int4_gbps,
        onebit_compress_gbps,
    );
    if !args.json {
        println!("kernel-bench: {n} parameters, {threads} threads, median of {reps}");
        println!("  memcpy            {memcpy_gbps:8.2} GB/s");
        println!(
            "  fused AdamW       {adamw_gbps:8.2} GB/s ({:.2} of memcpy, {:.2}x Burn's)",
            adamw_gbps / memcpy_gbps,
            adamw_gbps / burn_adamw_gbps
        );
        println!("  Burn AdamW        {burn_adamw_gbps:8.2} GB/s");
        println!(
            "  int8 quantize     {quantize_int8_gbps:8.2} GB/s, dequantize {dequantize_int8_gbps:.2}"
        );
        println!(
            "  int4 quantize     {quantize_int4_gbps:8.2} GB/s, dequantize {dequantize_int4_gbps:.2}"
        );
        println!("  1-bit compress    {onebit_compress_gbps:8.2} GB/s");
    }
    if !args.json {
        for q in &qmatmul {
            println!(
                "  [{}, {}] x [{}, {}]: Burn f32 matmul {:.3} ms, fused int8 {:.3} ms ({:.2}x), int4 {:.3} ms ({:.2}x)",
                q.m,
                q.k,
                q.k,
                q.n,
                q.burn_ms,
                q.int8_ms,
                q.burn_ms / q.int8_ms,
                q.int4_ms,
                q.burn_ms / q.int4_ms
            );
        }
    }
    report.pop();
    let rows: Vec<String> = qmatmul
        .iter()
        .map(|q| {
            format!(
                concat!(
                    "{{\"m\":{},\"k\":{},\"n\":{},\"burn_f32_ms\":{:.4},\"int8_ms\":{:.4},",
                    "\"int4_ms\":{:.4},\"int8_over_burn\":{:.3},\"int4_over_burn\":{:.3}}}"
                ),
                q.m,
                q.k,
                q.n,
                q.burn_ms,
                q.int8_ms,
                q.int4_ms,
                q.burn_ms / q.int8_ms,
                q.burn_ms / q.int4_ms
            )
        })
        .collect();
    report.push_str(&format!(",\"qmatmul\":[{}]}}", rows.join(",")));
    if let Some(d) = device {
        if !args.json {
            println!(
                "  {}: copy {:.2} GB/s, fused AdamW {:.2} GB/s ({:.2} of copy, {:.3} ms)",
                d.name,
                d.copy_gbps,
                d.adamw_gbps,
                d.adamw_gbps / d.copy_gbps,
                d.adamw_s * 1e3
            );
        }
        report.pop();
        report.push_str(&format!(
            concat!(
                ",\"device\":\"{}\",\"device_copy_gbps\":{:.3},\"device_adamw_gbps\":{:.3},",
                "\"device_adamw_over_copy\":{:.3},\"device_adamw_ms\":{:.4}}}"
            ),
            d.name,
            d.copy_gbps,
            d.adamw_gbps,
            d.adamw_gbps / d.copy_gbps,
            d.adamw_s * 1e3
        ));
    }
    println!("{report}");
}

/// The fused dequantize-matmul against Burn's f32 matmul (Flex) on one shape.
struct QMatmul {
    m: usize,
    k: usize,
    n: usize,
    burn_ms: f64,
    int8_ms: f64,
    int4_ms: f64,
}

/// `[m, k] x [k, n]` for a decode step (4 rows) and a prefill (256 rows) of a 1024 x 4096
/// layer: Burn's f32 matmul on Flex, and the fused dequantize-matmul of the same weight
/// quantized to int8 and int4 (asymmetric, groups of 64). The three run in turn within each
/// repetition (so that a noisy neighbour slows all three alike), and each takes its median.
fn qmatmul_figures(reps: usize) -> Vec<QMatmul> {
    let (k, n) = (1024, 4096);
    let weight = values(k * n, 7);
    let device = Device::flex();
    let w = Tensor::<2>::from_data(TensorData::new(weight.clone(), [k, n]), &device);
    let quantized = |bits| {
        Quantizer::new(bits, Scheme::Asymmetric, 64)
            .expect("valid")
            .quantize(&weight)
    };
    let (q8, q4) = (quantized(Bits::Int8), quantized(Bits::Int4));
    [4usize, 256]
        .into_iter()
        .map(|m| {
            let xv = values(m * k, 8);
            let x = Tensor::<2>::from_data(TensorData::new(xv.clone(), [m, k]), &device);
            let mut out = vec![0.0f32; m * n];
            let mut times = [Vec::new(), Vec::new(), Vec::new()];
            for rep in 0..=reps {
                let (a, b) = (x.clone(), w.clone());
                let t = Instant::now();
                drop(a.matmul(b));
                let burn = t.elapsed().as_secs_f64();
                let mut fused = |q: &Quantized| {
                    let t = Instant::now();
                    dequant_matmul(&xv, m, q, k, n, &mut out).expect("shapes");
                    t.elapsed().as_secs_f64()
                };
                let (int8, int4) = (fused(&q8), fused(&q4));
                // The first round warms the caches and the thread pool.
                if rep > 0 {
                    for (v, t) in times.iter_mut().zip([burn, int8, int4]) {
                        v.push(t);
                    }
                }
            }
            let [burn, int8, int4] = times.map(|mut v| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            });
            QMatmul {
                m,
                k,
                n,
                burn_ms: burn * 1e3,
                int8_ms: int8 * 1e3,
                int4_ms: int4 * 1e3,
            }
        })
        .collect()
}

/// Figures of the CubeCL kernels on one device.
struct DeviceFigures {
    name: String,
    copy_gbps: f64,
    adamw_gbps: f64,
    adamw_s: f64,
}

#[cfg(feature = "cube")]
fn on_device(name: &str, n: usize, reps: usize) -> Result<DeviceFigures, String> {
    use burn_deepspeed_cubecl_kernels::cube::{adam, copy, upload};

    let device = match name {
        #[cfg(feature = "wgpu")]
        "wgpu" => cubecl::Device::Wgpu(Default::default()),
        #[cfg(feature = "cuda")]
        "cuda" => cubecl::Device::cuda(0).map_err(|e| format!("no CUDA device: {e:?}"))?,
        other => return Err(format!("--device {other}: not a runtime this build has")),
    };
    let client = device.client();
    // A copy of as many bytes as the optimizer reads, timed to completion.
    let src = upload(&client, &values(4 * n, 1));
    let dst = client.empty(16 * n);
    copy::copy(&client, 4 * n, &src, &dst).map_err(|e| e.to_string())?;
    let copy_s = time(
        reps,
        || (),
        |_| {
            copy::copy(&client, 4 * n, &src, &dst).expect("sizes checked above");
            copy::wait(&client);
        },
    );
    drop((src, dst));
    let h = AdamParams::adamw(1e-3, 0.01);
    let p = upload(&client, &values(n, 2));
    let g = upload(&client, &values(n, 3));
    let zeros = vec![0.0f32; n];
    let (m, v) = (upload(&client, &zeros), upload(&client, &zeros));
    adam::adam_step::<f32>(&client, &h, 1, n, [&p, &g, &m, &v]).map_err(|e| e.to_string())?;
    let mut step = 1;
    let adamw_s = time(
        reps,
        || (),
        |_| {
            step += 1;
            adam::adam_step::<f32>(&client, &h, step, n, [&p, &g, &m, &v])
                .expect("sizes checked above");
            copy::wait(&client);
        },
    );
    Ok(DeviceFigures {
        name: format!("{name} ({})", client.name()).replace(['"', '\\'], "'"),
        copy_gbps: gbps(8.0 * 4.0 * n as f64, copy_s),
        adamw_gbps: gbps(28.0 * n as f64, adamw_s),
        adamw_s,
    })
}

#[cfg(not(feature = "cube"))]
fn on_device(name: &str, _n: usize, _reps: usize) -> Result<DeviceFigures, String> {
    Err(format!(
        "--device {name}: built without a CubeCL runtime (use --features wgpu or cuda)"
    ))
}
