//! A memory cgroup for tests that run a job under a memory cap (v1 or v2; it needs root and
//! a writable cgroup filesystem), and the run of the `gpt-run` binary inside one.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A memory cgroup capped at a number of bytes with swap off, removed on drop.
pub struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// Makes a group capped at `limit` bytes, with a name unique to this process and `what`.
    pub fn create(what: &str, limit: u64) -> Result<Self, String> {
        let name = format!("burn-deepspeed-{what}-{}", std::process::id());
        let v2_root = Path::new("/sys/fs/cgroup");
        let v2 = fs::read_to_string(v2_root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let dir = match v2 {
            true => v2_root.join(&name),
            false => v2_root.join("memory").join(&name),
        };
        fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let group = Self { dir, v2 };
        let (max, swap) = match v2 {
            true => ("memory.max", "memory.swap.max"),
            false => ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
        };
        group.write(max, &limit.to_string())?;
        // Swap would let the run exceed the cap unseen: off where the kernel accounts it (v1
        // counts memory and swap together), and the machine must have none where it does not.
        let no_swap = match v2 {
            true => "0".to_string(),
            false => limit.to_string(),
        };
        if group.write(swap, &no_swap).is_err() {
            let swaps = fs::read_to_string("/proc/swaps").unwrap_or_default();
            if swaps.lines().count() > 1 {
                return Err("the machine swaps and the cgroup cannot account it".into());
            }
        }
        Ok(group)
    }

    fn write(&self, file: &str, value: &str) -> Result<(), String> {
        fs::write(self.dir.join(file), value)
            .map_err(|e| format!("cannot write {file} of {}: {e}", self.dir.display()))
    }

    /// Its `cgroup.procs` file: a process that writes its id there joins the group.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// The most memory the group used (bytes), where the kernel reports it.
    pub fn peak(&self) -> Option<u64> {
        let file = match self.v2 {
            true => "memory.peak",
            false => "memory.max_usage_in_bytes",
        };
        fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.dir);
    }
}

/// A line for `.ci/run`'s summary: written to the process's stderr itself, which the test
/// harness does not capture.
pub fn say(line: String) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A command that runs `exe` inside the cgroup whose `cgroup.procs` is `procs` when given:
/// a shell joins the group, then becomes the run, so that it starts inside it.
pub fn command_in(exe: &str, procs: Option<&Path>) -> Command {
    match procs {
        Some(procs) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!(
                    "echo $$ > {} && exec \"$0\" \"$@\"",
                    procs.display()
                ))
                .arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// Runs `cmd` (a `gpt-run`), fails the test with its output when it fails, and returns its
/// report: the JSON object on the last line of its stdout.
pub fn gpt_report(cmd: &mut Command, what: &str) -> serde_json::Value {
    let out = cmd.output().expect("gpt-run starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpt-run {what} failed ({}): {}\n{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().expect("a report line");
    serde_json::from_str(last).expect("a JSON report")
}
