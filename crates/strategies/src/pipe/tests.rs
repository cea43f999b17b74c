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

/// Runs every stage's stream with blocking (rendezvous) sends and receives between
/// neighbours, tracking which micro-batch each buffer holds. Fails on a deadlock, on a
/// send/receive pair that does not match, on an instruction that uses a buffer holding the
/// wrong micro-batch, and when micro-batches are not forwarded (and backwarded) once, in order,
/// by every stage. Returns each stage's peak of live activations.
fn simulate(streams: Vec<Vec<PipeInstruction>>, micro: usize, training: bool) -> Vec<usize> {
    use PipeInstruction::*;
    #[derive(Clone, Copy, Default)]
    struct Slot {
        input: Option<usize>,
        output: Option<usize>,
        grad_in: Option<usize>,
        grad_out: Option<usize>,
    }
    let stages = streams.len();
    let buffers = streams
        .iter()
        .map(|s| {
            s.iter()
                .filter_map(|i| i.buffer())
                .max()
                .map_or(1, |b| b + 1)
        })
        .collect::<Vec<_>>();
    let mut slots: Vec<Vec<Slot>> = buffers.iter().map(|&n| vec![Slot::default(); n]).collect();
    let mut pc = vec![0usize; stages];
    let mut loaded = vec![0usize; stages];
    let mut forwarded = vec![0usize; stages];
    let mut backwarded = vec![0usize; stages];
    let (mut live, mut peak) = (vec![0usize; stages], vec![0usize; stages]);
    loop {
        let mut progress = false;
        for s in 0..stages {
            let Some(&inst) = streams[s].get(pc[s]) else {
                continue;
            };
            let peer_next = |p: usize| streams[p].get(pc[p]).copied();
            match inst {
                LoadMicroBatch { buffer } => {
                    let slot = &mut slots[s][buffer];
                    if s == 0 {
                        slot.input = Some(loaded[s]);
                    }
                    loaded[s] += 1;
                }
                ForwardPass { buffer } => {
                    let slot = &mut slots[s][buffer];
                    assert_eq!(slot.input, Some(forwarded[s]), "stage {s} forward order");
                    slot.output = slot.input;
                    forwarded[s] += 1;
                    if training {
                        live[s] += 1;
                        peak[s] = peak[s].max(live[s]);
                    }
                }
                BackwardPass { buffer } => {
                    let slot = &mut slots[s][buffer];
                    assert_eq!(slot.output, Some(backwarded[s]), "stage {s} backward order");
                    if s + 1 < stages {
                        assert_eq!(slot.grad_in, slot.output, "stage {s} gradient buffer");
                    }
                    slot.grad_out = slot.output;
                    backwarded[s] += 1;
                    live[s] -= 1;
                }
                SendActivation { buffer } => match peer_next(s + 1) {
                    Some(RecvActivation { buffer: theirs }) => {
                        let mb = slots[s][buffer].output;
                        assert!(
                            mb.is_some(),
                            "stage {s} sends an activation it has not made"
                        );
                        slots[s + 1][theirs].input = mb;
                        pc[s + 1] += 1;
                    }
                    _ => continue,
                },
                SendGrad { buffer } => match peer_next(s - 1) {
                    Some(RecvGrad { buffer: theirs }) => {
                        let mb = slots[s][buffer].grad_out;
                        assert!(mb.is_some(), "stage {s} sends a gradient it has not made");
                        assert_eq!(slots[s - 1][theirs].output, mb, "gradient lands on its mb");
                        slots[s - 1][theirs].grad_in = mb;
                        pc[s - 1] += 1;
                    }
                    _ => continue,
                },
                // A receive completes with its neighbour's send.
                RecvActivation { .. } | RecvGrad { .. } => continue,
                ReduceTiedGrads | ReduceGrads | OptimizerStep => {}
            }
            pc[s] += 1;
            progress = true;
        }
        if pc.iter().zip(&streams).all(|(&p, s)| p == s.len()) {
            break;
        }
        assert!(progress, "deadlock: stages stopped at {pc:?}");
    }
    assert!(
        forwarded.iter().all(|&f| f == micro),
        "forwards {forwarded:?}"
    );
    if training {
        assert!(
            backwarded.iter().all(|&b| b == micro),
            "backwards {backwarded:?}"
        );
    }
    peak
}

fn flat_streams(
    make: impl Fn(usize) -> Box<dyn PipeSchedule>,
    stages: usize,
) -> Vec<Vec<PipeInstruction>> {
    (0..stages)
        .map(|s| make(s).steps().into_iter().flatten().collect())
        .collect()
}

#[test]
fn every_schedule_runs_without_deadlock_on_blocking_p2p() {
    for stages in 1..=6 {
        for micro in 1..=12 {
            let one_f_one_b = flat_streams(
                |s| ScheduleKind::OneFOneB.schedule(micro, stages, s),
                stages,
            );
            let peak = simulate(one_f_one_b, micro, true);
            for (s, &p) in peak.iter().enumerate() {
                assert!(
                    p <= (stages - s).min(micro),
                    "1F1B S {stages} M {micro}: {peak:?}"
                );
            }
            let gpipe = flat_streams(|s| ScheduleKind::GPipe.schedule(micro, stages, s), stages);
            let peak = simulate(gpipe, micro, true);
            assert!(
                peak.iter().all(|&p| p == micro),
                "GPipe keeps all M: {peak:?}"
            );
            let inference = flat_streams(
                |s| Box::new(InferenceSchedule::new(micro, stages, s)),
                stages,
            );
            simulate(inference, micro, false);
        }
    }
}

#[test]
fn gpipe_and_inference_step_counts_and_buffers() {
    for stages in 1..=5 {
        for micro in 1..=9 {
            for s in 0..stages {
                let g = GPipeSchedule::new(micro, stages, s);
                assert_eq!(g.steps().len(), 2 * (micro + stages - 1));
                assert_eq!(PipeSchedule::num_pipe_buffers(&g), micro);
                let i = InferenceSchedule::new(micro, stages, s);
                let steps = i.steps();
                assert_eq!(steps.len(), micro + stages - 1);
                assert!(
                    steps
                        .iter()
                        .flatten()
                        .all(|x| x.buffer().is_none_or(|b| b < 2))
                );
                assert!(!steps.iter().flatten().any(|x| matches!(
                    x,
                    PipeInstruction::BackwardPass { .. } | PipeInstruction::OptimizerStep
                )));
            }
        }
    }
}

#[test]
fn micro_batch_at_names_the_forward_and_backward_steps() {
    let sched = TrainSchedule::new(8, 4, 3);
    assert_eq!(sched.micro_batch_at(3), Some((0, true)));
    assert_eq!(sched.micro_batch_at(4), Some((0, false)));
    assert_eq!(sched.micro_batch_at(2), None);
}

#[test]
#[should_panic(expected = "deadlock")]
fn the_simulator_detects_a_deadlock() {
    use PipeInstruction::*;
    // Stage 1 waits for a gradient that stage 0 never sends before its own receive.
    let streams = vec![
        vec![
            LoadMicroBatch { buffer: 0 },
            ForwardPass { buffer: 0 },
            RecvGrad { buffer: 0 },
        ],
        vec![RecvGrad { buffer: 0 }],
    ];
    simulate(streams, 1, true);
}
