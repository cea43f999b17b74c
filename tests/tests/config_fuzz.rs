//! Config fuzzing: 10,000 seeded mutations of the published DeepSpeed configs (and the GPT
//! example's) — random keys, wrong types, huge, zero, negative and non-finite numbers —
//! loaded, resolved at several world sizes and checked as `config check` and the engine do.
//! Nothing panics, each case ends promptly, and every refusal names a key.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::config::{EntryPoint, check_supported};
use burn_deepspeed_tests::fuzz::{Rng, mutate, names_a_key, seeds};

const CASES: usize = 10_000;

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
