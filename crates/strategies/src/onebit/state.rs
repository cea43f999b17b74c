//! [`OneBitState`]: what a checkpoint keeps of a 1-bit optimizer.

use crate::{CommError, Result};

/// A 1-bit optimizer's saved state: its step (which fixes the phase) and named f32 buffers.
/// The compression error buffers are never part of it: as in DeepSpeed, they start again from
/// zero after a load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OneBitState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Named buffers, in the optimizer's order.
    pub buffers: Vec<(String, Vec<f32>)>,
}

impl OneBitState {
    /// Removes buffer `name`, which must hold `len` elements (`usize::MAX`: any length).
    pub fn take(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let i = self
            .buffers
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| CommError::Optimizer {
                optimizer: "1-bit state",
                detail: format!("the saved state has no buffer `{name}`"),
            })?;
        let (_, values) = self.buffers.remove(i);
        if len != usize::MAX && values.len() != len {
            return Err(CommError::Optimizer {
                optimizer: "1-bit state",
                detail: format!(
                    "buffer `{name}` holds {} elements; this optimizer needs {len}",
                    values.len()
                ),
            });
        }
        Ok(values)
    }
}

/// 1-bit LAMB's saved buffers, host or device: the moments (`n` elements), the fresh variance
/// (`n`, or empty before the last warm-up step), and per tensor (`k`) the frozen trust ratio,
/// the last factor and the momentum scale (empty before the first compressed step).
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct LambBuffers {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub v_fresh: Vec<f32>,
    pub coeff_freeze: Vec<f32>,
    pub last_factor: Vec<f32>,
    pub scaling: Vec<f32>,
}

impl LambBuffers {
    /// The buffers of a saved state for `n` elements in `k` tensors, checked.
    pub fn take(mut state: OneBitState, n: usize, k: usize) -> Result<(u64, Self)> {
        let b = Self {
            m: state.take("m", n)?,
            v: state.take("v", n)?,
            v_fresh: state.take("v_fresh", usize::MAX)?,
            coeff_freeze: state.take("coeff_freeze", k)?,
            last_factor: state.take("last_factor", k)?,
            scaling: state.take("scaling", usize::MAX)?,
        };
        if !(b.v_fresh.is_empty() || b.v_fresh.len() == n)
            || !(b.scaling.is_empty() || b.scaling.len() == k)
        {
            return Err(CommError::Optimizer {
                optimizer: "1-bit LAMB",
                detail: format!(
                    "saved v_fresh ({}) or scaling ({}) fits neither {n} elements nor {k} tensors",
                    b.v_fresh.len(),
                    b.scaling.len()
                ),
            });
        }
        Ok((state.step, b))
    }

    /// The state a checkpoint keeps at optimizer step `step`.
    pub fn into_state(self, step: u64) -> OneBitState {
        OneBitState {
            step,
            buffers: vec![
                ("m".into(), self.m),
                ("v".into(), self.v),
                ("v_fresh".into(), self.v_fresh),
                ("coeff_freeze".into(), self.coeff_freeze),
                ("last_factor".into(), self.last_factor),
                ("scaling".into(), self.scaling),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_checks_names_and_lengths() {
        let mut s = OneBitState {
            step: 3,
            buffers: vec![("m".into(), vec![1.0; 4]), ("v".into(), vec![2.0; 3])],
        };
        let err = s.clone().take("x", 4).unwrap_err().to_string();
        assert!(err.contains("no buffer `x`"), "{err}");
        let err = s.clone().take("v", 4).unwrap_err().to_string();
        assert!(
            err.contains("holds 3 elements; this optimizer needs 4"),
            "{err}"
        );
        assert_eq!(s.take("m", 4).expect("m"), vec![1.0; 4]);
        assert_eq!(s.buffers.len(), 1);
    }
}
