//! `burn-deepspeed report`: what this machine and this build offer a run, as DeepSpeed's
//! `ds_report` prints it: the library's features, the system libraries each needs (found or
//! not), whether io_uring is usable for swap files, the free space where swap files would go,
//! and the cores and memory.

use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of the report: what, and what was found.
pub struct Finding {
    /// What is checked.
    pub what: &'static str,
    /// What was found.
    pub found: String,
}

/// Every finding, in the printed order; `nvme_path` is where swap files would go.
pub fn findings(nvme_path: &Path) -> Vec<Finding> {
    let features = burn_deepspeed::launch::built_features();
    let mut out = vec![
        Finding {
            what: "burn-deepspeed",
            found: env!("CARGO_PKG_VERSION").into(),
        },
        Finding {
            what: "features of this build",
            found: if features.is_empty() {
                "none (Flex on the CPU, thread ranks)".into()
            } else {
                features.join(", ")
            },
        },
        Finding {
            what: "MPI (feature mpi)",
            found: mpi_version(),
        },
        Finding {
            what: "CUDA driver (feature cuda)",
            found: library("libcuda.so"),
        },
        Finding {
            what: "NCCL (feature cuda)",
            found: library("libnccl.so"),
        },
        Finding {
            what: "GPUs",
            found: match crate::launch::gpu_count() {
                0 => "none listed by nvidia-smi".into(),
                n => format!("{n} (nvidia-smi -L)"),
            },
        },
        Finding {
            what: "Vulkan (feature wgpu)",
            found: library("libvulkan.so"),
        },
        Finding {
            what: "io_uring for swap files",
            found: if burn_deepspeed::swap::io_uring_available() {
                "usable".into()
            } else {
                "not usable here (swap files use pread/pwrite)".into()
            },
        },
        Finding {
            what: "free disk for nvme_path",
            found: free_space(nvme_path),
        },
        Finding {
            what: "CPU cores",
            found: std::thread::available_parallelism()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "unknown".into()),
        },
    ];
    out.push(Finding {
        what: "memory",
        found: memory(),
    });
    out
}

/// Prints the report.
pub fn print(nvme_path: Option<PathBuf>) {
    let path = nvme_path.unwrap_or_else(std::env::temp_dir);
    for f in findings(&path) {
        println!("{:<28} {}", f.what, f.found);
    }
}

fn mpi_version() -> String {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("mpirun")
            .trim()
            .to_string(),
        _ => "mpirun not found (apt install openmpi-bin libopenmpi-dev)".into(),
    }
}

/// Where the dynamic loader finds `name` (`ldconfig -p`, then `LD_LIBRARY_PATH`).
fn library(name: &str) -> String {
    if let Ok(o) = Command::new("ldconfig").arg("-p").output() {
        let listed = String::from_utf8_lossy(&o.stdout);
        if let Some(path) = listed
            .lines()
            .filter(|l| l.trim_start().starts_with(name))
            .find_map(|l| l.split("=> ").nth(1))
        {
            return format!("found: {}", path.trim());
        }
    }
    let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    for dir in dirs.split(':').filter(|d| !d.is_empty()) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(name) {
                    return format!("found: {}", e.path().display());
                }
            }
        }
    }
    "not found".into()
}

/// `df`'s free and total space of the file system holding `path`.
fn free_space(path: &Path) -> String {
    let out = Command::new("df").arg("-Pk").arg(path).output();
    let Some(o) = out.ok().filter(|o| o.status.success()) else {
        return format!("{}: cannot be read (does it exist?)", path.display());
    };
    let text = String::from_utf8_lossy(&o.stdout);
    let fields: Vec<&str> = text
        .lines()
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let kib = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    match (kib(1), kib(3)) {
        (Some(total), Some(free)) => format!(
            "{}: {} free of {}",
            path.display(),
            gib(free * 1024),
            gib(total * 1024)
        ),
        _ => format!("{}: cannot be read", path.display()),
    }
}

/// Total and available memory (`/proc/meminfo`).
fn memory() -> String {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else {
        return "unknown".into();
    };
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    match (field("MemTotal:"), field("MemAvailable:")) {
        (Some(total), Some(free)) => format!("{} total, {} available", gib(total), gib(free)),
        _ => "unknown".into(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}
