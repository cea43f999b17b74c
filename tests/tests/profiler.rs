//! The flops profiler on the GPT example: MACs equal to the closed form, parameters equal to
//! `Module::num_params`, flops within 1% of DeepSpeed's count for the same architecture, a
//! JSON form whose children never exceed their parent, and a printed layout checked line by
//! line.

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_deepspeed::profiler::{
    ModelProfile, ModuleProfile, ProfileOptions, get_model_profile, scope,
};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape, VOCAB};

const BATCH: usize = 8;

fn profile(shape: GptShape, options: &ProfileOptions) -> (Gpt, ModelProfile) {
    let model = Gpt::new(shape, 1, &Device::flex());
    let forward = |m: &Gpt, device: &Device| {
        m.forward(Tensor::<2, Int>::zeros([BATCH, shape.seq_len], device))
    };
    let profile = get_model_profile(&model, forward, options).expect("the GPT profiles");
    (model, profile)
}

#[test]
fn gpt_counts_match_deepspeeds_formulas() {
    for (name, shape) in [("tiny", GptShape::TINY), ("small", GptShape::SMALL)] {
        let (model, p) = profile(shape, &ProfileOptions::default());
        let (b, t, d, l, v) = (
            BATCH as u64,
            shape.seq_len as u64,
            shape.d_model as u64,
            shape.layers as u64,
            VOCAB as u64,
        );
        let h = shape.heads as u64;
        // Matmul MACs: per block the q, k, v and output projections (4·d²) and the MLP
        // (8·d²) per token, and the two attention products (2·T·d per token); the head.
        let macs = l * (12 * b * t * d * d + 2 * b * t * t * d) + b * t * d * v;
        assert_eq!(p.macs(), macs, "{name}: MACs");
        assert_eq!(p.params(), model.num_params() as u64, "{name}: parameters");
        // DeepSpeed's flops on the same architecture: 2·MACs, 5 per element of each of the
        // 2L + 1 layer norms, one per softmax score and per GELU input; the `+` and `*`
        // operators (residuals, scaling, mask) are not counted there.
        let deepspeed =
            2 * macs + 5 * b * t * d * (2 * l + 1) + l * (b * h * t * t) + l * (4 * b * t * d);
        let rel = (p.flops() as f64 - deepspeed as f64).abs() / deepspeed as f64;
        println!(
            "{name}: params {}, fwd MACs {}, fwd flops {} (DeepSpeed's count {deepspeed}, \
             {:.3}% apart), {} ops captured, fwd latency {:.1} ms",
            p.params(),
            p.macs(),
            p.flops(),
            100.0 * rel,
            p.ops_captured,
            p.fwd_latency.as_secs_f64() * 1e3
        );
        assert!(rel < 0.01, "{name}: flops {} vs {deepspeed}", p.flops());
        assert_eq!(p.bwd_flops(), 2 * p.flops());
    }
}

#[test]
fn the_tree_sums_up_and_the_json_parses() {
    let (_, p) = profile(GptShape::TINY, &ProfileOptions::default());
    fn check(m: &ModuleProfile) {
        let (params, macs, flops) = m.children.iter().fold((0, 0, 0), |s, c| {
            (s.0 + c.params, s.1 + c.macs, s.2 + c.flops)
        });
        assert!(
            params <= m.params && macs <= m.macs && flops <= m.flops,
            "{}",
            m.path
        );
        m.children.iter().for_each(check);
    }
    check(&p.root);
    // Every parameter sits in a leaf module: the blocks' linears hold the MACs.
    // The parameter-reading products land in the module that owns the weight.
    let qkv = p
        .root
        .find("blocks.0.qkv")
        .expect("the first block's q, k, v projection");
    let (b, t, d) = (BATCH as u64, 128u64, 128u64);
    assert_eq!(
        (qkv.kind.as_str(), qkv.macs),
        ("ColumnParallelLinear", b * t * d * 3 * d)
    );
    // Every layer's forward runs in a profiler scope: each is timed, within its parent's.
    assert!(p.unmatched_scopes.is_empty(), "{:?}", p.unmatched_scopes);
    let latency = |m: &ModuleProfile| m.latency.unwrap_or_else(|| panic!("{} timed", m.path));
    let scoped = |m: &ModuleProfile| -> std::time::Duration {
        m.children.iter().filter_map(|c| c.latency).sum()
    };
    let block = p.root.find("blocks.0").expect("the first block");
    assert_eq!(block.children.len(), 6, "a dense block's six layers");
    block.children.iter().for_each(|c| {
        latency(c);
    });
    assert!(scoped(block) <= latency(block));
    let blocks = p.root.find("blocks").expect("the blocks");
    assert!(blocks.latency.is_none(), "the Vec itself is not scoped");
    let top: std::time::Duration = ["embed", "head"]
        .iter()
        .map(|n| latency(p.root.find(n).expect("a layer")))
        .chain(blocks.children.iter().map(latency))
        .sum();
    assert!(top <= p.fwd_latency);
    // The printed layout: the summary, the aggregated profile per depth, the tree.
    let report = p.report();
    println!("{report}");
    let lines: Vec<&str> = report.lines().collect();
    assert!(lines[0].contains(" burn-deepspeed flops profiler "));
    assert_eq!(lines[1], "forward profile of `Gpt`");
    assert!(lines[2].starts_with("params:") && lines[2].ends_with(" 875.26 K"));
    assert!(lines[3].starts_with("fwd MACs:") && lines[3].ends_with(" 973.08 MMACs"));
    assert!(lines[4].starts_with("fwd flops:") && lines[4].ends_with(" 1.96 GFLOPs"));
    assert!(
        report.contains("\ndepth 0:\n    params      - Gpt: 875.26 K\n    MACs        - Gpt: 973.08 MMACs\n    fwd latency - Gpt: ")
    );
    assert!(report.contains("\ndepth 3:\n    params      - ColumnParallelLinear: "));
    assert!(report.contains("\nGpt(875.26 K = 100.00% params, 973.08 MMACs = 100.00% MACs, "));
    assert!(report.contains(
        "\n      (qkv): ColumnParallelLinear(49.54 K = 5.66% params, 50.33 MMACs = 5.17% MACs, "
    ));
    // module_depth 1 stops the tree at the root's children.
    let shallow = ModelProfile {
        options: ProfileOptions {
            module_depth: 1,
            ..p.options.clone()
        },
        ..p.clone()
    };
    let text = shallow.report();
    assert!(
        text.contains("\n  (blocks): Vec(")
            && !text.contains("(qkv)")
            && !text.contains("depth 2:")
    );
    let json: serde_json::Value = serde_json::from_str(&p.to_json()).expect("valid JSON");
    assert_eq!(json["root"]["flops"].as_u64(), Some(p.flops()));
    assert_eq!(
        json["root"]["children"].as_array().map(Vec::len),
        Some(p.root.children.len())
    );
}

/// LeNet-5 as plain Burn modules (`Conv2d`, `AvgPool2d`, `Linear`), which the profiler knows
/// nothing about: DeepSpeed's own reference (`test_flops_profiler.py`, batch 1024 of 1×32×32)
/// is 426,516,480 MACs, 866,076,672 flops and 61,706 parameters.
#[test]
fn a_plain_burn_lenet_matches_deepspeeds_reference() {
    use burn::nn::conv::{Conv2d, Conv2dConfig};
    use burn::nn::pool::{AvgPool2d, AvgPool2dConfig};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::activation::{softmax, tanh};

    #[derive(Module, Debug)]
    struct LeNet {
        conv1: Conv2d,
        conv2: Conv2d,
        conv3: Conv2d,
        pool: AvgPool2d,
        fc1: Linear,
        fc2: Linear,
    }

    impl LeNet {
        fn forward(&self, x: Tensor<4>) -> Tensor<2> {
            let device = x.device();
            // One scope names its field, one is misspelt (the profile lists it).
            let x = scope("conv1", &device, || self.conv1.forward(x));
            let x = scope("pool_1", &device, || self.pool.forward(tanh(x)));
            let x = self.pool.forward(tanh(self.conv2.forward(x)));
            let x = tanh(self.conv3.forward(x));
            let [b, c, h, w] = x.dims();
            let x = tanh(self.fc1.forward(x.reshape([b, c * h * w])));
            softmax(self.fc2.forward(x), 1)
        }
    }

    let device = Device::flex();
    let pool = AvgPool2dConfig::new([2, 2]).with_strides([2, 2]).init();
    let model = LeNet {
        conv1: Conv2dConfig::new([1, 6], [5, 5]).init(&device),
        conv2: Conv2dConfig::new([6, 16], [5, 5]).init(&device),
        conv3: Conv2dConfig::new([16, 120], [5, 5]).init(&device),
        pool,
        fc1: LinearConfig::new(120, 84).init(&device),
        fc2: LinearConfig::new(84, 10).init(&device),
    };
    let forward = |m: &LeNet, d: &Device| m.forward(Tensor::zeros([1024, 1, 32, 32], d));
    let options = ProfileOptions {
        warm_up: 0,
        ..ProfileOptions::default()
    };
    let p = get_model_profile(&model, forward, &options).expect("LeNet profiles");
    println!("{}", p.report());
    assert_eq!(p.params(), 61_706);
    assert_eq!(p.params(), model.num_params() as u64);
    assert_eq!(p.macs(), 426_516_480);
    assert_eq!(p.flops(), 866_076_672);
    let conv1 = p.root.find("conv1").expect("conv1");
    assert_eq!(
        (conv1.kind.as_str(), conv1.macs),
        ("Conv2d", 1024 * 6 * 28 * 28 * 25)
    );
    assert!(conv1.latency.is_some() && p.root.find("conv2").unwrap().latency.is_none());
    assert_eq!(p.unmatched_scopes, ["pool_1"]);
    assert!(
        p.report()
            .contains("\nscopes naming no module (not reported): pool_1\n")
    );
}
