//! Engine fuzzing: 2,000 seeded mutations of the published DeepSpeed configs (the mutations of
//! `config_fuzz.rs`), and every one the config accepts builds an engine (data-parallel, or
//! pipelined when it names stages; on the grid its `tp_size` asks for; a GPT-MoE with expert
//! parallelism in some cases) on a tiny GPT in the thread world and runs one optimizer step.
//! Nothing panics, aborts or hangs: each case either steps or returns an error.
//!
//! The seeds are the published configs and, for ZeRO stages 2 and 3, the same with the
//! optimizer state (and at stage 3 the parameters) offloaded to host memory or a swap file.
//! Two inputs are bounded so that a case stays small, as a test must: swap folders
//! (`nvme_path`) point into a temporary folder, and the batch keys are cut to at most 2
//! sequences per micro-batch and 2 micro-batches per step after the config accepted them
//! (the batch sizes themselves are fuzzed by `config_fuzz.rs`).

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::config::{EntryPoint, check_supported};
use burn_deepspeed_example_gpt::model::{GptShape, MoeShape};
use burn_deepspeed_example_gpt::run::{RunSpec, run_in_threads};
use burn_deepspeed_tests::fuzz::{Rng, mutate, seeds};
use serde_json::{Value, json};

const CASES: usize = 2_000;

/// A case that runs longer than this has hung.
const HANG: Duration = Duration::from_secs(60);

/// Points every `nvme_path` under `v` into `dir`.
fn swap_into(v: &mut Value, dir: &Path) {
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                if k == "nvme_path" && child.is_string() {
                    *child = Value::String(dir.display().to_string());
                } else {
                    swap_into(child, dir);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|c| swap_into(c, dir)),
        _ => {}
    }
}

/// The config of `text` as the engine sees it at `world` ranks, with at most 2 sequences per
/// micro-batch and 2 micro-batches per step; `None` when the config refuses it.
fn accepted(text: &str, world: usize) -> Option<DeepSpeedConfig> {
    let (mut c, _) = DeepSpeedConfig::from_json_str(text).ok()?;
    c.resolve(world).ok()?;
    check_supported(&c, EntryPoint::Engine).ok()?;
    // The engine resolves the batch again for its data-parallel size.
    c.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu.map(|n| n.min(2));
    c.gradient_accumulation_steps = c.gradient_accumulation_steps.map(|n| n.min(2));
    c.train_batch_size = None;
    Some(c)
}

/// The kinds of engine `config` builds, among those the fuzzer counts.
fn kinds(config: &DeepSpeedConfig, moe: bool) -> Vec<&'static str> {
    let json: Value = serde_json::from_str(&config.to_json_pretty()).unwrap_or_default();
    let on = |pointer: &str| {
        json.pointer(pointer)
            .is_some_and(|v| v.as_bool() == Some(true))
    };
    let above_one = |pointer: &str| json.pointer(pointer).and_then(Value::as_u64).unwrap_or(1) > 1;
    let offload = ["offload_optimizer", "offload_param"].iter().any(|k| {
        let device = json.pointer(&format!("/zero_optimization/{k}/device"));
        device.and_then(Value::as_str).is_some_and(|d| d != "none")
    });
    [
        ("offload", offload),
        (
            "pipeline",
            json.pointer("/pipeline/stages")
                .is_some_and(|v| !v.is_null()),
        ),
        ("grid", above_one("/tensor_parallel/tp_size")),
        ("moe", moe),
        ("16-bit", on("/fp16/enabled") || on("/bf16/enabled")),
    ]
    .into_iter()
    .filter_map(|(k, yes)| yes.then_some(k))
    .collect()
}

/// A GPT small enough to build and step in milliseconds; a GPT-MoE (2 experts, top-1) when
/// `moe`.
fn tiny(moe: bool) -> GptShape {
    GptShape {
        d_model: 16,
        layers: 2,
        heads: 2,
        seq_len: 8,
        moe: moe.then_some(MoeShape {
            experts: 2,
            k: 1,
            residual: false,
            pyramid: None,
        }),
    }
}

/// The published configs, and each ZeRO stage 2 or 3 one again with its optimizer state
/// offloaded to host memory and to a swap file (stage 3: its parameters too), which no
/// published config does.
fn with_offload(seeds: Vec<Value>) -> Vec<Value> {
    let mut out = seeds.clone();
    for seed in seeds {
        let stage = seed
            .pointer("/zero_optimization/stage")
            .and_then(Value::as_u64);
        let Some(stage @ (2 | 3)) = stage else {
            continue;
        };
        for device in ["cpu", "nvme"] {
            let mut c = seed.clone();
            let place = json!({"device": device, "nvme_path": "swap"});
            let zero = &mut c["zero_optimization"];
            zero["offload_optimizer"] = place.clone();
            if stage == 3 {
                zero["offload_param"] = place;
            }
            out.push(c);
        }
    }
    out
}

#[test]
fn two_thousand_mutated_configs_build_engines_that_step_or_refuse() {
    let seeds = with_offload(seeds());
    let swap = tempfile::tempdir().expect("temp dir");
    let mut rng = Rng(0xE61E_F022);
    let (mut stepped, mut refused_by_config, mut refused_by_engine) = (0usize, 0usize, 0usize);
    let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    let mut reasons: Vec<String> = Vec::new();
    let started = Instant::now();
    for case in 0..CASES {
        let mut json = seeds[rng.below(seeds.len())].clone();
        // The seed as published in some cases, so that every kind of engine is built.
        for _ in 0..rng.below(3) {
            mutate(&mut json, &mut rng);
        }
        swap_into(&mut json, swap.path());
        let text = json.to_string();
        let world = [1usize, 2, 4][rng.below(3)];
        let moe = rng.below(4) == 0;
        let ep_size = if moe && world.is_multiple_of(2) && rng.below(2) == 0 {
            2
        } else {
            1
        };
        let Some(config) = accepted(&text, world) else {
            refused_by_config += 1;
            continue;
        };
        let case_kinds = kinds(&config, moe);
        let mut spec = RunSpec::on_embedded_corpus(config, tiny(moe), 1, 3, 7);
        spec.keep_final_state = false;
        spec.ep_size = ep_size;
        let (send, recv) = mpsc::channel();
        std::thread::spawn(move || {
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                run_in_threads(world, &spec, Duration::from_secs(20))
            }));
            let _ = send.send(outcome.map(|r| r.map(|_| ()).map_err(|e| e.to_string())));
        });
        match recv.recv_timeout(HANG) {
            Err(_) => panic!("case {case} hung (world {world}, ep_size {ep_size}): {text}"),
            Ok(Err(_)) => panic!("case {case} panicked (world {world}, ep_size {ep_size}): {text}"),
            Ok(Ok(Ok(()))) => {
                stepped += 1;
                for k in case_kinds {
                    *by_kind.entry(k).or_default() += 1;
                }
            }
            // A rank's panic comes back as the launch's error.
            Ok(Ok(Err(e))) if e.contains("panicked") => {
                panic!("case {case}: {e} (world {world}, ep_size {ep_size}): {text}")
            }
            Ok(Ok(Err(e))) => {
                refused_by_engine += 1;
                if reasons.len() < 5 && !reasons.contains(&e) {
                    reasons.push(e);
                }
            }
        }
    }
    println!(
        "engine fuzz: {CASES} cases in {:.0?}: {stepped} built and stepped, {refused_by_engine} \
         refused by the engine, {refused_by_config} refused by the config, 0 panics, 0 hangs; \
         stepped by kind {by_kind:?}; refusals such as {reasons:?}",
        started.elapsed()
    );
    assert!(stepped > CASES / 10, "only {stepped} cases stepped");
    for kind in ["offload", "pipeline", "grid", "moe", "16-bit"] {
        assert!(
            by_kind.contains_key(kind),
            "no {kind} engine stepped: {by_kind:?}"
        );
    }
}
