//! Sums across a cube in shared memory, for the kernels that also return a norm.

use cubecl::prelude::*;

/// Sums `value` over the units of this cube (`CUBE_DIM` a power of two, `shared` one slot
/// per unit); every unit must call it. Returns the total on unit 0.
#[cube]
pub(crate) fn cube_sum(shared: &mut Shared<[f32]>, value: f32) -> f32 {
    tree(shared, value, false)
}

/// The largest `value` over the units of this cube, like [`cube_sum`].
#[cube]
pub(crate) fn cube_max(shared: &mut Shared<[f32]>, value: f32) -> f32 {
    tree(shared, value, true)
}

/// A tree over shared memory: each round, the lower half of the active units folds in the
/// upper half's values (a sum, or the larger one).
#[cube]
fn tree(shared: &mut Shared<[f32]>, value: f32, #[comptime] max: bool) -> f32 {
    shared[UNIT_POS as usize] = value;
    sync_cube();
    let mut active = CUBE_DIM;
    while active > 1 {
        active /= 2;
        if UNIT_POS < active {
            let mine = shared[UNIT_POS as usize];
            let other = shared[(UNIT_POS + active) as usize];
            shared[UNIT_POS as usize] = if max {
                select(other > mine, other, mine)
            } else {
                mine + other
            };
        }
        sync_cube();
    }
    shared[0]
}
