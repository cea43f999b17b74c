//! The grid of pipeline stages x data-parallel replicas (DeepSpeed's `PipeDataParallelTopology`,
//! axes `[pipe, data]`, the data axis varying fastest).

use crate::{CommError, Result};

/// Where each rank sits in a pp x dp grid: `rank = stage * replicas + replica`.
///
/// Ranks of one replica (a column) form a pipeline and exchange activations; ranks of one
/// stage (a row) hold the same layers and average their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeDataTopology {
    /// Pipeline stages (pp).
    pub stages: usize,
    /// Data-parallel replicas of the whole pipeline (dp).
    pub replicas: usize,
}

impl PipeDataTopology {
    /// The grid for `world` ranks split into `stages` stages.
    pub fn new(world: usize, stages: usize) -> Result<Self> {
        if stages == 0 || world == 0 || !world.is_multiple_of(stages) {
            return Err(CommError::Pipeline(format!(
                "{world} ranks cannot be split into {stages} pipeline stages: the world size \
                 must be a multiple of the stage count"
            )));
        }
        Ok(Self {
            stages,
            replicas: world / stages,
        })
    }

    /// Total ranks.
    pub fn world(&self) -> usize {
        self.stages * self.replicas
    }

    /// The rank of `stage` in `replica`.
    pub fn rank_of(&self, stage: usize, replica: usize) -> usize {
        stage * self.replicas + replica
    }

    /// `(stage, replica)` of `rank`.
    pub fn coords(&self, rank: usize) -> (usize, usize) {
        (rank / self.replicas, rank % self.replicas)
    }

    /// The ranks holding `stage`, one per replica (its data-parallel group).
    pub fn data_group(&self, stage: usize) -> Vec<usize> {
        (0..self.replicas).map(|d| self.rank_of(stage, d)).collect()
    }

    /// The ranks of `replica`'s pipeline, first stage first.
    pub fn pipe_group(&self, replica: usize) -> Vec<usize> {
        (0..self.stages).map(|s| self.rank_of(s, replica)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_of_two_by_two_matches_deepspeed() {
        // DeepSpeed: PipeDataParallelTopology(num_pp=2, num_dp=2) puts data fastest:
        // pipe groups [0, 2] and [1, 3], data groups [0, 1] and [2, 3].
        let t = PipeDataTopology::new(4, 2).unwrap();
        assert_eq!(t.replicas, 2);
        assert_eq!(t.pipe_group(0), vec![0, 2]);
        assert_eq!(t.pipe_group(1), vec![1, 3]);
        assert_eq!(t.data_group(0), vec![0, 1]);
        assert_eq!(t.data_group(1), vec![2, 3]);
        for r in 0..4 {
            let (s, d) = t.coords(r);
            assert_eq!(t.rank_of(s, d), r);
        }
    }

    #[test]
    fn every_rank_is_in_one_pipe_and_one_data_group() {
        for (world, stages) in [(1, 1), (4, 1), (4, 4), (6, 3), (8, 2)] {
            let t = PipeDataTopology::new(world, stages).unwrap();
            let mut seen = vec![0; world];
            for d in 0..t.replicas {
                for r in t.pipe_group(d) {
                    seen[r] += 1;
                }
            }
            for s in 0..t.stages {
                for r in t.data_group(s) {
                    seen[r] += 10;
                }
            }
            assert!(seen.iter().all(|&c| c == 11), "{world}/{stages}: {seen:?}");
        }
    }

    #[test]
    fn a_world_that_does_not_divide_is_refused() {
        let e = PipeDataTopology::new(6, 4).unwrap_err().to_string();
        assert!(
            e.contains("6 ranks cannot be split into 4 pipeline stages"),
            "{e}"
        );
    }
}
