//! [`MoE`]: DeepSpeed's Mixture-of-Experts layer (`deepspeed.moe.layer.MoE`, DeepSpeed-MoE,
//! arXiv 2201.05596), usable in any Burn model. A gate routes each token to its top-1 or
//! top-2 experts ([`super::gating`]); the tokens are dispatched into per-expert buffers of
//! `capacity` slots, exchanged over the expert-parallel group so that each rank runs its own
//! experts on every rank's tokens, exchanged back, and combined with the gate's weights.
//! With `use_residual` it is PR-MoE's residual layer: a dense MLP beside the experts, mixed by
//! a learned coefficient.

use super::config::{MoeConfig, NoisyGatePolicy};
use super::expert::{Expert, Residual};
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::activation::softmax;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::gating::{Choices, top1_choices, top2_choices};
use super::group::{ExpertLayer, ExpertParallel};
use super::routing::RouteOptions;
use crate::DeepSpeedError;
use crate::inference::splitmix_uniform;
use crate::tensor_parallel::TensorParallel;

/// What an [`MoE`] layer's forward returns (DeepSpeed's `(output, l_aux, exp_counts)`).
#[derive(Debug, Clone)]
pub struct MoeOutput {
    /// The layer's output, the input's shape.
    pub output: Tensor<3>,
    /// The load-balancing loss `[1]` (add it, times a coefficient, to the loss).
    pub l_aux: Tensor<1>,
    /// This rank's routing figures.
    pub stats: MoeStats,
}

/// One forward's routing on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStats {
    /// Tokens routed.
    pub tokens: usize,
    /// Tokens each expert was chosen by, before drops (every choice counted).
    pub counts: Vec<usize>,
    /// Tokens dropped by every choice (they leave the layer with no expert output).
    pub dropped: usize,
    /// Slots per expert.
    pub capacity: usize,
}

/// DeepSpeed's Mixture-of-Experts layer over experts `E`.
///
/// Whole (from [`MoeConfig::init`]) it holds every expert; cut by
/// [`expert_parallel`](Self::expert_parallel) it holds `num_experts / ep_size` of them and
/// exchanges tokens with the other ranks of its group by all-to-all (each rank's buffers are
/// `[num_experts · capacity, d]`, the same on every rank).
#[derive(Module, Debug)]
pub struct MoE<E: Expert> {
    /// `Linear(d, experts)`, no bias; computed in f32.
    pub gate: Linear,
    /// This rank's experts.
    pub experts: Vec<E>,
    /// PR-MoE's dense branch, with `use_residual`.
    pub residual: Option<Residual<E>>,
    #[module(skip)]
    pub(super) settings: MoeConfig,
    #[module(skip)]
    pub(super) ep: ExpertParallel,
    /// Expert slicing: the group of ranks that see the same tokens, each running its share
    /// of the experts ([`TensorParallel::none`] when the layer is not sliced).
    #[module(skip)]
    pub(super) slices: TensorParallel,
    /// The state of the layer's draws.
    #[module(skip)]
    pub(super) rng: Arc<Mutex<u64>>,
}

impl<E: Expert> MoE<E> {
    /// This rank's part of the whole layer over `ep`: experts
    /// `[rank · n / ep, (rank + 1) · n / ep)`, recorded in `ep` as expert parameters (the
    /// engine reduces their gradients over the ranks that hold them). The gate and the
    /// residual branch stay whole.
    pub fn expert_parallel(mut self, ep: &ExpertParallel) -> crate::Result<Self> {
        let size = ep.size();
        self.keep_share(size, ep.rank(), "moe.ep_size", "ep_size")?;
        if size > 1 {
            let ids = |e: &E| {
                let layout = crate::flat::ParamLayout::of(e);
                layout.slots.iter().map(|s| s.id).collect()
            };
            ep.record_layer(ExpertLayer {
                gate: self.gate.weight.id,
                experts: self.experts.iter().map(ids).collect(),
            });
        }
        self.ep = ep.clone();
        Ok(self)
    }

    /// This rank's share of the whole layer over `tp`, a group whose ranks all see the same
    /// tokens (a tensor-parallel group serving a model: DeepSpeed-MoE inference's expert
    /// slicing). Each rank keeps experts `[rank · n / tp, (rank + 1) · n / tp)` and runs them
    /// on their slots; their outputs are summed over the group (Megatron's `g`: an all-reduce
    /// forward, the identity backward), then the whole residual branch is mixed in. The gate
    /// and the residual stay whole. For serving: training a sliced layer would leave each
    /// rank with a partial gate gradient, which no gradient regime sums.
    pub fn expert_sliced(mut self, tp: &TensorParallel) -> crate::Result<Self> {
        self.keep_share(tp.size(), tp.rank(), "tensor_parallel.tp_size", "tp_size")?;
        self.slices = tp.clone();
        Ok(self)
    }

    /// Keeps share `rank` of `size` of the whole layer's experts, refused (by `key`) when
    /// the layer is already cut or `size` does not divide its experts.
    fn keep_share(&mut self, size: usize, rank: usize, key: &str, name: &str) -> crate::Result<()> {
        let n = self.settings.num_experts;
        let refuse = |reason: String| {
            Err(DeepSpeedError::Unsupported {
                key: key.into(),
                reason,
            })
        };
        if self.experts.len() != n {
            return refuse("the layer's experts are already cut over a group".into());
        }
        if !n.is_multiple_of(size) {
            return refuse(format!("{name} {size} must divide num_experts {n}"));
        }
        let local = n / size;
        let whole = std::mem::take(&mut self.experts);
        self.experts = whole.into_iter().skip(rank * local).take(local).collect();
        Ok(())
    }

    /// The layer with its draws (RTS, noise) started from `seed` (give each data-parallel
    /// rank and layer its own, as each DeepSpeed rank has its own generator).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.rng = Arc::new(Mutex::new(seed));
        self
    }

    /// Restarts the layer's draws (RTS, noise) from `seed`, in this layer and every clone of
    /// it (the engine's copy included): a training loop that reseeds from its step number
    /// draws the same tokens after resuming from a checkpoint as without the interruption.
    pub fn reseed(&self, seed: u64) {
        *self.rng.lock().unwrap_or_else(|e| e.into_inner()) = seed;
    }

    /// The layer's settings.
    pub fn config(&self) -> &MoeConfig {
        &self.settings
    }

    /// The layer on `x` `[batch, seq, d]`: every token routed by the gate, run by its
    /// experts, combined. Training (DeepSpeed's `self.training`) is the input being on an
    /// autodiff device: then the capacity factor is `capacity_factor` and the noise is on;
    /// otherwise `eval_capacity_factor` and no noise. A collective over the expert-parallel
    /// group: every rank of it calls the layer in the same order.
    pub fn forward(&self, x: Tensor<3>) -> MoeOutput {
        let [b, t, d] = x.dims();
        let s = b * t;
        let dtype = x.dtype();
        let tokens = x.reshape([s, d]);
        let training = tokens.is_autodiff();
        let choices = self.route(tokens.clone(), training);
        let (capacity, experts) = (choices.routing.capacity, self.settings.num_experts);
        let device = tokens.device();
        let index = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<1, Int>::from_data(TensorData::new(v, [n]), &device)
        };
        // Each expert's slots filled with its tokens (row `s`, zeros, in empty slots).
        let mut source = vec![s as i64; experts * capacity];
        for choice in &choices.routing.slots {
            for (token, slot) in choice.iter().enumerate() {
                if let Some((e, c)) = *slot {
                    source[e * capacity + c] = token as i64;
                }
            }
        }
        let zero_row = tokens.zeros_like().narrow(0, 0, 1);
        let padded = Tensor::cat(vec![tokens.clone(), zero_row.clone()], 0);
        let dispatched = padded.select(0, index(source));
        let outputs = self.run_experts(dispatched, capacity, d);
        // Each token's output: the sum over its choices of weight × its slot's output.
        let padded = Tensor::cat(vec![outputs, zero_row], 0);
        let mut output = tokens.zeros_like();
        for (choice, weight) in choices.routing.slots.iter().zip(&choices.weights) {
            let at = choice
                .iter()
                .map(|slot| slot.map_or(experts * capacity, |(e, c)| e * capacity + c) as i64)
                .collect();
            let weight = weight.clone().cast(dtype);
            output = output + padded.clone().select(0, index(at)) * weight;
        }
        // Expert slicing: each rank combined its own experts' outputs.
        if self.slices.size() > 1 {
            output = self.slices.reduce(output);
        }
        if let Some(residual) = &self.residual {
            let mixed = softmax(residual.coefficient.forward(tokens.clone()), 1);
            let dense = residual.mlp.forward(tokens);
            output = output * mixed.clone().narrow(1, 0, 1) + dense * mixed.narrow(1, 1, 1);
        }
        let stats = MoeStats {
            tokens: s,
            dropped: choices.routing.dropped(),
            capacity,
            counts: choices.routing.counts.clone(),
        };
        MoeOutput {
            output: output.reshape([b, t, d]),
            l_aux: choices.l_aux(),
            stats,
        }
    }

    /// The gate's decision for `tokens` `[s, d]`, its capacity the largest over the
    /// expert-parallel group (every rank's buffers have one shape).
    fn route(&self, tokens: Tensor<2>, training: bool) -> Choices {
        let cfg = &self.settings;
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        let mut uniform = || splitmix_uniform(&mut rng) as f32;
        let mut input = tokens.cast(FloatDType::F32);
        let noise = cfg.noisy_gate_policy.filter(|_| training);
        if noise == Some(NoisyGatePolicy::Jitter) {
            let [s, d] = input.dims();
            let jitter: Vec<f32> = (0..s * d).map(|_| 1.0 - 1e-2 + 2e-2 * uniform()).collect();
            let noise = Tensor::from_data(TensorData::new(jitter, [s, d]), &input.device());
            input = input * noise;
        }
        let weight = self.gate.weight.val().cast(FloatDType::F32);
        let logits = input.matmul(weight);
        let options = RouteOptions {
            capacity_factor: match training {
                true => cfg.capacity_factor,
                false => cfg.eval_capacity_factor,
            },
            min_capacity: cfg.min_capacity,
            drop_tokens: cfg.drop_tokens,
        };
        let mut choices = match cfg.k {
            1 => top1_choices(
                logits,
                &options,
                noise == Some(NoisyGatePolicy::RSample),
                cfg.use_rts && training,
                &mut uniform,
            ),
            _ => top2_choices(
                logits,
                &options,
                cfg.top2_2nd_expert_sampling && training,
                &mut uniform,
            ),
        };
        if self.ep.size() > 1 {
            let device = self.gate.weight.device();
            let local = choices.routing.capacity as f32;
            let mine = Tensor::<1>::from_data(TensorData::new(vec![local], [1]), &device);
            let most = self.ep.max(mine).into_scalar::<f32>() as usize;
            choices.routing.capacity = most.max(choices.routing.capacity);
        }
        choices
    }

    /// The experts on the dispatched buffers `[experts · capacity, d]` (expert-major): the
    /// buffers exchanged so that this rank holds its experts' slots from every rank of the
    /// group, each expert run on its `ep · capacity` rows, and the results exchanged back.
    fn run_experts(&self, dispatched: Tensor<2>, capacity: usize, d: usize) -> Tensor<2> {
        if self.slices.size() > 1 {
            return self.run_sliced_experts(dispatched, capacity);
        }
        let (ep, local) = (self.ep.size(), self.experts.len());
        let mine = self
            .ep
            .all_to_all(dispatched)
            .reshape([ep, local, capacity, d])
            .swap_dims(0, 1);
        let outs = (self.experts.iter().enumerate())
            .map(|(j, expert)| {
                let rows = mine.clone().narrow(0, j, 1).reshape([ep * capacity, d]);
                expert.forward(rows).reshape([1, ep, capacity, d])
            })
            .collect();
        let back = Tensor::cat(outs, 0)
            .swap_dims(0, 1)
            .reshape([ep * local * capacity, d]);
        self.ep.all_to_all(back)
    }
}

impl<E: Expert> MoE<E> {
    /// Expert slicing: this rank's experts on their slots of the dispatched buffers
    /// `[experts · capacity, d]` (the same on every rank of the group), zeros in the other
    /// experts' slots.
    fn run_sliced_experts(&self, dispatched: Tensor<2>, capacity: usize) -> Tensor<2> {
        let (n, local, rank) = (
            self.settings.num_experts,
            self.experts.len(),
            self.slices.rank(),
        );
        let [_, d] = dispatched.dims();
        let zeros = |experts: usize| {
            (experts > 0).then(|| {
                Tensor::<2>::zeros([experts * capacity, d], &dispatched.device())
                    .cast(dispatched.dtype())
            })
        };
        let before = zeros(rank * local);
        let after = zeros(n - (rank + 1) * local);
        let mine = self.experts.iter().enumerate().map(|(j, expert)| {
            let rows = dispatched
                .clone()
                .narrow(0, (rank * local + j) * capacity, capacity);
            expert.forward(rows)
        });
        let parts: Vec<Tensor<2>> = before.into_iter().chain(mine).chain(after).collect();
        Tensor::cat(parts, 0)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::module::Param;

    use super::*;
    use crate::flat::ParamLayout;
    use crate::launch::launch;
    use crate::moe::ExpertMlp;
    use burn::tensor::Device;

    const D: usize = 4;
    const EXPERTS: usize = 4;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|j| (((j * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
            .collect()
    }

    fn read<const N: usize>(t: Tensor<N>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().expect("f32")
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: {x} vs {y}"
            );
        }
    }

    /// A deterministic layer (no RTS, no noise) whose parameters follow `values`.
    fn layer(k: usize, residual: bool, device: &Device) -> MoE<ExpertMlp> {
        let config = MoeConfig::new(D, EXPERTS)
            .with_k(k)
            .with_use_rts(false)
            .with_top2_2nd_expert_sampling(false)
            .with_min_capacity(1)
            .with_capacity_factor(0.5)
            .with_eval_capacity_factor(0.5)
            .with_use_residual(residual);
        let experts = (0..EXPERTS)
            .map(|_| ExpertMlp::new(D, 2 * D, device))
            .collect();
        let extra = residual.then(|| ExpertMlp::new(D, 2 * D, device));
        let moe = config.init(experts, extra, device).expect("a valid layer");
        let mut seed = 0;
        moe.map(&mut Fill(&mut seed))
    }

    struct Fill<'a>(&'a mut usize);
    impl burn::module::ModuleMapper for Fill<'_> {
        fn map_float<const N: usize>(&mut self, param: Param<Tensor<N>>) -> Param<Tensor<N>> {
            let (id, t, mapper) = param.consume();
            *self.0 += 1;
            let shape = t.shape();
            let v = values(shape.num_elements(), *self.0);
            let fresh = Tensor::from_data(TensorData::new(v, shape), &t.device());
            let t = match t.is_require_grad() {
                true => fresh.require_grad(),
                false => fresh,
            };
            Param::from_mapped_value(id, t, mapper)
        }
    }

    /// The layer's output by hand, token by token: each kept choice's expert run on the token
    /// alone, times the gate's weight for it.
    fn by_hand(moe: &MoE<ExpertMlp>, x: &[f32], tokens: usize, device: &Device) -> Vec<f32> {
        let x = Tensor::<2>::from_data(TensorData::new(x.to_vec(), [tokens, D]), device);
        let logits = x.clone().matmul(moe.gate.weight.val());
        let gates = read(softmax(logits, 1));
        let routing = match moe.settings.k {
            1 => super::super::routing::top1(&gates, EXPERTS, None, None, &route(moe)),
            _ => super::super::routing::top2(&gates, EXPERTS, &logit_rows(moe, &x), &route(moe)),
        };
        let mut out = vec![0.0f32; tokens * D];
        for s in 0..tokens {
            let g = |e: usize| gates[s * EXPERTS + e];
            let kept: Vec<usize> = routing
                .slots
                .iter()
                .filter_map(|c| c[s].map(|(e, _)| e))
                .collect();
            let chosen: f32 = routing
                .slots
                .iter()
                .map(|c| c[s].map_or(0.0, |(e, _)| g(e)))
                .sum();
            let denom = match moe.settings.k {
                1 => 1.0,
                _ => chosen.max(f32::EPSILON),
            };
            let row = x.clone().narrow(0, s, 1);
            let mut y = vec![0.0f32; D];
            for e in kept {
                let e_out = read(moe.experts[e].forward(row.clone()));
                for (acc, v) in y.iter_mut().zip(e_out) {
                    *acc += g(e) / denom * v;
                }
            }
            if let Some(r) = &moe.residual {
                let mix = read(softmax(r.coefficient.forward(row.clone()), 1));
                let dense = read(r.mlp.forward(row));
                for (acc, v) in y.iter_mut().zip(dense) {
                    *acc = *acc * mix[0] + v * mix[1];
                }
            }
            out[s * D..(s + 1) * D].copy_from_slice(&y);
        }
        out
    }

    fn route(moe: &MoE<ExpertMlp>) -> RouteOptions {
        RouteOptions {
            capacity_factor: moe.settings.capacity_factor,
            min_capacity: moe.settings.min_capacity,
            drop_tokens: moe.settings.drop_tokens,
        }
    }

    fn logit_rows(moe: &MoE<ExpertMlp>, x: &Tensor<2>) -> Vec<f32> {
        read(x.clone().matmul(moe.gate.weight.val()))
    }

    /// Top-1 and top-2, with and without the residual branch, over 10 tokens (capacity 2
    /// for top-1, so some tokens drop): the layer equals the token-by-token sum.
    #[test]
    fn a_whole_layer_is_the_gate_weighted_sum_of_its_experts() {
        let device = Device::flex();
        for (k, residual) in [(1, false), (2, false), (1, true)] {
            let moe = layer(k, residual, &device);
            let x = values(10 * D, 5);
            let input = Tensor::<2>::from_data(TensorData::new(x.clone(), [10, D]), &device);
            let out = moe.forward(input.reshape([2, 5, D]));
            assert_eq!(out.stats.tokens, 10);
            if k == 1 {
                assert!(out.stats.dropped > 0, "capacity 2 drops some of 10 tokens");
            }
            let what = format!("k {k}, residual {residual}");
            close(&read(out.output), &by_hand(&moe, &x, 10, &device), &what);
        }
    }

    /// Expert slicing for serving: at tp 2 and 4 (ranks that all see the same tokens), each
    /// rank's output, summed over the group, equals the whole layer's, top-1 with the
    /// residual branch and top-2; each rank holds `4 / tp` experts.
    #[test]
    fn sliced_experts_serve_the_whole_layers_output() {
        let device = Device::flex();
        let x = values(10 * D, 9);
        let input =
            |device: &Device| Tensor::<3>::from_data(TensorData::new(x.clone(), [2, 5, D]), device);
        for (k, residual) in [(1, true), (2, false)] {
            let want = read(layer(k, residual, &device).forward(input(&device)).output);
            for tp in [2, 4] {
                let (_, ranks) = launch(tp, Duration::from_secs(60), |comm| {
                    let group = TensorParallel::new(
                        burn_deepspeed_strategies::device::device_collectives(comm, &device)?,
                    );
                    let moe = layer(k, residual, &device).expert_sliced(&group)?;
                    assert_eq!(moe.experts.len(), EXPERTS / tp);
                    let out = moe.forward(input(&device));
                    assert!(group.take_error().is_none(), "the reductions ran");
                    Ok(read(out.output))
                })
                .expect("every rank runs");
                for (rank, got) in ranks.iter().enumerate() {
                    close(got, &want, &format!("k {k}, tp {tp}, rank {rank}"));
                }
            }
        }
        let group = TensorParallel::none();
        let cut = layer(1, false, &device)
            .expert_sliced(&group)
            .expect("tp 1");
        assert_eq!(cut.experts.len(), EXPERTS, "tp 1 keeps every expert");
    }

    /// Four ranks with their own tokens, at ep 2 and ep 4: every rank's output and input
    /// gradient equal the whole layer's on its tokens; the gate's gradient is its own; an
    /// expert's gradient on the rank that holds it is the sum of the whole layer's over the
    /// ranks of its expert-parallel group (the tokens it served).
    #[test]
    fn expert_parallel_layers_match_the_whole_layer() {
        let device = Device::flex().autodiff();
        let tokens = 6;
        let run_whole = |rank: usize| {
            let moe = layer(2, false, &device);
            let x = Tensor::<3>::from_data(
                TensorData::new(values(tokens * D, 20 + rank), [1, tokens, D]),
                &device,
            )
            .require_grad();
            let out = moe.forward(x.clone());
            let loss = (out.output.clone() * out.output.clone()).sum() + out.l_aux;
            let grads = loss.backward();
            let gx = read(x.grad(&grads).expect("x's gradient"));
            let gate = read(moe.gate.weight.grad(&grads).expect("the gate's gradient"));
            let gp = burn::optim::GradientsParams::from_grads(grads, &moe);
            let experts: Vec<Vec<f32>> = moe.experts.iter().map(|e| grad_flat(e, &gp)).collect();
            (read(out.output), gx, gate, experts)
        };
        let whole: Vec<_> = (0..4).map(run_whole).collect();
        for ep_size in [2, 4] {
            let (_, ranks) = launch(4, Duration::from_secs(60), |comm| {
                let ep = ExpertParallel::new(&comm, ep_size, &Device::flex())?;
                let moe = layer(2, false, &device).expert_parallel(&ep)?;
                assert_eq!(
                    ep.recorded(),
                    4 * (EXPERTS / ep_size),
                    "each expert's 4 tensors"
                );
                let x = Tensor::<3>::from_data(
                    TensorData::new(values(tokens * D, 20 + comm.rank()), [1, tokens, D]),
                    &device,
                )
                .require_grad();
                let out = moe.forward(x.clone());
                let loss = (out.output.clone() * out.output.clone()).sum() + out.l_aux;
                let grads = loss.backward();
                assert!(ep.take_error().is_none(), "the exchanges ran");
                let gx = read(x.grad(&grads).expect("x's gradient"));
                let gate = read(moe.gate.weight.grad(&grads).expect("the gate's gradient"));
                let gp = burn::optim::GradientsParams::from_grads(grads, &moe);
                let experts: Vec<Vec<f32>> =
                    moe.experts.iter().map(|e| grad_flat(e, &gp)).collect();
                Ok((read(out.output), gx, gate, experts))
            })
            .expect("every rank runs");
            for (rank, (y, gx, gate, experts)) in ranks.into_iter().enumerate() {
                let what = format!("ep {ep_size}, rank {rank}");
                close(&y, &whole[rank].0, &format!("{what}: output"));
                close(&gx, &whole[rank].1, &format!("{what}: input gradient"));
                close(&gate, &whole[rank].2, &format!("{what}: gate gradient"));
                let local = EXPERTS / ep_size;
                let group = rank / ep_size * ep_size..(rank / ep_size + 1) * ep_size;
                for (j, got) in experts.iter().enumerate() {
                    let e = (rank % ep_size) * local + j;
                    let mut want = vec![0.0f32; got.len()];
                    for peer in group.clone() {
                        for (w, v) in want.iter_mut().zip(&whole[peer].3[e]) {
                            *w += v;
                        }
                    }
                    close(got, &want, &format!("{what}: expert {e}'s gradient"));
                }
            }
        }
    }

    /// An expert's gradient, flat in its layout (zeros where it has none).
    fn grad_flat(expert: &ExpertMlp, grads: &burn::optim::GradientsParams) -> Vec<f32> {
        let layout = ParamLayout::of(expert);
        let mut out = vec![0.0f32; layout.numel];
        let mut device = None;
        crate::flat::for_each_grad(expert, &layout, grads, &mut device, |i, g| {
            let slot = &layout.slots[i];
            if let Some(g) = g {
                out[slot.offset..slot.offset + slot.numel].copy_from_slice(&g);
            }
        });
        out
    }
}
