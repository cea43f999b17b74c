//! A plain device copy: the memory-bandwidth bound that `kernel-bench` measures the fused
//! kernels against on the same device.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid::{UNITS, arg, cover, holds};
use crate::KernelError;

#[cube(launch_unchecked)]
fn copy_kernel(src: &[f32], dst: &mut [f32]) {
    if ABSOLUTE_POS < dst.len() {
        dst[ABSOLUTE_POS] = src[ABSOLUTE_POS];
    }
}

/// Copies `n` f32 values from `src` to `dst` (reads 4 and writes 4 bytes per value).
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` f32 values.
pub fn copy(client: &Client, n: usize, src: &Handle, dst: &Handle) -> Result<(), KernelError> {
    holds::<f32>("copy", "src", src, n)?;
    holds::<f32>("copy", "dst", dst, n)?;
    if n == 0 {
        return Ok(());
    }
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against `n`, and both buffers hold `n` values.
    unsafe {
        copy_kernel::launch_unchecked(client, count, dim, arg(src, n), arg(dst, n));
    }
    Ok(())
}

/// Waits until every kernel launched on `client` has finished.
///
/// # Panics
/// When the device reports an error.
pub fn wait(client: &Client) {
    block_on(client.sync()).expect("the device finished its work");
}

/// Runs a future to completion on this thread, parking between polls.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(out) => return out,
            Poll::Pending => std::thread::park(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::grid::{download, upload};
    use super::super::tests::clients;
    use super::*;

    #[test]
    fn copies_every_value() {
        for (name, client) in clients() {
            for n in [1usize, 7, 65537] {
                let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
                let (src, dst) = (upload(&client, &x), client.empty(n * 4));
                copy(&client, n, &src, &dst).expect("n values each");
                wait(&client);
                assert_eq!(download::<f32>(&client, &dst), x, "{name} n {n}");
            }
        }
    }
}
