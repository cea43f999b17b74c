//! The example as a user runs it: the binary trains the classifier with `DeepSpeedStrategy` at
//! ZeRO-2 on 2 thread ranks, and its held-out loss falls below half of where it started.

use std::process::Command;

#[test]
fn the_example_trains_the_classifier() {
    let out = Command::new(env!("CARGO_BIN_EXE_classifier"))
        .output()
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| l.split("held-out loss ").nth(1))
        .filter_map(|rest| rest.split(',').next()?.trim().parse().ok())
        .collect();
    assert_eq!(losses.len(), 2, "{stdout}");
    println!("held-out loss {} -> {}", losses[0], losses[1]);
    assert!(losses[1] < 0.5 * losses[0], "{losses:?}");
}
