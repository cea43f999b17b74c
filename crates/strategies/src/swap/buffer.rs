//! [`AlignedBuf`]: zeroed host memory aligned to [`ALIGN`], as `O_DIRECT` transfers need.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ptr::NonNull;

use super::ALIGN;

/// A zeroed, [`ALIGN`]-aligned byte buffer whose length is a multiple of [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `bytes` bytes (rounded up to [`ALIGN`]; at least one
    /// block).
    ///
    /// # Panics
    /// When `bytes` rounded up is more than memory can address (as `Vec::with_capacity`).
    pub fn new(bytes: usize) -> Self {
        let len = (bytes.max(1).checked_next_multiple_of(ALIGN))
            .expect("an aligned swap buffer fits in the address space");
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, ALIGN).expect("an aligned swap buffer fits in memory")
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one block.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as `f32` values.
    pub fn floats(&self) -> &[f32] {
        bytemuck::cast_slice(self.bytes())
    }

    /// The buffer as writable `f32` values.
    pub fn floats_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size near `usize::MAX` would wrap to a small buffer when rounded up: it panics
    /// instead, as `Vec::with_capacity` does.
    #[test]
    #[should_panic(expected = "fits in the address space")]
    fn a_size_that_cannot_be_rounded_up_panics() {
        let _ = AlignedBuf::new(usize::MAX - 1);
    }

    #[test]
    fn buffers_are_aligned_zeroed_and_rounded_up() {
        for bytes in [0, 1, 4095, 4096, 4097, 3 * 4096 + 12] {
            let mut b = AlignedBuf::new(bytes);
            assert_eq!(b.bytes().as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.len() % ALIGN, 0);
            assert!(b.len() >= bytes.max(1));
            assert!(b.bytes().iter().all(|&x| x == 0));
            b.floats_mut()[3] = 2.5;
            assert_eq!(b.floats()[3], 2.5);
        }
    }
}
