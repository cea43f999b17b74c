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
