//! Sequence parallelism as DeepSpeed-Ulysses does it (Jacobs et al., arXiv 2309.14509): each
//! rank of a sequence-parallel group holds `seq / sp` consecutive positions of every
//! sequence, and around attention two all-to-alls trade the sequence cut for a cut of the
//! heads, so that each rank attends over whole sequences for `heads / sp` heads.

mod group;

pub use group::*;
