//! Every [`Place`] operation against a plain f32/f64 reference on the host, for any place on
//! any device: the tests run it on [`HostPlace`](super::HostPlace), on
//! [`DevicePlace`](super::DevicePlace) over Flex, and with feature `wgpu` over wgpu.

use std::ops::Range;
use std::sync::Arc;

use super::Place;
use crate::comm::{Communicator, ReduceOp, ThreadWorld, ThreadWorldOptions};
use crate::compressed::reference::{Dense, input};
use crate::compressed::{CompressionErrors, compressed_all_reduce};

/// Irregular values, none of them 0.
fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 1.37 + salt as f32 * 0.71).sin() + 1.5) * 0.8)
        .collect()
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).abs() > tol * w.abs().max(1.0) {
            return Err(format!("{what}: value {i} is {g}, expected {w}"));
        }
    }
    Ok(())
}

/// Every element-wise and per-range operation of `place` against loops on the host.
pub(crate) fn elementwise<P: Place>(place: &P) -> Result<(), String> {
    let n = 37;
    let (a, b) = (values(n, 1), values(n, 2));
    let (pa, pb) = (place.upload(a.clone()), place.upload(b.clone()));
    let read = |buf: P::Buf| place.download(&buf).map_err(|e| e.to_string());
    let each = |f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        a.iter().zip(&b).map(|(&a, &b)| f(a, b)).collect()
    };
    let tol = 1e-6;
    close("upload/download", &read(pa.clone())?, &a, 0.0)?;
    close(
        "add",
        &read(place.add(pa.clone(), &pb))?,
        &each(&|a, b| a + b),
        tol,
    )?;
    close(
        "sub",
        &read(place.sub(pa.clone(), &pb))?,
        &each(&|a, b| a - b),
        tol,
    )?;
    close(
        "mul",
        &read(place.mul(pa.clone(), &pb))?,
        &each(&|a, b| a * b),
        tol,
    )?;
    close(
        "div",
        &read(place.div(pa.clone(), &pb))?,
        &each(&|a, b| a / b),
        tol,
    )?;
    close(
        "scaled",
        &read(place.scaled(pa.clone(), 0.3))?,
        &each(&|a, _| a * 0.3),
        tol,
    )?;
    close(
        "div_scalar",
        &read(place.div_scalar(pa.clone(), 0.3))?,
        &each(&|a, _| a / 0.3),
        tol,
    )?;
    close(
        "add_scalar",
        &read(place.add_scalar(pa.clone(), 0.3))?,
        &each(&|a, _| a + 0.3),
        tol,
    )?;
    close(
        "sqrt",
        &read(place.sqrt(pa.clone()))?,
        &each(&|a, _| a.sqrt()),
        tol,
    )?;
    let want = each(&|a, b| a - 0.3 * b);
    close(
        "add_scaled",
        &read(place.add_scaled(pa.clone(), &pb, -0.3))?,
        &want,
        tol,
    )?;
    let want = each(&|a, b| 0.9 * a + 0.1 * b);
    close("ema", &read(place.ema(pa.clone(), &pb, 0.9))?, &want, tol)?;
    let want = each(&|a, b| 0.9 * a + 0.1 * b * b);
    close(
        "ema_sq",
        &read(place.ema_sq(pa.clone(), &pb, 0.9))?,
        &want,
        tol,
    )?;
    close("slice", &read(place.slice(&pa, 3..9))?, &a[3..9], 0.0)?;
    let joined = place.cat(vec![place.slice(&pa, 0..5), place.slice(&pa, 5..n)]);
    close("cat", &read(joined)?, &a, 0.0)?;
    let mut padded = a.clone();
    padded.resize(45, 0.0);
    close("pad", &read(place.pad(pa.clone(), 45))?, &padded, 0.0)?;
    close("zeros", &read(place.zeros(4))?, &[0.0; 4], 0.0)?;

    let sq: f64 = a.iter().map(|&v| v as f64 * v as f64).sum();
    let got = place.squared_norm(&pa).map_err(|e| e.to_string())?;
    if (got - sq).abs() > 1e-5 * sq {
        return Err(format!("squared_norm: {got}, expected {sq}"));
    }
    let ranges: Vec<Range<usize>> = vec![0..10, 10..10, 10..30, 30..n];
    let norm = |r: &Range<usize>| a[r.clone()].iter().map(|v| v * v).sum::<f32>().sqrt();
    let want: Vec<f32> = ranges.iter().map(norm).collect();
    let got = place.norms(&pa, &ranges).map_err(|e| e.to_string())?;
    close("norms", &got, &want, 1e-5)?;
    let max = |r: &Range<usize>| a[r.clone()].iter().fold(0.0f32, |m, &v| m.max(v));
    let want: Vec<f32> = ranges.iter().map(max).collect();
    close(
        "maxes",
        &place.maxes(&pa, &ranges).map_err(|e| e.to_string())?,
        &want,
        0.0,
    )?;
    let f = [0.5f32, 7.0, -2.0, 3.0];
    let per = |op: &dyn Fn(f32, f32, f32) -> f32| -> Vec<f32> {
        let mut out = a.clone();
        for (r, &f) in ranges.iter().zip(&f) {
            r.clone().for_each(|i| out[i] = op(a[i], b[i], f));
        }
        out
    };
    let got = read(place.scale_ranges(pa.clone(), &ranges, &f))?;
    close("scale_ranges", &got, &per(&|a, _, f| a * f), tol)?;
    let got = read(place.div_ranges(pa.clone(), &ranges, &f))?;
    close("div_ranges", &got, &per(&|a, _, f| a / f), tol)?;
    let got = read(place.add_scaled_ranges(pa.clone(), &pb, &ranges, &f))?;
    close("add_scaled_ranges", &got, &per(&|a, b, f| a + f * b), tol)?;
    Ok(())
}

/// The collectives and the compressed all-reduce of the places `make` builds on each rank of
/// a thread world of `world` ranks, against serial references.
pub(crate) fn collectives<P: Place>(
    world: usize,
    make: impl Fn(Arc<dyn Communicator>) -> P + Sync,
) -> Result<(), String> {
    let n = 1000;
    let rounds = 3;
    let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
        let rank = c.rank();
        let place = make(Arc::new(c));
        let read = |buf: &P::Buf| place.download(buf).map_err(|e| e.to_string());
        let sum = place
            .all_reduce(place.upload(input(rank, n, 9)), ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let mut errors = CompressionErrors::new(&place, n);
        let mut reduced = Vec::new();
        for round in 0..rounds {
            let buf = place.upload(input(rank, n, round));
            let got = compressed_all_reduce(&place, buf, &mut errors).map_err(|e| e.to_string())?;
            reduced.push(read(&got)?);
        }
        Ok::<_, String>((read(&sum)?, reduced, place.sign_padded_len(n)))
    });
    let mut dense: Option<Dense> = None;
    let mut want_rounds = Vec::new();
    for (r, result) in out.into_iter().enumerate() {
        let (sum, reduced, padded) = result.map_err(|e| format!("rank {r}: {e:?}"))??;
        let want: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|q| input(q, n, 9)[i]).sum())
            .collect();
        close(&format!("all_reduce, rank {r}"), &sum, &want, 1e-6)?;
        if dense.is_none() {
            let mut d = Dense::padded(padded, world);
            for round in 0..rounds {
                let inputs: Vec<Vec<f32>> = (0..world).map(|q| input(q, n, round)).collect();
                want_rounds.push(d.step(&inputs, n).into_iter().map(|v| v as f32).collect());
            }
            dense = Some(d);
        }
        for (round, got) in reduced.iter().enumerate() {
            let want: &Vec<f32> = &want_rounds[round];
            close(
                &format!("compressed all-reduce, rank {r}, round {round}"),
                got,
                want,
                1e-5,
            )?;
        }
    }
    Ok(())
}
