//! MoQ, Mixture-of-Quantization (DeepSpeed's quantization-aware training, `runtime/quantize.py`;
//! the MoQ tutorial): after each optimizer step the weight matrices are replaced by their
//! quantized values at a precision that falls during training, so that the model learns to
//! live with the precision it will be served in.
//!
//! The schedule ([`MoqSchedule`]) starts at `start_bits` and drops one bit each time the
//! count of quantizing steps reaches the period, which then doubles: drops fall at
//! `period · 2^k` until `target_bits`. [`fake_quantize`] is DeepSpeed's
//! `quantize_highbit` (symmetric or asymmetric, nearest or stochastic rounding, over
//! `groups` equal groups of the flattened weight), its ternary form at 2 bits and its binary
//! form at 1 bit, with the `fp16_mixed_quantize` blend.
//!
//! One difference: a group whose scale is 0 (all zeros; all equal when asymmetric) is left
//! as it is, where DeepSpeed's division by the scale would make it NaN.

/// The precision schedule of one weight group (`start_bits`, `target_bits`,
/// `quantize_period`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoqSchedule {
    /// Bits before the first drop.
    pub start_bits: u32,
    /// Bits the schedule stops at.
    pub target_bits: u32,
    /// Quantizing steps to the first drop (later drops at twice the previous period).
    pub period: u64,
}

/// Where one weight group stands in its schedule: DeepSpeed keeps the bits and the period on
/// the parameter and updates them at each quantizing step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoqState {
    /// Current bits.
    pub bits: u32,
    /// Quantizing steps at which the next drop happens.
    pub period: u64,
    target: u32,
}

impl MoqSchedule {
    /// The state before any quantizing step.
    pub fn start(&self) -> MoqState {
        MoqState {
            bits: self.start_bits,
            period: self.period,
            target: self.target_bits,
        }
    }

    /// The bits used at quantizing step `qstep` (1-based: the first quantizing step is 1),
    /// from the start (what [`MoqState::advance`] reaches step by step).
    pub fn bits_at(&self, qstep: u64) -> u32 {
        let mut state = self.start();
        // A step drops at most one bit and the next drop is at twice the step, so replaying
        // the drops' own steps reaches the same bits.
        while state.bits > state.target && qstep >= state.period {
            state.advance(state.period);
        }
        state.bits
    }
}

impl MoqState {
    /// The bits at quantizing step `qstep` (DeepSpeed's `compute_quantization`): when the
    /// step has reached the period and the bits are above the target, one bit less and the
    /// period doubled. Returns the bits this step quantizes at.
    pub fn advance(&mut self, qstep: u64) -> u32 {
        if self.bits > self.target && qstep >= self.period {
            self.bits -= 1;
            self.period = self.period.saturating_mul(2);
        }
        self.bits
    }
}

/// How [`fake_quantize`] rounds and centres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeQuantizer {
    /// Symmetric around zero (DeepSpeed's default) or asymmetric with a zero point.
    pub symmetric: bool,
    /// Groups of the flattened weight (`quantize_groups`); the weight's length must divide.
    pub groups: usize,
}

/// `values` replaced by their quantized values at `bits` (DeepSpeed's
/// `compute_quantization` without the schedule): `bits ≥ 3` by `quantize_highbit`, 2 by the
/// ternary and 1 by the binary form (symmetric, nearest only, as DeepSpeed asserts).
/// `noise`, when given, draws the stochastic-rounding offset U(−½, ½) for each value in
/// order (`rounding: stochastic`); `None` rounds to nearest (half to even, as `torch.round`).
///
/// # Panics
/// When the groups do not divide the values, or `bits` is 0.
pub fn fake_quantize(
    values: &mut [f32],
    bits: u32,
    how: FakeQuantizer,
    mut noise: Option<&mut dyn FnMut() -> f32>,
) {
    assert!(bits > 0, "0 bits");
    assert!(
        how.groups > 0 && values.len().is_multiple_of(how.groups),
        "{} values do not split into {} quantization groups",
        values.len(),
        how.groups
    );
    let size = values.len() / how.groups;
    if size == 0 {
        return;
    }
    for group in values.chunks_mut(size) {
        match bits {
            1 => binary(group),
            2 => ternary(group),
            _ => high_bit(group, bits, how.symmetric, &mut noise),
        }
    }
}

fn high_bit(
    group: &mut [f32],
    bits: u32,
    symmetric: bool,
    noise: &mut Option<&mut dyn FnMut() -> f32>,
) {
    let range = 2f32.powi(bits as i32);
    let (lo, hi) = group
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let (scale, zero, qmin, qmax) = if symmetric {
        let scale = 2.0 * lo.abs().max(hi.abs()) / range;
        (scale, 0.0, -range / 2.0, range / 2.0 - 1.0)
    } else {
        let scale = (hi - lo) / range;
        let zero = if scale > 0.0 {
            (lo / scale).round_ties_even() * scale
        } else {
            0.0
        };
        (scale, zero, 0.0, range - 1.0)
    };
    if !(scale > 0.0 && scale.is_finite()) {
        return;
    }
    for v in group.iter_mut() {
        let p = noise.as_mut().map_or(0.0, |draw| draw());
        let q = ((*v - zero) / scale + p)
            .round_ties_even()
            .clamp(qmin, qmax);
        *v = q * scale + zero;
    }
}

/// DeepSpeed's `quantize_tenary`: ±α where |w| exceeds 0.7 of the mean |w|, else 0, with α
/// the mean |w| over the kept values.
fn ternary(group: &mut [f32]) {
    let n = group.len() as f32;
    let threshold = 0.7 * group.iter().map(|v| v.abs()).sum::<f32>() / n;
    let (kept, sum) = group
        .iter()
        .filter(|v| v.abs() > threshold)
        .fold((0usize, 0.0f32), |(k, s), v| (k + 1, s + v.abs()));
    let alpha = if kept > 0 { sum / kept as f32 } else { 0.0 };
    for v in group.iter_mut() {
        *v = if *v > threshold {
            alpha
        } else if *v < -threshold {
            -alpha
        } else {
            0.0
        };
    }
}

/// DeepSpeed's `quantize_binary`: sign(w) times the mean |w|.
fn binary(group: &mut [f32]) {
    let m = group.iter().map(|v| v.abs()).sum::<f32>() / group.len() as f32;
    for v in group.iter_mut() {
        *v = if *v > 0.0 {
            m
        } else if *v < 0.0 {
            -m
        } else {
            0.0
        };
    }
}

/// `fp16_mixed_quantize`: the weight's share `ratio` in `ratio·w + (1 − ratio)·Q(w)`, which
/// starts at 1, falls by `change_ratio` each quantizing step (not below 0) and returns to 1
/// when a bit is dropped (DeepSpeed's `quantize_real_ratio`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixedRatio {
    /// The weight's current share.
    pub ratio: f32,
    /// The fall per quantizing step.
    pub change_ratio: f32,
}

impl MixedRatio {
    /// A ratio of 1 falling by `change_ratio`.
    pub fn new(change_ratio: f32) -> Self {
        Self {
            ratio: 1.0,
            change_ratio,
        }
    }

    /// One quantizing step's fall (DeepSpeed's `update_fp16_ratio`, before the weights).
    pub fn step(&mut self) {
        if self.ratio > 0.0 {
            self.ratio -= self.change_ratio;
        } else {
            self.ratio = 0.0;
        }
    }

    /// `ratio·w + (1 − ratio)·q` into `q`.
    pub fn blend(&self, w: &[f32], q: &mut [f32]) {
        for (q, w) in q.iter_mut().zip(w) {
            *q = self.ratio * w + (1.0 - self.ratio) * *q;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MoQ tutorial's settings (start 16, target 8, period 400, offset 0): one bit less
    /// at quantizing steps 400, 800, 1600, ..., 51,200, then 8 bits for good.
    #[test]
    fn the_tutorial_schedule_halves_its_pace_after_each_drop() {
        let schedule = MoqSchedule {
            start_bits: 16,
            target_bits: 8,
            period: 400,
        };
        let drops = [400u64, 800, 1600, 3200, 6400, 12_800, 25_600, 51_200];
        let mut state = schedule.start();
        let mut seen = Vec::new();
        for step in 1..=60_000u64 {
            let before = state.bits;
            let bits = state.advance(step);
            if bits != before {
                seen.push((step, bits));
            }
            assert_eq!(schedule.bits_at(step), bits, "step {step}");
        }
        let want: Vec<(u64, u32)> = drops
            .iter()
            .zip((8..16).rev())
            .map(|(&s, b)| (s, b))
            .collect();
        assert_eq!(seen, want);
        assert_eq!(state.bits, 8);
        assert_eq!(schedule.bits_at(399), 16);
    }

    #[test]
    fn symmetric_values_land_on_the_grid() {
        // absmax 1.0 at 3 bits: scale 2/8 = 0.25, codes −4..=3.
        let mut v = vec![-1.0, -0.3, 0.1, 0.125, 0.375, 1.0];
        let how = FakeQuantizer {
            symmetric: true,
            groups: 1,
        };
        fake_quantize(&mut v, 3, how, None);
        // 0.125/0.25 = 0.5 rounds to 0 (half to even), 0.375/0.25 = 1.5 to 2, 1.0 clamps to 3.
        assert_eq!(v, vec![-1.0, -0.25, 0.0, 0.0, 0.5, 0.75]);
    }

    #[test]
    fn asymmetric_groups_keep_their_own_range() {
        // 3 bits. Group 1: min 0, max 8: scale 1, zero point 0, codes 0..=7.
        // Group 2: min −4, max 4: scale 1, zero point −4 (2.5 and 4.5 round to even).
        let mut v = vec![0.0, 2.4, 5.6, 8.0, -4.0, -1.5, 0.5, 4.0];
        let how = FakeQuantizer {
            symmetric: false,
            groups: 2,
        };
        fake_quantize(&mut v, 3, how, None);
        assert_eq!(v, vec![0.0, 2.0, 6.0, 7.0, -4.0, -2.0, 0.0, 3.0]);
    }

    #[test]
    fn ternary_binary_and_stochastic_rounding() {
        let how = FakeQuantizer {
            symmetric: true,
            groups: 1,
        };
        let mut t = vec![1.0, -1.0, 0.1, 0.5];
        // mean |w| 0.65, threshold 0.455: kept 1, −1, 0.5 with α = 2.5/3.
        fake_quantize(&mut t, 2, how, None);
        let a = 2.5 / 3.0;
        assert_eq!(t, vec![a, -a, 0.0, a]);
        let mut b = vec![2.0, -1.0, 0.0, 1.0];
        fake_quantize(&mut b, 1, how, None);
        assert_eq!(b, vec![1.0, -1.0, 0.0, 1.0]);
        // A +0.49 offset turns 0.3 (1.2 steps of 0.25) into 2 steps; nearest gives 1.
        let mut s = vec![1.0, 0.3];
        let mut draw = || 0.49f32;
        fake_quantize(&mut s, 3, how, Some(&mut draw));
        assert_eq!(s, vec![0.75, 0.5]);
    }

    #[test]
    fn the_mixed_ratio_falls_and_blends() {
        let mut r = MixedRatio::new(0.25);
        r.step();
        assert_eq!(r.ratio, 0.75);
        let mut q = vec![0.0, 4.0];
        r.blend(&[4.0, 0.0], &mut q);
        assert_eq!(q, vec![3.0, 1.0]);
        for _ in 0..5 {
            r.step();
        }
        assert_eq!(r.ratio, 0.0);
    }

    #[test]
    fn zero_groups_stay_and_mismatched_groups_panic() {
        let how = FakeQuantizer {
            symmetric: true,
            groups: 2,
        };
        let mut v = vec![0.0, 0.0, 1.0, -1.0];
        fake_quantize(&mut v, 8, how, None);
        assert_eq!(v[..2], [0.0, 0.0]);
        let r = std::panic::catch_unwind(|| fake_quantize(&mut [1.0; 3], 8, how, None));
        assert!(r.is_err());
    }
}
