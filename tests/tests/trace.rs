//! A timeline trace of a (pp 2, dp 2) pipeline run: valid Chrome trace JSON, one named
//! track per rank, and a slice for every instruction of each stage's 1F1B schedule.
//!
//! Its own test binary: the trace installs the process's global `tracing` subscriber.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::trace::ChromeTrace;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_strategies::pipe::TrainSchedule;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

#[test]
fn a_pipeline_trace_has_a_track_per_rank_and_every_instruction() {
    let _alone = crate::alone();
    const MICRO: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let trace = ChromeTrace::start(&path).unwrap();
    let config = DeepSpeedConfig::from_json_str(&format!(
        r#"{{"train_batch_size": {}, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "pipeline": {{"stages": 2}}, "zero_optimization": {{"stage": 1}}}}"#,
        MICRO * 2
    ))
    .unwrap()
    .0;
    common::train(4, &common::spec(config, SHAPE, 2, 1, 2));
    assert_eq!(trace.finish(), path);

    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<serde_json::Value> =
        serde_json::from_str(&text).expect("the trace is a JSON array of events");
    // Track (thread id) → name, from the metadata events.
    let tracks: BTreeMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            let name = e["args"]["name"].as_str().unwrap_or_default().to_string();
            (e["tid"].as_u64().unwrap(), name)
        })
        .collect();
    let ranks: BTreeSet<&str> = tracks
        .values()
        .map(String::as_str)
        .filter(|n| n.starts_with("rank-"))
        .collect();
    assert_eq!(
        ranks,
        BTreeSet::from(["rank-0", "rank-1", "rank-2", "rank-3"])
    );

    // Slices (begin/end pairs, or complete events) per track, by name.
    let mut slices: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    for e in &events {
        if e["ph"] == "B" || e["ph"] == "X" {
            let track = tracks
                .get(&e["tid"].as_u64().unwrap())
                .map_or("?", String::as_str);
            let name = e["name"].as_str().unwrap().to_string();
            *slices.entry(track).or_default().entry(name).or_default() += 1;
        }
    }
    // Ranks 0-1 are stage 0 (replicas 0 and 1), ranks 2-3 stage 1.
    for rank in 0..4 {
        let stage = rank / 2;
        let track = format!("rank-{rank}");
        let mut expected: BTreeMap<String, usize> = BTreeMap::new();
        let schedule = TrainSchedule::new(MICRO, 2, stage);
        for inst in schedule.steps().into_iter().flatten() {
            *expected.entry(inst.name().to_string()).or_default() += 2; // two steps
        }
        let got = &slices[track.as_str()];
        for (name, count) in &expected {
            assert_eq!(
                got.get(name),
                Some(count),
                "{track}: `{name}` slices in {got:?}"
            );
        }
        // The collectives beneath them are on the timeline too.
        assert!(got.contains_key("all_reduce"), "{track}: {got:?}");
        assert!(
            got.contains_key(if stage == 0 { "send" } else { "recv" }),
            "{track}: {got:?}"
        );
    }
}
