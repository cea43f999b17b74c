//! The printed profile, laid out as DeepSpeed's `print_model_profile`: a summary, the
//! aggregated profile (the top modules by parameters, MACs and latency at each depth), and
//! the detailed module tree with each module's share of the whole.

use std::fmt::Write as _;

use super::base::ModelProfile;
use super::tree::ModuleProfile;

/// `value` with a decimal prefix (`1.23 M`), DeepSpeed's `number_to_string` style.
pub fn si(value: f64, unit: &str) -> String {
    let (scaled, prefix) = match value.abs() {
        v if v >= 1e12 => (value / 1e12, "T"),
        v if v >= 1e9 => (value / 1e9, "G"),
        v if v >= 1e6 => (value / 1e6, "M"),
        v if v >= 1e3 => (value / 1e3, "K"),
        _ => (value, ""),
    };
    format!("{scaled:.2} {prefix}{unit}").trim_end().to_string()
}

/// One depth's modules of one type, summed.
#[derive(Default)]
struct Aggregate {
    kind: String,
    params: u64,
    macs: u64,
    /// Summed over the modules measured (`None`: none was).
    latency: Option<std::time::Duration>,
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

impl ModelProfile {
    /// The profile as text (what the engine prints at `profile_step`, or writes to
    /// `output_file`).
    pub fn report(&self) -> String {
        let mut s = String::new();
        let root = &self.root;
        let line = |s: &mut String, name: &str, value: String| {
            let _ = writeln!(s, "{name:<60} {value}");
        };
        let _ = writeln!(s, "{:-^80}", " burn-deepspeed flops profiler ");
        let _ = writeln!(s, "forward profile of `{}`", root.kind);
        line(&mut s, "params:", si(root.params as f64, ""));
        line(&mut s, "fwd MACs:", si(root.macs as f64, "MACs"));
        line(&mut s, "fwd flops:", si(root.flops as f64, "FLOPs"));
        line(
            &mut s,
            "fwd latency:",
            format!("{:.2} ms", self.fwd_latency.as_secs_f64() * 1e3),
        );
        line(
            &mut s,
            "fwd FLOPS = fwd flops / fwd latency:",
            si(self.fwd_flops_per_s(), "FLOPS"),
        );
        line(
            &mut s,
            &format!(
                "bwd flops = {} x fwd flops:",
                2.0 + self.options.recompute_fwd_factor
            ),
            si(self.bwd_flops() as f64, "FLOPs"),
        );
        if let Some(step) = &self.step {
            let ms = |d: std::time::Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
            let per_micro = |d: std::time::Duration| d / step.micro_batches.max(1) as u32;
            if let (Some(f), Some(b)) = (step.fwd, step.bwd) {
                let (f, b) = (per_micro(f), per_micro(b));
                line(&mut s, "fwd latency in training (per micro-batch):", ms(f));
                line(&mut s, "bwd latency in training (per micro-batch):", ms(b));
                let bwd_flops = self.bwd_flops() as f64 / b.as_secs_f64().max(1e-12);
                line(
                    &mut s,
                    "bwd FLOPS = bwd flops / bwd latency:",
                    si(bwd_flops, "FLOPS"),
                );
            }
            line(&mut s, "iter latency (the whole step):", ms(step.step));
            let iter = step.step.as_secs_f64().max(1e-12);
            let total = (self.flops() + self.bwd_flops()) as f64 * step.micro_batches as f64;
            line(
                &mut s,
                "FLOPS = (fwd + bwd flops) x micro-batches / iter latency:",
                si(total / iter, "FLOPS"),
            );
            line(
                &mut s,
                "samples/second:",
                format!("{:.2}", step.samples as f64 / iter),
            );
        }
        let _ = writeln!(s, "by operation:");
        for (op, cost) in &self.by_op {
            let _ = writeln!(
                s,
                "    {op:<20} {:>14} {:>14} ({:.2}% of flops)",
                si(cost.macs as f64, "MACs"),
                si(cost.flops as f64, "FLOPs"),
                pct(cost.flops, root.flops)
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "{:-^80}", " aggregated profile ");
        let _ = writeln!(
            s,
            "top {} module(s) by params, MACs and measured fwd latency at each depth:",
            self.options.top_modules
        );
        let walk = root.walk();
        let max_depth = walk.iter().map(|(d, _)| *d).max().unwrap_or(0);
        let shown = match self.options.module_depth {
            d if d < 0 => max_depth,
            d => (d as usize).min(max_depth),
        };
        for depth in 0..=shown {
            // Modules of one depth, summed by type (DeepSpeed aggregates by class name).
            let mut by_kind: Vec<Aggregate> = Vec::new();
            for (_, m) in walk.iter().filter(|(d, _)| *d == depth) {
                let i = match by_kind.iter().position(|e| e.kind == m.kind) {
                    Some(i) => i,
                    None => {
                        by_kind.push(Aggregate {
                            kind: m.kind.clone(),
                            ..Aggregate::default()
                        });
                        by_kind.len() - 1
                    }
                };
                let e = &mut by_kind[i];
                e.params += m.params;
                e.macs += m.macs;
                if let Some(l) = m.latency {
                    e.latency = Some(e.latency.unwrap_or_default() + l);
                }
            }
            let top = |key: &dyn Fn(&Aggregate) -> Option<f64>, show: &dyn Fn(f64) -> String| {
                let mut v: Vec<(&str, f64)> = by_kind
                    .iter()
                    .filter_map(|e| key(e).map(|k| (e.kind.as_str(), k)))
                    .collect();
                v.sort_by(|a, b| b.1.total_cmp(&a.1));
                v.iter()
                    .take(self.options.top_modules)
                    .map(|(kind, k)| format!("{kind}: {}", show(*k)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(s, "depth {depth}:");
            let params = top(&|e| Some(e.params as f64), &|v| si(v, ""));
            let _ = writeln!(s, "    params      - {params}");
            let macs = top(&|e| Some(e.macs as f64), &|v| si(v, "MACs"));
            let _ = writeln!(s, "    MACs        - {macs}");
            let latency = top(&|e| e.latency.map(|l| l.as_secs_f64()), &|v| {
                format!("{:.2} ms", v * 1e3)
            });
            if !latency.is_empty() {
                let _ = writeln!(s, "    fwd latency - {latency}");
            }
        }
        if self.options.detailed {
            let _ = writeln!(s);
            let _ = writeln!(s, "{:-^80}", " detailed profile ");
            let _ = writeln!(
                s,
                "each module: params (share of the model's), MACs (share), flops (share), \
                 latency where measured"
            );
            detailed(&mut s, root, root, 0, shown);
        }
        if !self.unmatched_scopes.is_empty() {
            let _ = writeln!(
                s,
                "scopes naming no module (not reported): {}",
                self.unmatched_scopes.join(", ")
            );
        }
        let _ = writeln!(s, "{:-^80}", "");
        s
    }
}

fn detailed(s: &mut String, m: &ModuleProfile, root: &ModuleProfile, depth: usize, max: usize) {
    let latency = m.latency.map_or(String::new(), |l| {
        let secs = l.as_secs_f64();
        format!(
            ", {:.2} ms, {}",
            secs * 1e3,
            si(m.flops as f64 / secs.max(1e-12), "FLOPS")
        )
    });
    let label = match depth {
        0 => m.kind.clone(),
        _ => format!("({}): {}", m.name, m.kind),
    };
    let _ = writeln!(
        s,
        "{}{label}({} = {:.2}% params, {} = {:.2}% MACs, {} = {:.2}% flops{latency})",
        "  ".repeat(depth),
        si(m.params as f64, ""),
        pct(m.params, root.params),
        si(m.macs as f64, "MACs"),
        pct(m.macs, root.macs),
        si(m.flops as f64, "FLOPs"),
        pct(m.flops, root.flops),
    );
    if depth < max {
        for c in &m.children {
            detailed(s, c, root, depth + 1, max);
        }
    }
}
