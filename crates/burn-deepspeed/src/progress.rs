//! Progress bars: rank 0's training bar (step, loss, tokens/s), and [`TaskProgress`] for the
//! other long-running commands (benchmarks' runs, checkpoint consolidation). Every bar
//! draws on stderr and only when stderr is a terminal, so pipes, logs, tests and `--json`
//! output stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A training progress bar shown by rank 0 only.
#[derive(Debug)]
pub struct TrainProgress {
    bar: ProgressBar,
}

impl TrainProgress {
    /// A bar for `total_steps` optimizer steps on `rank`.
    pub fn new(rank: usize, total_steps: u64) -> Self {
        let bar = if rank == 0 {
            ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed}, eta {eta})",
            )
            .expect("the template is valid")
            .progress_chars("=> "),
        );
        Self { bar }
    }

    /// Records step `step` with its loss and throughput.
    pub fn update(&self, step: u64, loss: f64, tokens_per_s: f64) {
        self.bar.set_position(step);
        self.bar
            .set_message(format!("loss {loss:.4} | {tokens_per_s:.0} tok/s"));
    }

    /// Prints a line above the bar (rank 0 only).
    pub fn println(&self, line: impl AsRef<str>) {
        self.bar.println(line);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A bar over a known number of items or bytes of one long-running command.
#[derive(Debug)]
pub struct TaskProgress {
    bar: ProgressBar,
}

impl TaskProgress {
    /// A bar of `total` items labelled `label`; hidden when `show` is false (e.g. under
    /// `--json`) or stderr is not a terminal.
    pub fn items(label: &str, total: u64, show: bool) -> Self {
        Self::with_template(
            label,
            total,
            show,
            "{spinner} {prefix} {pos}/{len} [{bar:30}] {msg} ({elapsed}, eta {eta})",
        )
    }

    /// A bar of `total` bytes labelled `label` (see [`items`](Self::items)).
    pub fn bytes(label: &str, total: u64, show: bool) -> Self {
        Self::with_template(
            label,
            total,
            show,
            "{spinner} {prefix} {bytes}/{total_bytes} [{bar:30}] {msg} ({binary_bytes_per_sec}, \
             eta {eta})",
        )
    }

    fn with_template(label: &str, total: u64, show: bool, template: &str) -> Self {
        let bar = match show {
            true => ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()),
            false => ProgressBar::hidden(),
        };
        bar.set_style(
            ProgressStyle::with_template(template)
                .expect("the template is valid")
                .progress_chars("=> "),
        );
        bar.set_prefix(label.to_string());
        Self { bar }
    }

    /// Names what is running now.
    pub fn set_message(&self, what: impl Into<String>) {
        self.bar.set_message(what.into());
    }

    /// Counts `n` more items or bytes done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Items or bytes done so far.
    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// Prints a line above the bar.
    pub fn println(&self, line: impl AsRef<str>) {
        self.bar.println(line);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hidden_bar_still_counts() {
        let p = TaskProgress::bytes("save", 100, false);
        p.inc(40);
        p.inc(60);
        p.set_message("done");
        assert_eq!(p.position(), 100);
        p.finish();
    }
}
