//! The book's config reference against the config types: every key the types read has a row,
//! and every row is a key the types read (or a DeepSpeed key that loads with a warning).
//!
//! The keys come from serde itself. Every section refuses unknown fields, and serde's error for
//! one lists the section's fields, so probing a section with a field no type has gives its
//! keys; a key whose probe is not such an error (a number, a list, an enum, a map) is a leaf.

use std::collections::BTreeSet;

use serde_json::json;

use super::DeepSpeedConfig;
use super::warnings::UNIMPLEMENTED_KEYS;

const PROBE: &str = "__no_such_key__";

/// The fields of the section at `path` (dotted), or `None` when it is not a section that
/// lists them.
fn fields_at(path: &[String]) -> Option<Vec<String>> {
    let probe = path
        .iter()
        .rev()
        .fold(json!({ PROBE: 0 }), |inner, key| json!({ key: inner }));
    let error = serde_path_to_error::deserialize::<_, DeepSpeedConfig>(probe).err()?;
    let message = error.into_inner().to_string();
    let list = message.strip_prefix(&format!("unknown field `{PROBE}`, expected "))?;
    Some(
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect(),
    )
}

/// Every key under `path`, sections included, dotted.
fn keys_under(path: &mut Vec<String>, into: &mut BTreeSet<String>) {
    let Some(fields) = fields_at(path) else {
        return;
    };
    for field in fields {
        path.push(field);
        into.insert(path.join("."));
        keys_under(path, into);
        path.pop();
    }
}

/// Every key of the config types, dotted. `compression_training` keeps the sections it does
/// not implement (to warn about them), so serde lists none of its fields: its one implemented
/// section is walked from its own path.
fn every_key() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    keys_under(&mut Vec::new(), &mut keys);
    let mut weights = vec!["compression_training".into(), "weight_quantization".into()];
    keys.insert(weights.join("."));
    keys_under(&mut weights, &mut keys);
    keys
}

/// The first column of every table row of the reference that names a key.
fn reference_rows(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_book_reference_has_a_row_for_every_key() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../book/src/config-reference.md"
    );
    let text = std::fs::read_to_string(path).expect("the book's config reference");
    let keys = every_key();
    assert!(keys.len() > 150, "too few keys found: {keys:?}");
    for key in [
        "zero_optimization.offload_param.max_in_cpu",
        "optimizer.params.lr",
    ] {
        assert!(keys.contains(key), "{key} not found");
    }
    let rows = reference_rows(&text);
    let rowed: BTreeSet<&str> = rows.iter().map(String::as_str).collect();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !rowed.contains(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "book/src/config-reference.md has no row for {missing:?}: add one (default, and whether \
         it is honoured, refused or has no effect)"
    );
    let unknown: Vec<&String> = rows
        .iter()
        .filter(|r| !keys.contains(*r) && !UNIMPLEMENTED_KEYS.contains(&r.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "rows for keys the config does not have: {unknown:?}"
    );
    let mut seen = BTreeSet::new();
    let twice: Vec<&String> = rows.iter().filter(|r| !seen.insert(*r)).collect();
    assert!(twice.is_empty(), "rows given twice: {twice:?}");
    println!("config reference: {} keys, {} rows", keys.len(), rows.len());
}
