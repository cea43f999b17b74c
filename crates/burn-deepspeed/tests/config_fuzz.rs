//! Config fuzzing: 10,000 seeded mutations of the published DeepSpeed configs (and the GPT
//! example's) — random keys, wrong types, huge, zero, negative and non-finite numbers —
//! loaded, resolved at several world sizes and checked as `config check` and the engine do.
//! Nothing panics, each case ends promptly, and every refusal names a key.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use burn_deepspeed::config::{EntryPoint, check_supported};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedError};
use serde_json::{Map, Value, json};

const CASES: usize = 10_000;

/// SplitMix64 from `seed`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seeds() -> Vec<Value> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let mut out = Vec::new();
    for dir in ["configs/deepspeed-examples", "examples/gpt/configs"] {
        let mut paths: Vec<_> = std::fs::read_dir(format!("{root}/{dir}"))
            .expect("config directory")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        paths.sort();
        for p in paths {
            let text = std::fs::read_to_string(&p).expect("config");
            out.push(serde_json::from_str(&text).expect("published configs are JSON"));
        }
    }
    assert!(out.len() >= 10, "{} seed configs", out.len());
    out
}

/// A hostile value.
fn wild(rng: &mut Rng) -> Value {
    match rng.below(16) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(1u64 << 63),
        4 => json!(i64::MIN),
        5 => json!(1e308),
        6 => json!(-1e308),
        7 => json!(5e-324),
        8 => json!("NaN"),
        9 => json!("inf"),
        10 => json!(true),
        11 => Value::Null,
        12 => json!([]),
        13 => json!({}),
        14 => json!(0.5),
        _ => json!("auto"),
    }
}

/// Every object in `v`, by JSON pointer.
fn objects(v: &Value, at: String, out: &mut Vec<String>) {
    if let Value::Object(map) = v {
        out.push(at.clone());
        for (k, child) in map {
            objects(child, format!("{at}/{k}"), out);
        }
    }
}

/// Applies one mutation at a random object of `v`.
fn mutate(v: &mut Value, rng: &mut Rng) {
    let mut paths = Vec::new();
    objects(v, String::new(), &mut paths);
    let at = paths[rng.below(paths.len())].clone();
    let Some(Value::Object(map)) = v.pointer_mut(&at) else {
        return;
    };
    let keys: Vec<String> = map.keys().cloned().collect();
    match rng.below(4) {
        // A known key gets a hostile value.
        0 | 1 if !keys.is_empty() => {
            let k = &keys[rng.below(keys.len())];
            map.insert(k.clone(), wild(rng));
        }
        // A key is dropped.
        2 if !keys.is_empty() => {
            map.remove(&keys[rng.below(keys.len())]);
        }
        // A new key: a known one with a typo, or a well-known top-level one.
        _ => {
            let key = match (rng.below(3), keys.is_empty()) {
                (0, false) => {
                    let mut k = keys[rng.below(keys.len())].clone();
                    k.insert(rng.below(k.len() + 1), 'x');
                    k
                }
                _ => [
                    "train_batch_size",
                    "zero_optimization",
                    "optimizer",
                    "fp16",
                    "stage",
                ][rng.below(5)]
                .to_string(),
            };
            let value = if rng.below(4) == 0 {
                Value::Object(Map::new())
            } else {
                wild(rng)
            };
            map.insert(key, value);
        }
    }
}

/// Whether a refusal names the key (or, for the batch sizes, the keys) it is about.
fn names_a_key(e: &DeepSpeedError) -> bool {
    match e {
        DeepSpeedError::UnknownKey { path, .. } | DeepSpeedError::InvalidValue { path, .. } => {
            !path.is_empty()
        }
        DeepSpeedError::Unsupported { key, .. } => !key.is_empty(),
        DeepSpeedError::BatchSize(m) => {
            m.contains("batch_size") || m.contains("gradient_accumulation_steps")
        }
        _ => false,
    }
}

#[test]
fn ten_thousand_mutated_configs_never_panic_and_name_the_key() {
    let seeds = seeds();
    let mut rng = Rng(0xC0FF_EE00);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for case in 0..CASES {
        let mut config = seeds[rng.below(seeds.len())].clone();
        for _ in 0..1 + rng.below(3) {
            mutate(&mut config, &mut rng);
        }
        let text = config.to_string();
        let world = [1usize, 2, 3, 8][rng.below(4)];
        let start = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            DeepSpeedConfig::from_json_str(&text).and_then(|(mut c, _)| {
                c.resolve(world)?;
                check_supported(&c, EntryPoint::Engine)?;
                Ok(c.to_json_pretty())
            })
        }));
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "case {case} took {took:?}: {text}"
        );
        match outcome {
            Err(_) => panic!("case {case} panicked (world {world}): {text}"),
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(e)) => {
                assert!(names_a_key(&e), "case {case}: `{e}` names no key: {text}");
                refused += 1;
            }
        }
    }
    println!("config fuzz: {CASES} cases, {accepted} accepted, {refused} refused, 0 panics");
    assert!(accepted > 0 && refused > 0);
}
