//! `burn-deepspeed launch`: starts a training program as the ranks of one run, as DeepSpeed's
//! `deepspeed` launcher and PyTorch's `torchrun` do. The program needs no change: the library
//! reads what the launcher sets.
//!
//! - `--ranks N`: one process of N thread ranks (the launcher sets `BURN_DEEPSPEED_RANKS`,
//!   which `burn_deepspeed::launch::launch` honours).
//! - `--mpi N [--hostfile FILE]`: N processes through OpenMPI's `mpirun`, on this machine or on
//!   the hosts of an OpenMPI hostfile (`host slots=N` per line); each process is one rank
//!   (`OMPI_COMM_WORLD_RANK`/`SIZE`). The program must be built with the `mpi` feature.
//! - `--gpus`: one MPI process per GPU of this machine (as `nvidia-smi -L` lists them); each
//!   rank takes the GPU of its local rank.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use burn_deepspeed::launch::RANKS_ENV;

/// The arguments of `burn-deepspeed launch`.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Run the program once, as N thread ranks of its process.
    #[arg(long, conflicts_with_all = ["mpi", "gpus"])]
    ranks: Option<usize>,
    /// Run N processes of the program through `mpirun`, one rank each.
    #[arg(long, conflicts_with = "gpus")]
    mpi: Option<usize>,
    /// With `--mpi`: the hosts to run on, an OpenMPI hostfile (`host slots=N` per line).
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// One process per GPU of this machine, through `mpirun`.
    #[arg(long)]
    gpus: bool,
    /// An argument for `mpirun` itself (repeat for several), e.g. `--mpirun-arg=--bind-to`.
    #[arg(long = "mpirun-arg", allow_hyphen_values = true)]
    mpirun_args: Vec<String>,
    /// Print the command instead of running it.
    #[arg(long)]
    dry_run: bool,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true)]
    program: Vec<String>,
}

/// The command a launch runs (see the module docs), or why it cannot run.
pub fn command(args: &LaunchArgs) -> Result<Command, String> {
    let (program, program_args) = args
        .program
        .split_first()
        .ok_or("name the program to launch after `--`")?;
    if args.hostfile.is_some() && args.mpi.is_none() {
        return Err("--hostfile places MPI processes: give --mpi N with it".into());
    }
    let processes = match (args.ranks, args.mpi, args.gpus) {
        (Some(0), ..) | (_, Some(0), _) => return Err("a run needs at least one rank".into()),
        (Some(n), ..) => {
            let mut c = Command::new(program);
            c.args(program_args).env(RANKS_ENV, n.to_string());
            return Ok(c);
        }
        (None, Some(n), _) => n,
        (None, None, true) => match gpu_count() {
            0 => return Err("--gpus: `nvidia-smi -L` lists no GPU on this machine".into()),
            n => n,
        },
        (None, None, false) => return Err("say how to run: --ranks N, --mpi N or --gpus".into()),
    };
    let mut c = Command::new("mpirun");
    c.arg("-n").arg(processes.to_string());
    if let Some(hosts) = &args.hostfile {
        if !hosts.is_file() {
            return Err(format!("--hostfile {}: no such file", hosts.display()));
        }
        c.arg("--hostfile").arg(hosts);
    }
    if running_as_root() {
        c.arg("--allow-run-as-root");
    }
    // The library's variables reach the ranks on other hosts too.
    for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("BURN_DEEPSPEED_")) {
        c.arg("-x").arg(name);
    }
    c.args(&args.mpirun_args).arg(program).args(program_args);
    Ok(c)
}

/// Runs the launch and returns the program's (or `mpirun`'s) exit status.
pub fn run(args: LaunchArgs) -> ExitCode {
    let mut command = match command(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: launch: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.dry_run {
        println!("{}", shown(&command));
        return ExitCode::SUCCESS;
    }
    match command.status() {
        Ok(status) => ExitCode::from(status.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            let program = command.get_program().to_string_lossy().into_owned();
            let hint = if program == "mpirun" {
                " (install OpenMPI: `apt install openmpi-bin`, or run threads with --ranks)"
            } else {
                ""
            };
            eprintln!("error: launch: cannot run `{program}`: {e}{hint}");
            ExitCode::FAILURE
        }
    }
}

/// The command as a shell line (environment variables first).
pub fn shown(c: &Command) -> String {
    let env = c
        .get_envs()
        .filter_map(|(k, v)| Some(format!("{}={}", k.to_str()?, v?.to_str()?)));
    let words = std::iter::once(c.get_program()).chain(c.get_args());
    env.chain(words.map(|w| w.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The GPUs `nvidia-smi -L` lists (0 without the tool).
pub fn gpu_count() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

/// Whether this process runs as root (OpenMPI refuses root without a flag).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
