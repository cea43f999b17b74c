//! Launch shapes and buffer helpers shared by the kernels.

use cubecl::calculate_cube_count_elemwise;
use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Units per cube of the element-wise kernels (WebGPU guarantees 256).
pub(crate) const UNITS: u32 = 256;

/// Units per cube of the kernels that reduce in shared memory: a power of two the device
/// allows, at most [`UNITS`].
pub(crate) fn reduce_units(client: &Client) -> u32 {
    let cap = UNITS.min(client.properties().hardware.max_units_per_cube.max(1));
    if cap.is_power_of_two() {
        cap
    } else {
        cap.next_power_of_two() >> 1
    }
}

/// The cubes that cover `n` work items with `units` units each (spread over two dimensions
/// past the device's limit on one), and their number.
pub(crate) fn cover(client: &Client, n: usize, units: u32) -> (CubeCount, CubeDim, usize) {
    let dim = CubeDim::new_1d(units);
    let count = calculate_cube_count_elemwise(client, n.max(1), dim);
    let cubes = match count {
        CubeCount::Static(x, y, z) => (x * y * z) as usize,
        CubeCount::Dynamic(_) => unreachable!("element-wise counts are static"),
    };
    (count, dim, cubes)
}

/// A buffer argument over `len` elements of `handle`.
pub(crate) fn arg(handle: &Handle, len: usize) -> BufferArg {
    // SAFETY: every kernel here guards its indices against `len`, which callers take from the
    // buffer they created.
    unsafe { BufferArg::from_raw_parts(handle.clone(), len) }
}

/// A device buffer of `values`.
pub fn upload<T: CubeElement>(client: &Client, values: &[T]) -> Handle {
    client.create_from_slice(T::as_bytes(values))
}

/// The values of a device buffer (waits for the kernels that write it).
pub fn download<T: CubeElement>(client: &Client, handle: &Handle) -> Vec<T> {
    T::from_bytes(&client.read_one_unchecked(handle.clone())).to_vec()
}
