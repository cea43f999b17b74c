//! The GPT's deterministic initialization from a seed (every rank builds the same model).

use burn::module::{ModuleMapper, Param};

use burn::tensor::{Device, Tensor, TensorData};

/// Re-initializes every parameter deterministically from a seed and its position.
pub(crate) struct GptInit {
    pub(crate) seed: u64,
    pub(crate) layers: usize,
    pub(crate) path: Vec<String>,
    pub(crate) index: u64,
}

impl GptInit {
    pub(crate) fn new(seed: u64, layers: usize) -> Self {
        Self {
            seed,
            layers,
            path: Vec::new(),
            index: 0,
        }
    }
}

impl ModuleMapper for GptInit {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }

    /// Lazy: the values are made when the parameter is first read, so that a model larger
    /// than memory is never whole (ZeRO-3 with `offload_param` cuts it tensor by tensor).
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, shape, device) = (param.id, param.lazy_shape(), param.lazy_device());
        let n = shape.num_elements();
        let name = self.path.last().map(String::as_str).unwrap_or("");
        let in_residual_out =
            (self.path.iter()).any(|p| p == "attn_out" || p == "mlp_out" || p == "fc_out");
        let seed = self.seed ^ (self.index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.index += 1;
        let std = match name {
            "gamma" => None,
            "beta" | "bias" => Some(0.0),
            _ if in_residual_out => Some(0.02 / (2.0 * self.layers as f64).sqrt()),
            _ => Some(0.02),
        };
        let dims = shape.clone();
        let init = move |device: &Device, require_grad: bool| {
            let values: Vec<f32> = match std {
                None => vec![1.0; n],
                Some(0.0) => vec![0.0; n],
                Some(std) => {
                    let mut rng = SplitMix64::new(seed);
                    (0..n).map(|_| (rng.normal() * std) as f32).collect()
                }
            };
            Tensor::<D>::from_data(TensorData::new(values, dims), device)
                .set_require_grad(require_grad)
        };
        Param::uninitialized(id, init, device, true, shape)
    }
}

/// A small, fast, seedable generator (SplitMix64), for reproducible init and sampling.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// MoE block `l`'s draws' seed from the rank's `seed`.
pub(crate) fn layer_seed(seed: u64, l: usize) -> u64 {
    seed ^ (l as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
