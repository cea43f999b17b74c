//! DeepSpeed's top-1 and top-2 gating on Burn tensors (`top1gating` / `top2gating` of
//! `deepspeed/moe/sharded_moe.py`; DeepSpeed-MoE, arXiv 2201.05596, after GShard, arXiv
//! 2006.16668): from the gate's logits `[tokens, experts]`, the load-balancing loss `l_aux`,
//! the combine weights `[tokens, experts, capacity]`, the dispatch mask and the routing.
//!
//! The decisions (argmax, capacity, drops, slots) are taken on the host by
//! [`super::routing`]; the combine weights and `l_aux` are tensor functions of the softmax of
//! the logits, so gradients reach the gate as in DeepSpeed.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};

use super::routing::{self, RouteOptions, Routing};

/// What a gate decided and the tensors a layer dispatches and combines with.
#[derive(Debug, Clone)]
pub struct Gating {
    /// The load-balancing loss `[1]`: experts × Σₑ mean gate probability × share of first
    /// choices (DeepSpeed's `l_aux`; for top-2 its `mean(me·ce)·E²`, the same value).
    pub l_aux: Tensor<1>,
    /// `[tokens, experts, capacity]`: the weight of each token's output in each slot.
    pub combine_weights: Tensor<3>,
    /// `[tokens, experts, capacity]`: where `combine_weights` is not zero.
    pub dispatch_mask: Tensor<3, Bool>,
    /// The decisions: slots, capacity, per-expert counts.
    pub routing: Routing,
}

/// A Gumbel sample from a uniform draw in (0, 1).
fn gumbel(u: f32) -> f32 {
    let u = u.clamp(f32::MIN_POSITIVE, 1.0 - f32::EPSILON);
    -(-u.ln()).ln()
}

/// The values of a tensor on the host.
fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("converted to f32")
}

/// DeepSpeed's `top1gating`: each token to its most probable expert (under DeepSpeed's
/// `RSample` noisy policy, `rsample`, the argmax of the logits plus Gumbel noise), at most
/// `capacity` tokens per expert (with random token selection, `use_rts`, those of the
/// largest uniform draw; otherwise the earliest). A kept token's combine weight is its gate
/// probability. `uniform` draws in (0, 1) (seed it for repeatable runs); it is not called
/// when both `rsample` and `use_rts` are off, which makes the result deterministic.
pub fn top1_gating(
    logits: Tensor<2>,
    options: &RouteOptions,
    rsample: bool,
    use_rts: bool,
    uniform: &mut dyn FnMut() -> f32,
) -> Gating {
    top1_choices(logits, options, rsample, use_rts, uniform).dense()
}

/// [`top1_gating`] as each choice's weights (the layer's sparse form).
pub(crate) fn top1_choices(
    logits: Tensor<2>,
    options: &RouteOptions,
    rsample: bool,
    use_rts: bool,
    uniform: &mut dyn FnMut() -> f32,
) -> Choices {
    let [tokens, experts] = logits.dims();
    let device = logits.device();
    let gates = softmax(logits.clone(), 1);
    let gates_host = host(gates.clone().detach());
    let choose = rsample.then(|| {
        host(logits.detach())
            .into_iter()
            .map(|v| v + gumbel(uniform()))
            .collect::<Vec<_>>()
    });
    let priority = use_rts.then(|| (0..tokens).map(|_| uniform()).collect::<Vec<_>>());
    let routing = routing::top1(
        &gates_host,
        experts,
        choose.as_deref(),
        priority.as_deref(),
        options,
    );
    let mask = choice_mask(&routing, 0, &device);
    let weight = (gates.clone() * mask).sum_dim(1);
    Choices {
        gates,
        weights: vec![weight],
        routing,
    }
}

/// DeepSpeed's `top2gating`: each token to its most probable expert and to a second one
/// (the argmax of the logits without the first, Gumbel-noised when `second_sampling`, DeepSpeed's
/// `top2_2nd_expert_sampling`), with twice the capacity factor; the two kept probabilities
/// are normalised to sum to one (over at least `f32::EPSILON`). Deterministic when
/// `second_sampling` is off (`uniform` is then not called).
pub fn top2_gating(
    logits: Tensor<2>,
    options: &RouteOptions,
    second_sampling: bool,
    uniform: &mut dyn FnMut() -> f32,
) -> Gating {
    top2_choices(logits, options, second_sampling, uniform).dense()
}

/// [`top2_gating`] as each choice's weights (the layer's sparse form).
pub(crate) fn top2_choices(
    logits: Tensor<2>,
    options: &RouteOptions,
    second_sampling: bool,
    uniform: &mut dyn FnMut() -> f32,
) -> Choices {
    let [_, experts] = logits.dims();
    let device = logits.device();
    let gates = softmax(logits.clone(), 1);
    let gates_host = host(gates.clone().detach());
    let mut second = host(logits.detach());
    if second_sampling {
        for v in &mut second {
            *v += gumbel(uniform());
        }
    }
    let routing = routing::top2(&gates_host, experts, &second, options);
    let g1 = (gates.clone() * choice_mask(&routing, 0, &device)).sum_dim(1);
    let g2 = (gates.clone() * choice_mask(&routing, 1, &device)).sum_dim(1);
    let denom = (g1.clone() + g2.clone()).clamp_min(f32::EPSILON);
    Choices {
        gates,
        weights: vec![g1 / denom.clone(), g2 / denom],
        routing,
    }
}

/// A gate's decision in the sparse form an MoE layer dispatches with: per choice, each
/// token's weight `[tokens, 1]` (zero where the choice was dropped) beside the routing.
pub(crate) struct Choices {
    /// The gate's probabilities `[tokens, experts]`.
    gates: Tensor<2>,
    /// Per choice, `[tokens, 1]`: the weight of the token's output from that expert.
    pub(crate) weights: Vec<Tensor<2>>,
    /// The decisions.
    pub(crate) routing: Routing,
}

impl Choices {
    /// DeepSpeed's load-balancing loss `[1]`.
    pub(crate) fn l_aux(&self) -> Tensor<1> {
        let experts = self.routing.experts;
        let share = Tensor::<2>::from_data(
            TensorData::new(
                self.routing.first_share.iter().map(|&v| v as f32).collect(),
                [1, experts],
            ),
            &self.gates.device(),
        );
        (self.gates.clone().mean_dim(0) * share)
            .sum()
            .mul_scalar(experts as f64)
    }

    /// The dense form DeepSpeed returns: the combine weights `[tokens, experts, capacity]`
    /// (each choice's weight at its expert and slot) and the dispatch mask.
    fn dense(self) -> Gating {
        let device = self.gates.device();
        let l_aux = self.l_aux();
        let combine_weights = (self.weights.iter().enumerate())
            .map(|(k, w)| {
                let mask = choice_mask(&self.routing, k, &device);
                let slots = choice_slots(&self.routing, k, &device);
                (w.clone() * mask).unsqueeze_dim::<3>(2) * slots.unsqueeze_dim(1)
            })
            .reduce(|a, b| a + b)
            .expect("a gate makes at least one choice");
        let dispatch_mask = combine_weights.clone().not_equal_elem(0.0);
        Gating {
            l_aux,
            combine_weights,
            dispatch_mask,
            routing: self.routing,
        }
    }
}

/// Choice `k`'s one-hot rows `[tokens, width]` (all zero for a dropped token), `at` giving
/// the hot column of a kept `(expert, slot)`.
fn one_hot_rows(
    routing: &Routing,
    k: usize,
    width: usize,
    at: impl Fn((usize, usize)) -> usize,
    device: &burn::tensor::Device,
) -> Tensor<2> {
    let slots = &routing.slots[k];
    let mut rows = vec![0.0f32; slots.len() * width];
    for (s, choice) in slots.iter().enumerate() {
        if let Some(c) = *choice {
            rows[s * width + at(c)] = 1.0;
        }
    }
    Tensor::from_data(TensorData::new(rows, [slots.len(), width]), device)
}

/// Choice `k`'s kept experts `[tokens, experts]`.
fn choice_mask(routing: &Routing, k: usize, device: &burn::tensor::Device) -> Tensor<2> {
    one_hot_rows(routing, k, routing.experts, |(e, _)| e, device)
}

/// Choice `k`'s slots `[tokens, capacity]`.
fn choice_slots(routing: &Routing, k: usize, device: &burn::tensor::Device) -> Tensor<2> {
    one_hot_rows(routing, k, routing.capacity, |(_, c)| c, device)
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::super::routing::tests::DROP;
    use super::*;

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32")
    }

    fn never() -> f32 {
        panic!("deterministic gating draws nothing")
    }

    fn softmax_rows(logits: &[f32], experts: usize) -> Vec<f64> {
        logits
            .chunks(experts)
            .flat_map(|row| {
                let m = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
                let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
                let z: f64 = e.iter().sum();
                e.into_iter().map(move |v| v / z)
            })
            .collect()
    }

    /// Top-1 over 5 tokens and 2 experts (capacity 3): the combine weight of each kept token
    /// is its gate probability at (expert, slot), the dropped token has none, the mask marks
    /// the nonzero weights, and `l_aux` is 2 · Σₑ mean(gates)ₑ · shareₑ, by hand in f64.
    #[test]
    fn top1_combine_weights_and_l_aux_by_hand() {
        let device = Device::flex();
        let logits = [2.0f32, 0.0, -1.0, 1.0, 1.5, 0.5, 0.5, 0.0, 0.25, 0.0];
        let t = Tensor::<2>::from_data(TensorData::new(logits.to_vec(), [5, 2]), &device);
        let g = top1_gating(t, &DROP, false, false, &mut never);
        let p = softmax_rows(&logits, 2);
        assert_eq!(g.combine_weights.dims(), [5, 2, 3]);
        let c = values(g.combine_weights.clone());
        // Tokens 0, 2, 3 to expert 0 (slots 0-2), token 1 to expert 1 (slot 0), token 4
        // (expert 0) dropped.
        let mut want = vec![0.0f64; 5 * 2 * 3];
        for (s, e, slot) in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 0, 2)] {
            want[(s * 2 + e) * 3 + slot] = p[s * 2 + e];
        }
        for (a, b) in c.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{c:?} vs {want:?}");
        }
        let mask = g
            .dispatch_mask
            .into_data()
            .try_to_vec::<bool>()
            .expect("bools");
        assert_eq!(mask, want.iter().map(|&w| w != 0.0).collect::<Vec<_>>());
        let mean = |e: usize| (0..5).map(|s| p[s * 2 + e]).sum::<f64>() / 5.0;
        let l_aux = 2.0 * (mean(0) * 0.8 + mean(1) * 0.2);
        let got = values(g.l_aux)[0] as f64;
        assert!((got - l_aux).abs() < 1e-6, "{got} vs {l_aux}");
        assert_eq!(g.routing.dropped(), 1);
    }

    /// Top-2 over 4 tokens and 3 experts: the two kept probabilities normalised to one in
    /// their slots; a token whose second choice is dropped keeps its first at weight
    /// p₁ / (p₁ + 0) = 1.
    #[test]
    fn top2_normalises_the_kept_pair() {
        let device = Device::flex();
        #[rustfmt::skip]
        let logits = [
            1.0f32, 0.3, -0.8,
            0.9, -1.0, 0.7,
            1.2, 0.0, -0.6,
            0.1, 1.1, -1.2,
        ];
        let t = Tensor::<2>::from_data(TensorData::new(logits.to_vec(), [4, 3]), &device);
        let g = top2_gating(t, &DROP, false, &mut never);
        let p = softmax_rows(&logits, 3);
        let cap = g.routing.capacity;
        assert_eq!(cap, 3);
        let c = values(g.combine_weights);
        let at = |s: usize, e: usize, slot: usize| c[(s * 3 + e) * cap + slot] as f64;
        let pair = |s: usize, a: usize, b: usize| (p[s * 3 + a], p[s * 3 + b]);
        let (a, b) = pair(0, 0, 1);
        assert!((at(0, 0, 0) - a / (a + b)).abs() < 1e-6);
        assert!((at(0, 1, 1) - b / (a + b)).abs() < 1e-6);
        let (a, b) = pair(1, 0, 2);
        assert!((at(1, 0, 1) - a / (a + b)).abs() < 1e-6);
        assert!((at(1, 2, 0) - b / (a + b)).abs() < 1e-6);
        // Token 3: first expert 1 (slot 0), second expert 0 past its capacity: weight 1.
        assert!((at(3, 1, 0) - 1.0).abs() < 1e-6);
        assert_eq!(c.iter().filter(|&&w| w != 0.0).count(), 7);
        // l_aux: 3 · Σₑ mean(gates)ₑ · shareₑ with first choices (0, 0, 0, 1).
        let mean = |e: usize| (0..4).map(|s| p[s * 3 + e]).sum::<f64>() / 4.0;
        let l_aux = 3.0 * (mean(0) * 0.75 + mean(1) * 0.25);
        let got = values(g.l_aux)[0] as f64;
        assert!((got - l_aux).abs() < 1e-6, "{got} vs {l_aux}");
    }

    /// The gate's gradient flows through the combine weights and `l_aux`.
    #[test]
    fn gradients_reach_the_logits() {
        let device = Device::flex().autodiff();
        let logits = Tensor::<2>::from_data(
            TensorData::new(vec![0.5f32, -0.5, 0.2, 0.1, -0.3, 0.9], [3, 2]),
            &device,
        )
        .require_grad();
        let g = top1_gating(logits.clone(), &DROP, false, false, &mut never);
        let loss = g.combine_weights.sum() + g.l_aux;
        let grads = loss.backward();
        let grad = values(logits.grad(&grads).expect("a gradient"));
        assert!(grad.iter().any(|v| v.abs() > 1e-4), "{grad:?}");
    }

    /// Random token selection and Gumbel noise draw from the closure: the same draws give
    /// the same routing.
    #[test]
    fn noisy_gating_repeats_with_the_same_draws() {
        let device = Device::flex();
        let logits = Tensor::<2>::random(
            [16, 4],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let run = |seed: u64| {
            let mut state = seed;
            let mut uniform = move || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 + 0.5) / (1u64 << 24) as f32
            };
            let one = top1_gating(logits.clone(), &DROP, true, true, &mut uniform).routing;
            let two = top2_gating(logits.clone(), &DROP, true, &mut uniform).routing;
            (one, two)
        };
        assert_eq!(run(7), run(7));
    }

    /// One case of `deepspeed_gating.json`: DeepSpeed 0.19's `top1gating` / `top2gating`
    /// (no noise, no random token selection, no second-expert sampling) on seeded logits,
    /// written by `scripts/moe-gating-vectors.py`.
    #[derive(serde::Deserialize)]
    struct DeepSpeedCase {
        k: usize,
        tokens: usize,
        experts: usize,
        capacity_factor: f64,
        min_capacity: usize,
        logits: Vec<f32>,
        /// Top-1 with random token selection: DeepSpeed's draws `[tokens, experts]`.
        rts_draws: Option<Vec<f32>>,
        l_aux: f64,
        capacity: usize,
        /// Nonzero combine weights: (token, expert, slot, weight).
        combine: Vec<(usize, usize, usize, f64)>,
        dispatch: usize,
        counts: Vec<usize>,
    }

    /// DeepSpeed's own gating on 7 shapes (drops, `min_capacity` binding, ragged token
    /// counts): top-2, top-1 with random token selection replaying DeepSpeed's draws, and
    /// top-1 without it where no expert overflows (there DeepSpeed keeps whichever tokens
    /// `torch.topk` returns among equal mask values, an order torch leaves unspecified; we
    /// keep the earliest, as its top-2 does). The same capacity, counts, dispatch mask and
    /// combine weights (positions exactly, values within 1e-6), and `l_aux` within 1e-6.
    #[test]
    fn gating_matches_deepspeeds_outputs() {
        #[derive(serde::Deserialize)]
        struct Vectors {
            cases: Vec<DeepSpeedCase>,
        }
        let vectors: Vectors =
            serde_json::from_str(include_str!("deepspeed_gating.json")).expect("the vectors parse");
        assert_eq!(vectors.cases.len(), 21);
        let device = Device::flex();
        for case in vectors.cases {
            let what = format!(
                "top-{} (rts {}) on {} tokens x {} experts, factor {}, min {}",
                case.k,
                case.rts_draws.is_some(),
                case.tokens,
                case.experts,
                case.capacity_factor,
                case.min_capacity
            );
            let logits = Tensor::<2>::from_data(
                TensorData::new(case.logits.clone(), [case.tokens, case.experts]),
                &device,
            );
            let options = RouteOptions {
                capacity_factor: case.capacity_factor,
                min_capacity: case.min_capacity,
                drop_tokens: true,
            };
            let g = match (case.k, &case.rts_draws) {
                (1, Some(draws)) => {
                    // Each token's draw at its expert, in token order.
                    let e = case.experts;
                    let mut priorities = case.logits.chunks(e).enumerate().map(|(s, row)| {
                        let best = (0..e).fold(0, |b, x| if row[x] > row[b] { x } else { b });
                        draws[s * e + best]
                    });
                    let mut replay = || priorities.next().expect("one draw per token");
                    top1_gating(logits, &options, false, true, &mut replay)
                }
                (1, None) => top1_gating(logits, &options, false, false, &mut never),
                _ => top2_gating(logits, &options, false, &mut never),
            };
            assert_eq!(g.routing.capacity, case.capacity, "{what}: capacity");
            assert_eq!(g.routing.counts, case.counts, "{what}: counts");
            let [s, e, c] = g.combine_weights.dims();
            assert_eq!(
                [s, e, c],
                [case.tokens, case.experts, case.capacity],
                "{what}"
            );
            let ours = values(g.combine_weights);
            let mask: Vec<bool> = g
                .dispatch_mask
                .into_data()
                .try_to_vec::<bool>()
                .expect("bool");
            assert_eq!(
                mask.iter().filter(|&&m| m).count(),
                case.dispatch,
                "{what}: mask"
            );
            let mut want = vec![0.0f64; s * e * c];
            for &(t, x, slot, w) in &case.combine {
                want[(t * e + x) * c + slot] = w;
            }
            for (i, (&got, &w)) in ours.iter().zip(&want).enumerate() {
                assert_eq!(got != 0.0, w != 0.0, "{what}: weight {i} placed alike");
                assert!(
                    (got as f64 - w).abs() <= 1e-6,
                    "{what}: weight {i}: {got} vs {w}"
                );
                assert_eq!(mask[i], w != 0.0, "{what}: mask {i}");
            }
            let l_aux = values(g.l_aux)[0] as f64;
            assert!(
                (l_aux - case.l_aux).abs() <= 1e-6,
                "{what}: l_aux {l_aux} vs {}",
                case.l_aux
            );
        }
    }
}
