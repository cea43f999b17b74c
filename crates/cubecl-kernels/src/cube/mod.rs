//! The CubeCL kernels: the same ops as the CPU path, for every CubeCL runtime built (wgpu,
//! which runs on a CPU through Mesa's lavapipe, and CUDA). They take a [`Client`] and device
//! buffers ([`Handle`]s), so they serve Burn's `Cube` backend (see [`crate::ext`]) and any
//! other CubeCL program alike.
//!
//! [`Client`]: cubecl::client::Client
//! [`Handle`]: cubecl::server::Handle

pub mod adam;
pub mod copy;
mod grid;
pub mod lamb;
pub mod quantize;
mod reduce;
pub mod sign;

pub use grid::{download, upload};

#[cfg(test)]
pub(crate) mod tests {
    use cubecl::client::Client;
    use cubecl::ir::{ElemType, FloatKind};

    /// A client of every runtime this build links. With the `cuda` feature a CUDA device
    /// must be present: these tests fail rather than skip without one.
    #[allow(clippy::vec_init_then_push)]
    pub(crate) fn clients() -> Vec<(String, Client)> {
        #[allow(unused_mut)]
        let mut out: Vec<(String, Client)> = Vec::new();
        #[cfg(feature = "wgpu")]
        out.push((
            "wgpu".into(),
            cubecl::Device::Wgpu(Default::default()).client(),
        ));
        #[cfg(feature = "cuda")]
        {
            let device =
                cubecl::Device::cuda(0).expect("the `cuda` feature's tests need a CUDA device");
            out.push(("cuda".into(), device.client()));
        }
        assert!(!out.is_empty(), "a runtime feature is needed");
        for (name, client) in &out {
            println!("runtime {name}: {}", client.name());
        }
        out
    }

    /// Whether the runtime behind `client` stores and computes with `P`.
    pub(crate) fn supports<P: 'static>(client: &Client) -> bool {
        let kind = if std::any::TypeId::of::<P>() == std::any::TypeId::of::<half::f16>() {
            FloatKind::F16
        } else if std::any::TypeId::of::<P>() == std::any::TypeId::of::<half::bf16>() {
            FloatKind::BF16
        } else {
            FloatKind::F32
        };
        client.properties().supports_type(ElemType::Float(kind))
    }
}
