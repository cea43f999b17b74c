//! `wall_clock_breakdown`: each step's time per phase, averaged over the steps between two
//! prints (DeepSpeed prints its timers every `steps_per_print` steps).

use std::time::Duration;

/// Sums of named phase times over the steps since the last print.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BreakdownWindow {
    phases: Vec<(&'static str, Duration)>,
    steps: u32,
}

impl BreakdownWindow {
    /// Adds one step's phase times. A phase's mean is its sum over every step of the
    /// window, so the engines time the same phases on every step.
    pub fn add(&mut self, phases: &[(&'static str, Duration)]) {
        for &(name, took) in phases {
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some((_, sum)) => *sum += took,
                None => self.phases.push((name, took)),
            }
        }
        self.steps += 1;
    }

    /// Steps added since the last [`take_line`](Self::take_line).
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// The mean of each phase over the window, as one line, and a fresh window:
    /// `[rank 0] step 20 | time (ms), mean of 10 steps | forward: 12.31 | backward: …`.
    pub fn take_line(&mut self, rank: usize, step: u64) -> String {
        let steps = self.steps.max(1);
        let mut line = format!(
            "[rank {rank}] step {step} | time (ms), mean of {} step{}",
            self.steps,
            if self.steps == 1 { "" } else { "s" }
        );
        for (name, sum) in &self.phases {
            line.push_str(&format!(
                " | {name}: {:.2}",
                sum.as_secs_f64() * 1e3 / steps as f64
            ));
        }
        *self = Self::default();
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_over_the_window_then_starts_again() {
        let ms = Duration::from_millis;
        let mut w = BreakdownWindow::default();
        w.add(&[("forward", ms(10)), ("backward", ms(20))]);
        w.add(&[("forward", ms(30)), ("backward", ms(40))]);
        assert_eq!(w.steps(), 2);
        assert_eq!(
            w.take_line(0, 2),
            "[rank 0] step 2 | time (ms), mean of 2 steps | forward: 20.00 | backward: 30.00"
        );
        assert_eq!(w.steps(), 0);
        w.add(&[("reduce", ms(1))]);
        assert_eq!(
            w.take_line(3, 3),
            "[rank 3] step 3 | time (ms), mean of 1 step | reduce: 1.00"
        );
    }
}
