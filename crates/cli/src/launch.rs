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

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use burn_deepspeed::comm::{FLIGHT_DIR_ENV, earliest_divergence, read_rings};
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

/// The command a launch runs (see the module docs), or why it cannot run; an MPI job keeps
/// its flight recorder's rings in `flight_dir`.
pub fn command(args: &LaunchArgs, flight_dir: Option<&Path>) -> Result<Command, String> {
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
    let mut names: Vec<String> = (std::env::vars().map(|(k, _)| k))
        .filter(|k| k.starts_with("BURN_DEEPSPEED_"))
        .collect();
    // Each rank keeps its flight recorder's rings in this folder, which outlives the ranks.
    if let Some(dir) = flight_dir {
        c.env(FLIGHT_DIR_ENV, dir);
        names.retain(|n| n != FLIGHT_DIR_ENV);
        names.push(FLIGHT_DIR_ENV.into());
    }
    for name in names {
        c.arg("-x").arg(name);
    }
    c.args(&args.mpirun_args).arg(program).args(program_args);
    Ok(c)
}

/// Runs the launch and returns the program's (or `mpirun`'s) exit status.
pub fn run(args: LaunchArgs) -> ExitCode {
    // Where the ranks of an MPI job keep their rings, unless the caller chose a folder.
    let flight_dir =
        (args.ranks.is_none() && std::env::var_os(FLIGHT_DIR_ENV).is_none()).then(|| {
            std::env::temp_dir().join(format!("burn-deepspeed-flight-{}", std::process::id()))
        });
    let mut command = match command(&args, flight_dir.as_deref()) {
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
        Ok(status) => {
            let rings = flight_dir.or_else(|| std::env::var_os(FLIGHT_DIR_ENV).map(PathBuf::from));
            if let Some(dir) = rings {
                match status.success() {
                    true => {
                        let _ = std::fs::remove_dir_all(&dir);
                    }
                    false => eprintln!("{}", flight_report(&dir)),
                }
            }
            ExitCode::from(status.code().unwrap_or(1).clamp(0, 255) as u8)
        }
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

/// What the rings of a failed MPI job in `dir` say: the rank out of step and the first
/// collective where the ranks parted ways, or that they agree.
pub fn flight_report(dir: &Path) -> String {
    let groups = match read_rings(dir) {
        Ok(g) if !g.is_empty() => g,
        _ => {
            return format!(
                "launch: the job failed; no flight recorder rings in {}",
                dir.display()
            );
        }
    };
    match earliest_divergence(&groups) {
        Some(d) => format!(
            "launch: the job failed; flight recorder: rank(s) {:?} out of step: {} (rings in {})",
            d.lagging(),
            d.report(),
            dir.display()
        ),
        None => format!(
            "launch: the job failed; flight recorder: the ranks agree on every collective they \
             called (rings in {})",
            dir.display()
        ),
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
