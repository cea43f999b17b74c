//! Where a Mixture-of-Experts gate sends each token, as plain data: DeepSpeed's top-1 and
//! top-2 gating decisions (`deepspeed/moe/sharded_moe.py`, after GShard, arXiv 2006.16668)
//! taken from the gate's probabilities on the host, with no tensors. [`super::gating`] turns a
//! [`Routing`] into the differentiable combine weights.

/// DeepSpeed's expert capacity: `⌈tokens / experts · factor⌉`, at least `min_capacity`. The
/// product is taken in f32, as DeepSpeed's `_capacity` takes it (the factor is a float32
/// tensor there), so that a product just above an integer in f32 rounds up as it does
/// (50 tokens, 2 experts, top-2's doubled factor 0.6: 16 slots, not 15).
pub fn capacity(tokens: usize, experts: usize, factor: f64, min_capacity: usize) -> usize {
    let share = (tokens as f64 / experts as f64) as f32;
    let c = (share * factor as f32).ceil() as usize;
    c.max(min_capacity)
}

/// The options of a gating decision (DeepSpeed's `top1gating` / `top2gating` arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteOptions {
    /// Slots per expert, as a multiple of an even share of the tokens (doubled for top-2).
    pub capacity_factor: f64,
    /// The fewest slots an expert gets.
    pub min_capacity: usize,
    /// Drop the tokens past an expert's capacity; when false, the capacity grows to the
    /// busiest expert's count.
    pub drop_tokens: bool,
}

/// The decision for one batch of tokens: for each choice (first expert, then second for
/// top-2) and token, the expert and its slot in that expert's buffer, or `None` when the
/// token was dropped there.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Slots per expert.
    pub capacity: usize,
    /// Experts.
    pub experts: usize,
    /// `[choice][token]`: `(expert, slot)`, or `None` when dropped.
    pub slots: Vec<Vec<Option<(usize, usize)>>>,
    /// Tokens each expert was chosen by, before drops (DeepSpeed's `exp_counts`, every
    /// choice counted).
    pub counts: Vec<usize>,
    /// For the load-balancing loss: the share of tokens whose first choice is each expert,
    /// before drops (DeepSpeed's `ce`).
    pub first_share: Vec<f64>,
}

impl Routing {
    /// Tokens dropped by every choice they made (they pass the layer with no expert output).
    pub fn dropped(&self) -> usize {
        let tokens = self.slots.first().map_or(0, Vec::len);
        (0..tokens)
            .filter(|&s| self.slots.iter().all(|c| c[s].is_none()))
            .count()
    }
}

/// The index of the largest value of `row` (the first of equal ones, as `argmax`), skipping
/// `except`.
fn argmax(row: &[f32], except: Option<usize>) -> usize {
    let mut best = None;
    for (e, &v) in row.iter().enumerate() {
        if Some(e) == except {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((e, v)),
        }
    }
    best.map_or(0, |(e, _)| e)
}

/// Top-1 routing of `tokens` rows of `experts` gate probabilities `gates` (row-major):
/// each token's first expert (the argmax of `choose` when given, DeepSpeed's noisy
/// `RSample` logits, else of `gates`), and at most `capacity` tokens per expert kept. The kept
/// ones are those with the largest `priority` (random token selection, DeepSpeed's `use_rts`:
/// one uniform draw per token) or, without it, the earliest; then slots in token order.
pub fn top1(
    gates: &[f32],
    experts: usize,
    choose: Option<&[f32]>,
    priority: Option<&[f32]>,
    options: &RouteOptions,
) -> Routing {
    let tokens = gates.len() / experts.max(1);
    let pick = choose.unwrap_or(gates);
    let first: Vec<usize> = (0..tokens)
        .map(|s| argmax(&pick[s * experts..(s + 1) * experts], None))
        .collect();
    let mut counts = vec![0usize; experts];
    for &e in &first {
        counts[e] += 1;
    }
    let capacity = if options.drop_tokens {
        capacity(
            tokens,
            experts,
            options.capacity_factor,
            options.min_capacity,
        )
    } else {
        counts.iter().copied().max().unwrap_or(0).min(tokens)
    };
    // Per expert, the tokens it keeps: the `capacity` of highest priority (ties, and every
    // token without priorities, by position).
    let mut kept = vec![false; tokens];
    for e in 0..experts {
        let mut mine: Vec<usize> = (0..tokens).filter(|&s| first[s] == e).collect();
        if let Some(p) = priority {
            mine.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        }
        for &s in mine.iter().take(capacity) {
            kept[s] = true;
        }
    }
    let mut next = vec![0usize; experts];
    let slots = (0..tokens)
        .map(|s| {
            kept[s].then(|| {
                let e = first[s];
                next[e] += 1;
                (e, next[e] - 1)
            })
        })
        .collect();
    Routing {
        capacity,
        experts,
        slots: vec![slots],
        first_share: share(&first, experts),
        counts,
    }
}

/// Top-2 routing: each token's first expert (the argmax of `gates`) and second (the argmax
/// of `second_logits` without the first: the logits, Gumbel-noised when DeepSpeed's
/// `top2_2nd_expert_sampling` is on). Slots go in token order, every first choice before
/// every second; with `drop_tokens` a choice past `capacity` (the factor doubled) is dropped.
pub fn top2(
    gates: &[f32],
    experts: usize,
    second_logits: &[f32],
    options: &RouteOptions,
) -> Routing {
    let tokens = gates.len() / experts.max(1);
    let row = |v: &'_ [f32], s: usize| -> Vec<f32> { v[s * experts..(s + 1) * experts].to_vec() };
    let first: Vec<usize> = (0..tokens).map(|s| argmax(&row(gates, s), None)).collect();
    let second: Vec<usize> = (0..tokens)
        .map(|s| argmax(&row(second_logits, s), Some(first[s])))
        .collect();
    let mut counts = vec![0usize; experts];
    for &e in first.iter().chain(&second) {
        counts[e] += 1;
    }
    let capacity = if options.drop_tokens {
        capacity(
            tokens,
            experts,
            2.0 * options.capacity_factor,
            options.min_capacity,
        )
    } else {
        counts.iter().copied().max().unwrap_or(0)
    };
    let mut next = vec![0usize; experts];
    let mut place = |choice: &[usize]| -> Vec<Option<(usize, usize)>> {
        choice
            .iter()
            .map(|&e| {
                let slot = next[e];
                next[e] += 1;
                (slot < capacity).then_some((e, slot))
            })
            .collect()
    };
    let firsts = place(&first);
    let seconds = place(&second);
    Routing {
        capacity,
        experts,
        slots: vec![firsts, seconds],
        first_share: share(&first, experts),
        counts,
    }
}

/// The share of `choice` that names each expert.
fn share(choice: &[usize], experts: usize) -> Vec<f64> {
    let mut out = vec![0.0; experts];
    for &e in choice {
        out[e] += 1.0;
    }
    let n = choice.len().max(1) as f64;
    out.iter().map(|c| c / n).collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Capacity factor 1, no minimum, drops on.
    pub(in crate::moe) const DROP: RouteOptions = RouteOptions {
        capacity_factor: 1.0,
        min_capacity: 0,
        drop_tokens: true,
    };

    #[test]
    fn capacity_is_an_even_share_times_the_factor_at_least_the_minimum() {
        assert_eq!(capacity(8, 4, 1.0, 0), 2);
        assert_eq!(capacity(9, 4, 1.0, 0), 3);
        assert_eq!(capacity(8, 4, 1.5, 0), 3);
        assert_eq!(capacity(8, 4, 1.0, 4), 4);
    }

    /// Five tokens over two experts: four choose expert 0, whose capacity (⌈5/2⌉ = 3) keeps
    /// the first three in token order; the fourth is dropped.
    #[test]
    fn top1_keeps_the_earliest_tokens_up_to_the_capacity() {
        #[rustfmt::skip]
        let gates = [
            0.9, 0.1,
            0.2, 0.8,
            0.7, 0.3,
            0.6, 0.4,
            0.55, 0.45,
        ];
        let r = top1(&gates, 2, None, None, &DROP);
        assert_eq!(r.capacity, 3);
        assert_eq!(r.counts, vec![4, 1]);
        assert_eq!(
            r.slots[0],
            vec![Some((0, 0)), Some((1, 0)), Some((0, 1)), Some((0, 2)), None]
        );
        assert_eq!(r.dropped(), 1);
        assert_eq!(r.first_share, vec![0.8, 0.2]);
        // Random token selection keeps the three of highest priority, slotted in token order.
        let priority = [0.1, 0.5, 0.9, 0.2, 0.8];
        let r = top1(&gates, 2, None, Some(&priority), &DROP);
        assert_eq!(
            r.slots[0],
            vec![None, Some((1, 0)), Some((0, 0)), Some((0, 1)), Some((0, 2))]
        );
        // min_capacity raises the capacity; without drops it is the busiest expert's count.
        let r = top1(
            &gates,
            2,
            None,
            None,
            &RouteOptions {
                min_capacity: 4,
                ..DROP
            },
        );
        assert_eq!((r.capacity, r.dropped()), (4, 0));
        let r = top1(
            &gates,
            2,
            None,
            None,
            &RouteOptions {
                drop_tokens: false,
                ..DROP
            },
        );
        assert_eq!((r.capacity, r.dropped()), (4, 0));
        // A noisy choice picks from its own values.
        let noisy = [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0];
        let r = top1(&gates, 2, Some(&noisy), None, &DROP);
        assert_eq!(r.counts, vec![1, 4]);
    }

    /// Four tokens over three experts, top-2: capacity ⌈4/3 · 2⌉ = 3 per expert. Every first
    /// choice takes a slot before the second choices; expert 0 is first for three tokens and
    /// second for one, which is dropped.
    #[test]
    fn top2_places_first_choices_before_second_and_drops_past_capacity() {
        #[rustfmt::skip]
        let gates = [
            0.6, 0.3, 0.1,
            0.5, 0.1, 0.4,
            0.7, 0.2, 0.1,
            0.3, 0.6, 0.1,
        ];
        let r = top2(&gates, 3, &gates, &DROP);
        assert_eq!(r.capacity, 3);
        assert_eq!(
            r.slots[0],
            vec![Some((0, 0)), Some((0, 1)), Some((0, 2)), Some((1, 0))]
        );
        assert_eq!(
            r.slots[1],
            vec![Some((1, 1)), Some((2, 0)), Some((1, 2)), None]
        );
        assert_eq!(r.counts, vec![4, 3, 1]);
        assert_eq!(r.dropped(), 0);
        assert_eq!(r.first_share, vec![0.75, 0.25, 0.0]);
        let r = top2(
            &gates,
            3,
            &gates,
            &RouteOptions {
                drop_tokens: false,
                ..DROP
            },
        );
        assert_eq!(r.capacity, 4);
        assert!(r.slots.iter().flatten().all(Option::is_some));
    }
}
