//! [`KvCache`]: one attention layer's keys and values for a batch of sequences, preallocated
//! to the longest sequence generation allows and written in place, so that a decode step
//! costs the new token's keys and values, not a copy of the cache.

use burn::tensor::{DType, Device, Tensor};

use crate::{DeepSpeedError, Result};

/// Keys and values `[batch, heads, capacity, d_head]` of one attention layer, the first
/// [`len`](Self::len) positions filled.
///
/// [`append`](Self::append) writes the new positions into the preallocated buffers (Burn's
/// `slice_assign`, which writes in place when the buffer is not shared) and returns views
/// of the filled prefix. Drop those views before the next append (a layer's attention does):
/// a live view makes the next write copy the buffer.
#[derive(Debug)]
pub struct KvCache {
    keys: Option<Tensor<4>>,
    values: Option<Tensor<4>>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache of `capacity` positions for `batch` sequences of `heads` heads of
    /// `d_head` features, in `dtype` on `device` (a device without autodiff: inference).
    pub fn new(
        batch: usize,
        heads: usize,
        capacity: usize,
        d_head: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let zeros = || {
            Some(Tensor::<4>::zeros(
                [batch, heads, capacity, d_head],
                (device, dtype),
            ))
        };
        Self {
            keys: zeros(),
            values: zeros(),
            len: 0,
            capacity,
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No position filled yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of its two buffers.
    pub fn bytes(&self) -> u64 {
        [&self.keys, &self.values]
            .into_iter()
            .flatten()
            .map(|t| (t.shape().num_elements() * t.dtype().size()) as u64)
            .sum()
    }

    /// Writes `keys` and `values` `[batch, heads, t, d_head]` at positions `len..len + t`
    /// and returns the filled prefixes `[batch, heads, len + t, d_head]`. Refuses to grow
    /// past the capacity.
    pub fn append(&mut self, keys: Tensor<4>, values: Tensor<4>) -> Result<(Tensor<4>, Tensor<4>)> {
        let [_, _, t, _] = keys.dims();
        let end = self.len + t;
        if end > self.capacity {
            return Err(DeepSpeedError::Data(format!(
                "the key/value cache holds {} positions; {end} were asked for (raise \
                 max_out_tokens)",
                self.capacity
            )));
        }
        let (start, len) = (self.len, end);
        let write = |buffer: &mut Option<Tensor<4>>, new: Tensor<4>| {
            let whole = buffer
                .take()
                .expect("the cache's buffers are always present");
            let [b, h, _, d] = whole.dims();
            let whole = whole.slice_assign([0..b, 0..h, start..end, 0..d], new);
            let prefix = whole.clone().slice([0..b, 0..h, 0..len, 0..d]);
            *buffer = Some(whole);
            prefix
        };
        let k = write(&mut self.keys, keys);
        let v = write(&mut self.values, values);
        self.len = end;
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    fn filled(t: usize, value: f32) -> Tensor<4> {
        Tensor::from_data(
            TensorData::new(vec![value; 2 * 3 * t * 4], [2, 3, t, 4]),
            &Device::flex(),
        )
    }

    #[test]
    fn appends_fill_the_prefix_in_order_and_refuse_overflow() {
        let mut cache = KvCache::new(2, 3, 5, 4, DType::F32, &Device::flex());
        let (k, _) = cache.append(filled(2, 1.0), filled(2, -1.0)).expect("fits");
        assert_eq!(k.dims(), [2, 3, 2, 4]);
        drop(k);
        let (k, v) = cache.append(filled(1, 2.0), filled(1, -2.0)).expect("fits");
        assert_eq!(cache.len(), 3);
        let k = k.into_data().try_to_vec::<f32>().expect("f32");
        // Position 2 of every (batch, head) holds the second append.
        assert_eq!(
            &k[..12],
            &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
        );
        assert_eq!(v.into_data().try_to_vec::<f32>().expect("f32")[8], -2.0);
        let e = cache
            .append(filled(3, 0.0), filled(3, 0.0))
            .expect_err("5 positions");
        assert!(e.to_string().contains("max_out_tokens"), "{e}");
        assert_eq!(cache.bytes(), 2 * 2 * 3 * 5 * 4 * 4);
    }
}
