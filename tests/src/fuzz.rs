//! The config fuzzers' parts: seeded mutations of the published DeepSpeed configs (random
//! keys, wrong types, huge, zero, negative and non-finite numbers), shared by the fuzzer that
//! checks configs (`tests/config_fuzz.rs`) and the one that builds and steps engines from the
//! configs it accepts (`tests/engine_fuzz.rs`).

use burn_deepspeed::DeepSpeedError;
use serde_json::{Map, Value, json};

/// SplitMix64 from `seed`.
pub struct Rng(pub u64);

impl Rng {
    /// The next draw.
    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A draw in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.draw() % n.max(1) as u64) as usize
    }
}

/// The published DeepSpeed configs and the GPT example's, as JSON: the fuzzers' seeds.
pub fn seeds() -> Vec<Value> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
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
pub fn wild(rng: &mut Rng) -> Value {
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

/// Applies one mutation at a random object of `v`: a known key gets a hostile value, a key
/// is dropped, or a key is added (a typo of a known one, or a well-known top-level one).
pub fn mutate(v: &mut Value, rng: &mut Rng) {
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
pub fn names_a_key(e: &DeepSpeedError) -> bool {
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
