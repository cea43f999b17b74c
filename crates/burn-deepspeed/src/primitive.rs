//! A custom op's float primitives as rank-1 [`Tensor`]s of their device and back, without a
//! copy: how the ops' backward passes hand their values to code written against `Tensor`
//! (the ZeRO-3 group's device collectives, an activation checkpoint's recompute) while the
//! values stay on the device.

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, TensorMetadata};
use burn::tensor::{Shape, Tensor};

/// The backends whose float primitives the engine's custom ops move as tensors.
pub trait FlatPrimitive: Backend {
    /// `t`'s values, flat, as a tensor of its device (no autodiff).
    fn into_flat(t: FloatTensor<Self>) -> Tensor<1>;
    /// A flat tensor of this backend's device back as a primitive of `shape`.
    ///
    /// # Panics
    /// When `t` lives on another backend.
    fn from_flat(t: Tensor<1>, shape: Shape) -> FloatTensor<Self>;
}

/// `inner` (a tensor without autodiff) in the autodiff context of `like`: autodiff with the
/// same gradient-checkpointing strategy (Burn refuses an op between tensors of different
/// strategies, and ZeRO-3's gathers rely on the checkpointing one), or as it is when `like`
/// has no autodiff.
pub fn autodiff_like<const D: usize, const E: usize>(
    inner: Tensor<D>,
    like: &Tensor<E>,
) -> Tensor<D> {
    match like.gradient_checkpointing_strategy() {
        Some(strategy) => inner
            .autodiff()
            .with_gradient_checkpointing_strategy(strategy),
        None => inner,
    }
}

macro_rules! flat_primitive {
    ($backend:ty) => {
        impl FlatPrimitive for $backend {
            fn into_flat(t: FloatTensor<Self>) -> Tensor<1> {
                let n = t.shape().num_elements();
                Tensor::from_primitive::<Self>(Self::float_reshape(t, Shape::new([n])))
            }

            fn from_flat(t: Tensor<1>, shape: Shape) -> FloatTensor<Self> {
                let prim = t
                    .try_into_primitive::<Self>()
                    .expect("a flat tensor of the op's own backend");
                Self::float_reshape(prim, shape)
            }
        }
    };
}

flat_primitive!(Flex);
#[cfg(feature = "cube")]
flat_primitive!(burn::backend::Cube);

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    #[test]
    fn flex_primitives_round_trip_flat() {
        let t = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]),
            &burn::tensor::Device::flex(),
        );
        let prim = t.try_into_primitive::<Flex>().expect("a Flex tensor");
        let flat = Flex::into_flat(prim);
        assert_eq!(flat.dims(), [6]);
        let back = Flex::from_flat(flat, Shape::new([3, 2]));
        assert_eq!(back.shape(), Shape::new([3, 2]));
        let values = Tensor::<2>::from_primitive::<Flex>(back).into_data();
        assert_eq!(
            values.try_to_vec::<f32>().expect("f32"),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
    }
}
