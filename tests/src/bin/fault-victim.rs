//! The victim of the fault-injection tests: trains the GPT example (tiny, 2 thread ranks, or
//! one rank per process under `mpirun`) and misbehaves as asked.
//!
//! - `fault-victim save DIR STAGE STEPS`: at ZeRO stage `STAGE`, saves checkpoint `last`
//!   under `DIR` after each of `STEPS` steps, printing `saving N` before and `saved N MICROS`
//!   after each save (`tests/crash.rs` kills it during one).
//! - `fault-victim fail RANK STEP`: rank `RANK` returns an error before step `STEP` while the
//!   others go on (`scripts/test.sh`, under `mpirun`).
//! - `fault-victim die RANK STEP`: rank `RANK` kills itself with SIGKILL before step `STEP`,
//!   two seconds after the others have gone on into that step's first collective
//!   (`scripts/test.sh` checks that the launcher's flight recorder names it).
//! - `fault-victim train DIR`: trains until it is killed, printing `step N`; each process
//!   writes its id to `DIR/rank-R.pid` (`scripts/test.sh` kills one of them).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_deepspeed::comm::Communicator;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedEngine, DeepSpeedError, Result};
use burn_deepspeed_example_gpt::model::Gpt;
use burn_deepspeed_example_gpt::run::train_step;
use burn_deepspeed_tests::crash_spec;

enum Mode {
    Save { dir: String, steps: u64 },
    Fail { rank: usize, step: u64 },
    Die { rank: usize, step: u64 },
    Train { dir: String },
}

fn say(comm: &dyn Communicator, line: String) {
    if comm.rank() == 0 {
        println!("{line}");
        std::io::stdout().flush().ok();
    }
}

fn victim(mode: &Mode, stage: u8, comm: Arc<dyn Communicator>) -> Result<()> {
    let steps = match mode {
        Mode::Save { steps, .. } => *steps,
        _ => 1_000_000,
    };
    let spec = crash_spec(stage, steps);
    let device = Device::flex().autodiff();
    let model = Gpt::new(spec.shape, spec.seed, &device);
    let mut engine = DeepSpeedEngine::new(model, spec.config.clone(), comm.clone())?;
    let inner = device.inner();
    if let Mode::Train { dir } = mode {
        let path = std::path::Path::new(dir).join(format!("rank-{}.pid", comm.rank()));
        std::fs::write(&path, std::process::id().to_string())
            .map_err(|e| DeepSpeedError::Data(format!("{}: {e}", path.display())))?;
    }
    for step in 0..spec.steps {
        if let Mode::Fail { rank, step: at } = mode
            && comm.rank() == *rank
            && step == *at
        {
            return Err(DeepSpeedError::Data(format!(
                "injected fault on rank {rank} before step {at}"
            )));
        }
        if let Mode::Die { rank, step: at } = mode
            && comm.rank() == *rank
            && step == *at
        {
            // The others are waiting in the step's first collective by then.
            std::thread::sleep(Duration::from_secs(2));
            let me = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-9", &me])
                .status();
        }
        train_step(&mut engine, &spec, step, &inner)?;
        say(comm.as_ref(), format!("step {}", step + 1));
        if let Mode::Save { dir, .. } = mode {
            say(comm.as_ref(), format!("saving {}", step + 1));
            let start = Instant::now();
            engine.save_checkpoint(dir, Some("last"))?;
            let micros = start.elapsed().as_micros();
            say(comm.as_ref(), format!("saved {} {micros}", step + 1));
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |s: &str| {
        s.parse::<u64>()
            .map_err(|_| DeepSpeedError::Data(format!("`{s}` is not a number")))
    };
    let (mode, stage) = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["save", dir, stage, steps] => (
            Mode::Save {
                dir: dir.into(),
                steps: number(steps)?,
            },
            number(stage)?,
        ),
        ["fail", rank, step] => (
            Mode::Fail {
                rank: number(rank)? as usize,
                step: number(step)?,
            },
            0,
        ),
        ["die", rank, step] => (
            Mode::Die {
                rank: number(rank)? as usize,
                step: number(step)?,
            },
            0,
        ),
        ["train", dir] => (Mode::Train { dir: dir.into() }, 0),
        _ => {
            return Err(DeepSpeedError::Data(
                "usage: fault-victim save DIR STAGE STEPS | fail RANK STEP | die RANK STEP | train DIR".into(),
            ));
        }
    };
    let stage = u8::try_from(stage).unwrap_or(u8::MAX);
    launch(2, Duration::from_secs(60), |comm| {
        victim(&mode, stage, comm)
    })?;
    Ok(())
}
