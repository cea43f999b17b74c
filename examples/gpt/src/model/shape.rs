//! The GPT's sizes: the presets, and the shape of a GPT-MoE's expert layers.

/// Vocabulary: one token per byte.
pub const VOCAB: usize = 256;

/// Size of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptShape {
    /// Model width.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub seq_len: usize,
    /// Mixture of Experts in every other block (GPT-MoE), or none.
    pub moe: Option<MoeShape>,
}

/// The MoE layers of a GPT-MoE (DeepSpeed-MoE, arXiv 2201.05596): every other block's MLP
/// (the second, fourth, ...) is an MoE layer of experts shaped like that MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token (1 or 2).
    pub k: usize,
    /// PR-MoE's residual: a dense MLP beside the experts.
    pub residual: bool,
    /// PR-MoE's pyramid: more experts in the last MoE layers.
    pub pyramid: Option<Pyramid>,
}

/// PR-MoE's pyramid (arXiv 2201.05596 §4.1: experts help the deeper layers more): the last
/// `layers` MoE layers hold `experts` experts each, the earlier ones [`MoeShape::experts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pyramid {
    /// MoE layers at the end of the model with more experts.
    pub layers: usize,
    /// Experts in each of them.
    pub experts: usize,
}

impl MoeShape {
    /// Experts of MoE layer `index` of `count` (0-based, in model order).
    pub fn experts_at(&self, index: usize, count: usize) -> usize {
        match self.pyramid {
            Some(p) if index + p.layers >= count => p.experts,
            _ => self.experts,
        }
    }
}

/// The load-balancing loss's coefficient in the training loss (Megatron-DeepSpeed's
/// `--moe-loss-coeff` default).
pub const MOE_LOSS_COEF: f64 = 0.01;

impl GptShape {
    /// d 128, 4 layers, 4 heads, context 128 (about 0.9M parameters).
    pub const TINY: GptShape = GptShape {
        d_model: 128,
        layers: 4,
        heads: 4,
        seq_len: 128,
        moe: None,
    };
    /// d 256, 8 layers, 8 heads, context 256 (about 6.5M parameters).
    pub const SMALL: GptShape = GptShape {
        d_model: 256,
        layers: 8,
        heads: 8,
        seq_len: 256,
        moe: None,
    };

    /// d 512, 16 layers, 8 heads, context 256 (about 50.7M parameters).
    pub const MEDIUM: GptShape = GptShape {
        d_model: 512,
        layers: 16,
        heads: 8,
        seq_len: 256,
        moe: None,
    };

    /// GPT-2 small's body (Radford et al. 2019; the model llm.c and nanoGPT train): d 768,
    /// 12 layers, 12 heads, context 1024; about 86M parameters with this example's byte
    /// vocabulary of 256, where GPT-2's 124M include a 50,257-token embedding (38.6M) tied to
    /// its output layer. Per token the blocks do the same work; only the embedding and the
    /// output layer are smaller.
    pub const GPT2: GptShape = GptShape {
        d_model: 768,
        layers: 12,
        heads: 12,
        seq_len: 1024,
        moe: None,
    };

    /// d 2048, 40 layers, 16 heads, context 128 (about 2.01B parameters: its fp32 Adam
    /// state alone, 16 bytes per parameter, is 32 GB). Built lazily: [`Gpt::new`](super::Gpt::new) makes no
    /// values until a parameter is read, so that ZeRO-3 with `offload_param` cuts it into
    /// its store one tensor at a time.
    pub const XL: GptShape = GptShape {
        d_model: 2048,
        layers: 40,
        heads: 16,
        seq_len: 128,
        moe: None,
    };

    /// `tiny` with 4 experts, top-1, in blocks 2 and 4.
    pub const TINY_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 4,
            k: 1,
            residual: false,
            pyramid: None,
        }),
        ..Self::TINY
    };

    /// `small` with 8 experts, top-1, in every other block (the same compute per token:
    /// each token runs one expert the size of the dense MLP).
    pub const SMALL_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 8,
            k: 1,
            residual: false,
            pyramid: None,
        }),
        ..Self::SMALL
    };

    /// `tiny-moe` as PR-MoE: a dense MLP beside the experts of each MoE block, 2 experts in
    /// block 2 and 4 in block 4 (the pyramid).
    pub const TINY_PR_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 2,
            k: 1,
            residual: true,
            pyramid: Some(Pyramid {
                layers: 1,
                experts: 4,
            }),
        }),
        ..Self::TINY
    };

    /// `small-moe` as PR-MoE: a dense MLP beside the experts of each MoE block, 2 experts in
    /// the first two MoE blocks and 4 in the last two (the pyramid): half the experts'
    /// parameters of `small-moe`, with the residual MLPs.
    pub const SMALL_PR_MOE: GptShape = GptShape {
        moe: Some(MoeShape {
            experts: 2,
            k: 1,
            residual: true,
            pyramid: Some(Pyramid {
                layers: 2,
                experts: 4,
            }),
        }),
        ..Self::SMALL
    };

    /// The preset names [`preset`](Self::preset) knows.
    pub const PRESETS: [&'static str; 9] = [
        "tiny",
        "small",
        "medium",
        "gpt2",
        "xl",
        "tiny-moe",
        "small-moe",
        "tiny-pr-moe",
        "small-pr-moe",
    ];

    /// A preset by name (one of [`PRESETS`](Self::PRESETS)).
    pub fn preset(name: &str) -> Option<GptShape> {
        match name {
            "tiny" => Some(Self::TINY),
            "small" => Some(Self::SMALL),
            "medium" => Some(Self::MEDIUM),
            "gpt2" => Some(Self::GPT2),
            "xl" => Some(Self::XL),
            "tiny-moe" => Some(Self::TINY_MOE),
            "small-moe" => Some(Self::SMALL_MOE),
            "tiny-pr-moe" => Some(Self::TINY_PR_MOE),
            "small-pr-moe" => Some(Self::SMALL_PR_MOE),
            _ => None,
        }
    }
}
