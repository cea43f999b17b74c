//! Inference (DeepSpeed-Inference's generation side): a preallocated key/value cache per
//! attention layer written in place ([`KvCache`]), token sampling with a seed
//! ([`Sampling`]), and the generation loop ([`generate`]) over any model that implements
//! [`CausalLm`], sliced across a tensor-parallel group or whole, its weights in f32 or
//! quantized to INT8 or INT4 ([`QuantizedMatrix`]).

mod generate;
mod kv_cache;
mod quantized;
mod sampling;

pub use generate::*;
pub use kv_cache::*;
pub use quantized::*;
pub use sampling::*;
