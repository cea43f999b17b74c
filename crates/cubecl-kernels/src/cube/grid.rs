//! Launch shapes and buffer helpers shared by the kernels.

use cubecl::calculate_cube_count_elemwise;
use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::KernelError;

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

/// Refuses `handle` (argument `name` of `op`) when it holds fewer than `len` elements of
/// `T`. A handle is untyped bytes: this is what makes every access of a kernel that guards
/// its indices against `len` fall inside the buffer.
pub(crate) fn holds<T>(
    op: &'static str,
    name: &str,
    handle: &Handle,
    len: usize,
) -> Result<(), KernelError> {
    let need = (len as u64).checked_mul(size_of::<T>() as u64);
    let have = handle.size_in_used();
    match need {
        Some(need) if need <= have => Ok(()),
        _ => Err(KernelError::Arguments {
            op,
            detail: format!(
                "`{name}` holds {have} bytes; {len} values of {} need {}",
                std::any::type_name::<T>(),
                need.map_or("more than 2^64".to_string(), |b| b.to_string())
            ),
        }),
    }
}

/// A buffer argument over `len` elements of `handle`.
pub(crate) fn arg(handle: &Handle, len: usize) -> BufferArg {
    // SAFETY: every kernel here guards its indices against `len`, and every public function
    // checks with `holds` that the buffer has `len` elements before it launches.
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
