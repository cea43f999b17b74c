//! The 1F1B schedule against DeepSpeed's stream for 4 stages x 8 micro-batches, and its
//! invariants for S in 1..=6 and M in 1..=12. No tensors.

use super::*;

fn abbrev(i: &PipeInstruction) -> String {
    use PipeInstruction::*;
    match *i {
        LoadMicroBatch { buffer } => format!("L{buffer}"),
        ForwardPass { buffer } => format!("F{buffer}"),
        BackwardPass { buffer } => format!("B{buffer}"),
        SendActivation { buffer } => format!("SA{buffer}"),
        RecvActivation { buffer } => format!("RA{buffer}"),
        SendGrad { buffer } => format!("SG{buffer}"),
        RecvGrad { buffer } => format!("RG{buffer}"),
        ReduceTiedGrads => "RTG".into(),
        ReduceGrads => "RDG".into(),
        OptimizerStep => "OPT".into(),
    }
}

/// DeepSpeed's stream for S = 4, M = 8: one row per step, one column per stage.
const DEEPSPEED_4X8: [[&str; 4]; 22] = [
    ["L0 F0", "", "", ""],
    ["SA0", "RA0 F0", "", ""],
    ["L1 F1", "SA0", "RA0 F0", ""],
    ["SA1", "RA1 F1", "SA0", "RA0 L0 F0"],
    ["L2 F2", "SA1", "RA1 F1", "B0"],
    ["SA2", "RA2 F2", "RG0 SA1 B0", "SG0 RA1 L1 F1"],
    ["L3 F3", "RG0 SA2 B0", "SG0 RA0 F0", "B1"],
    ["RG0 SA3 B0", "SG0 RA0 F0", "RG1 SA0 B1", "SG1 RA0 L0 F0"],
    ["L0 F0", "RG1 SA0 B1", "SG1 RA1 F1", "B0"],
    ["RG1 SA0 B1", "SG1 RA1 F1", "RG0 SA1 B0", "SG0 RA1 L1 F1"],
    ["L1 F1", "RG2 SA1 B2", "SG0 RA0 F0", "B1"],
    ["RG2 SA1 B2", "SG2 RA2 F2", "RG1 SA0 B1", "SG1 RA0 L0 F0"],
    ["L2 F2", "RG0 SA2 B0", "SG1 RA1 F1", "B0"],
    ["RG3 SA2 B3", "SG0 RA0 F0", "RG0 SA1 B0", "SG0 RA1 L1 F1"],
    ["L3 F3", "RG1 SA0 B1", "SG0 RA0 F0", "B1"],
    ["RG0 SA3 B0", "SG1 RA1 F1", "RG1 SA0 B1", "SG1 RA0 L0 F0"],
    ["", "RG2 SA1 B2", "SG1 RA1 F1", "B0"],
    ["RG1 B1", "SG2", "RG0 SA1 B0", "SG0 RA1 L1 F1"],
    ["", "RG0 B0", "SG0", "B1"],
    ["RG2 B2", "SG0", "RG1 B1", "SG1"],
    ["", "RG1 B1", "SG1", ""],
    [
        "RG3 B3 RTG RDG OPT",
        "SG1 RTG RDG OPT",
        "RTG RDG OPT",
        "RTG RDG OPT",
    ],
];

#[test]
fn four_stages_eight_micro_batches_equal_deepspeed() {
    let schedules: Vec<_> = (0..4)
        .map(|s| TrainSchedule::new(8, 4, s).steps())
        .collect();
    assert!(schedules.iter().all(|s| s.len() == DEEPSPEED_4X8.len()));
    for (step, row) in DEEPSPEED_4X8.iter().enumerate() {
        for (stage, want) in row.iter().enumerate() {
            let got: Vec<String> = schedules[stage][step].iter().map(abbrev).collect();
            assert_eq!(got.join(" "), *want, "stage {stage}, step {step}");
        }
    }
}

#[test]
fn invariants_hold_for_many_shapes() {
    use PipeInstruction::*;
    for stages in 1..=6 {
        for micro in 1..=12 {
            for stage in 0..stages {
                let sched = TrainSchedule::new(micro, stages, stage);
                let steps = sched.steps();
                assert_eq!(steps.len(), 2 * (micro + stages - 1));
                let buffers = sched.num_pipe_buffers();
                assert_eq!(buffers, (stages - stage).min(micro).max(2));
                let flat: Vec<PipeInstruction> = steps.iter().flatten().copied().collect();
                let count = |f: fn(&PipeInstruction) -> bool| flat.iter().filter(|i| f(i)).count();
                assert_eq!(count(|i| matches!(i, ForwardPass { .. })), micro);
                assert_eq!(count(|i| matches!(i, BackwardPass { .. })), micro);
                assert!(flat.iter().all(|i| i.buffer().is_none_or(|b| b < buffers)));
                let last = stage == stages - 1;
                if last {
                    assert_eq!(count(|i| matches!(i, SendActivation { .. })), 0);
                    assert_eq!(count(|i| matches!(i, RecvGrad { .. })), 0);
                } else {
                    assert_eq!(count(|i| matches!(i, SendActivation { .. })), micro);
                }
                if stage == 0 {
                    assert_eq!(count(|i| matches!(i, RecvActivation { .. })), 0);
                    assert_eq!(count(|i| matches!(i, SendGrad { .. })), 0);
                }
                // In-flight activations never exceed min(S - s, M).
                let (mut live, mut peak) = (0usize, 0usize);
                for i in &flat {
                    match i {
                        ForwardPass { .. } => {
                            live += 1;
                            peak = peak.max(live);
                        }
                        BackwardPass { .. } => live -= 1,
                        _ => {}
                    }
                }
                assert!(
                    peak <= (stages - stage).min(micro),
                    "S {stages} M {micro} s {stage}"
                );
                assert_eq!(
                    steps.last().map(|s| s[s.len() - 3..].to_vec()),
                    Some(vec![ReduceTiedGrads, ReduceGrads, OptimizerStep])
                );
            }
        }
    }
}
