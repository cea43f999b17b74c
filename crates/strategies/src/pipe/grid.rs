//! The 3D grid of pipeline stages x data-parallel replicas x tensor-parallel slices
//! (DeepSpeed's `PipeModelDataParallelTopology`, axes `[pipe, data, model]`: the tensor axis
//! varies fastest, so a tensor-parallel group is consecutive ranks, which a launcher places on
//! one node where its all-reduces run over the fastest links).

use crate::{CommError, Result};

/// A rank's place in the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GridCoord {
    /// Pipeline stage.
    pub pipe: usize,
    /// Data-parallel replica.
    pub data: usize,
    /// Tensor-parallel slice.
    pub tensor: usize,
}

/// Where each rank sits in a pp x dp x tp grid: `rank = (pipe · dp + data) · tp + tensor`.
///
/// Ranks that differ only in `tensor` hold the slices of the same layers and all-reduce
/// activations (a tensor-parallel group); ranks that differ only in `data` hold the same
/// slice of the same stage and average gradients (a data-parallel group, where ZeRO cuts the
/// state); ranks that differ only in `pipe` form one pipeline of one slice. With `tensor = 1`
/// the order is [`PipeDataTopology`](super::PipeDataTopology)'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridTopology {
    /// Pipeline stages (pp).
    pub pipe: usize,
    /// Data-parallel replicas (dp), derived from the world size.
    pub data: usize,
    /// Tensor-parallel slices (tp).
    pub tensor: usize,
}

/// One axis of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GridAxis {
    /// The pipeline axis.
    Pipe,
    /// The data-parallel axis.
    Data,
    /// The tensor-parallel axis.
    Tensor,
}

impl GridTopology {
    /// The grid for `world` ranks in `pipe` stages of `tensor` slices each; the replicas take
    /// the rest.
    pub fn new(world: usize, pipe: usize, tensor: usize) -> Result<Self> {
        let cell = pipe.saturating_mul(tensor);
        if pipe == 0 || tensor == 0 || world == 0 || !world.is_multiple_of(cell) {
            return Err(CommError::Pipeline(format!(
                "{world} ranks cannot be split into {pipe} pipeline stages x {tensor} tensor \
                 slices: the world size must be a multiple of pp x tp = {cell}"
            )));
        }
        Ok(Self {
            pipe,
            data: world / cell,
            tensor,
        })
    }

    /// Total ranks.
    pub fn world(&self) -> usize {
        self.pipe * self.data * self.tensor
    }

    /// The rank at `c`.
    pub fn rank_of(&self, c: GridCoord) -> usize {
        (c.pipe * self.data + c.data) * self.tensor + c.tensor
    }

    /// The place of `rank`.
    pub fn coords(&self, rank: usize) -> GridCoord {
        GridCoord {
            pipe: rank / (self.data * self.tensor),
            data: (rank / self.tensor) % self.data,
            tensor: rank % self.tensor,
        }
    }

    /// The ranks that share every coordinate of `rank` but `axis`, in `axis` order: its
    /// group along that axis.
    pub fn group(&self, axis: GridAxis, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        let len = self.len(axis);
        (0..len)
            .map(|i| {
                self.rank_of(match axis {
                    GridAxis::Pipe => GridCoord { pipe: i, ..c },
                    GridAxis::Data => GridCoord { data: i, ..c },
                    GridAxis::Tensor => GridCoord { tensor: i, ..c },
                })
            })
            .collect()
    }

    /// Every group along `axis`, each in `axis` order, ordered by their first rank.
    pub fn groups(&self, axis: GridAxis) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = (0..self.world())
            .filter(|&r| self.index(axis, r) == 0)
            .map(|r| self.group(axis, r))
            .collect();
        out.sort();
        out
    }

    /// The `color` that puts `rank` with its group along `axis` in
    /// [`Communicator::split`](crate::comm::Communicator::split) (the group's first rank);
    /// the split ranks each group in rank order, which is `axis` order.
    pub fn color(&self, axis: GridAxis, rank: usize) -> usize {
        self.group(axis, rank)[0]
    }

    /// The size of `axis`.
    pub fn len(&self, axis: GridAxis) -> usize {
        match axis {
            GridAxis::Pipe => self.pipe,
            GridAxis::Data => self.data,
            GridAxis::Tensor => self.tensor,
        }
    }

    /// `rank`'s coordinate on `axis`.
    pub fn index(&self, axis: GridAxis, rank: usize) -> usize {
        let c = self.coords(rank);
        match axis {
            GridAxis::Pipe => c.pipe,
            GridAxis::Data => c.data,
            GridAxis::Tensor => c.tensor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipe::PipeDataTopology;

    const AXES: [GridAxis; 3] = [GridAxis::Pipe, GridAxis::Data, GridAxis::Tensor];

    #[test]
    fn two_by_two_by_two_matches_deepspeed() {
        // DeepSpeed: PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2), axes
        // [pipe, data, model]: model groups are consecutive ranks.
        let t = GridTopology::new(8, 2, 2).unwrap();
        assert_eq!(t.data, 2);
        assert_eq!(
            t.groups(GridAxis::Tensor),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            t.groups(GridAxis::Data),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            t.groups(GridAxis::Pipe),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            t.coords(5),
            GridCoord {
                pipe: 1,
                data: 0,
                tensor: 1
            }
        );
    }

    #[test]
    fn every_rank_is_in_one_group_per_axis_and_round_trips() {
        for (world, pipe, tensor) in [(1, 1, 1), (8, 2, 2), (8, 1, 4), (8, 4, 1), (12, 3, 2)] {
            let t = GridTopology::new(world, pipe, tensor).unwrap();
            assert_eq!(t.world(), world);
            for axis in AXES {
                let groups = t.groups(axis);
                assert_eq!(groups.len() * t.len(axis), world, "{axis:?}");
                let mut seen = vec![0; world];
                for g in &groups {
                    assert_eq!(g.len(), t.len(axis));
                    for (i, &r) in g.iter().enumerate() {
                        seen[r] += 1;
                        assert_eq!(t.index(axis, r), i, "{axis:?} order");
                        assert_eq!(t.color(axis, r), g[0]);
                    }
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{world}/{pipe}/{tensor} {axis:?}"
                );
            }
            for r in 0..world {
                assert_eq!(t.rank_of(t.coords(r)), r);
            }
        }
    }

    #[test]
    fn without_tensor_slices_it_is_the_pipe_data_grid() {
        let grid = GridTopology::new(6, 3, 1).unwrap();
        let pd = PipeDataTopology::new(6, 3).unwrap();
        for r in 0..6 {
            let c = grid.coords(r);
            assert_eq!(pd.coords(r), (c.pipe, c.data));
        }
        assert_eq!(grid.group(GridAxis::Data, 2), pd.data_group(1));
        assert_eq!(grid.group(GridAxis::Pipe, 1), pd.pipe_group(1));
    }

    /// Splitting a thread world by each axis's color gives each rank its group, ranked in
    /// the axis's order: a sum over the group adds exactly the group's ranks.
    #[test]
    fn split_by_color_forms_the_groups() {
        use crate::comm::{
            Communicator, CommunicatorExt, ReduceOp, ThreadWorld, ThreadWorldOptions,
        };
        let t = GridTopology::new(8, 2, 2).unwrap();
        let out = ThreadWorld::run(8, ThreadWorldOptions::default(), |c| {
            let rank = c.rank();
            AXES.map(|axis| {
                let g = c.split(t.color(axis, rank)).expect("a split");
                let mut sum = [rank as f32];
                g.all_reduce(&mut sum, ReduceOp::Sum)
                    .expect("an all-reduce");
                (g.rank(), g.world_size(), sum[0])
            })
        });
        for (rank, r) in out.into_iter().enumerate() {
            let got = r.expect("the rank ran");
            for (axis, (g_rank, g_world, sum)) in AXES.into_iter().zip(got) {
                let group = t.group(axis, rank);
                assert_eq!(g_rank, t.index(axis, rank), "{axis:?}");
                assert_eq!(g_world, group.len(), "{axis:?}");
                assert_eq!(sum, group.iter().sum::<usize>() as f32, "{axis:?}");
            }
        }
    }

    #[test]
    fn a_world_that_does_not_divide_is_refused() {
        let e = GridTopology::new(8, 3, 2).unwrap_err().to_string();
        assert!(e.contains("multiple of pp x tp = 6"), "{e}");
        assert!(GridTopology::new(8, 2, 0).is_err());
    }
}
