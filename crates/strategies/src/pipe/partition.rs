//! Splitting a sequence of layers into pipeline stages (DeepSpeed's `partition_method`).
//!
//! A partition of `n` items into `p` parts is given, as in DeepSpeed, by `p + 1` boundaries:
//! part `i` holds items `parts[i]..parts[i + 1]`.

use regex::RegexBuilder;

use crate::{CommError, Result};

/// How layers are assigned to stages (`pipeline.partition` / `partition_method`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionMethod {
    /// The same number of layers per stage (the first stages take one more when it does not
    /// divide).
    Uniform,
    /// Balanced by trainable-parameter count: the heaviest stage is as light as possible
    /// (DeepSpeed's default, also spelled `best`).
    Parameters,
    /// Balanced by the number of layers whose type name matches a regular expression
    /// (case-insensitive), e.g. `type:block` puts the same number of transformer blocks on
    /// every stage.
    Type(String),
}

impl PartitionMethod {
    /// Parses DeepSpeed's spelling: `uniform`, `parameters`, `best` or `type:REGEX`.
    pub fn parse(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "uniform" => Ok(Self::Uniform),
            "parameters" | "best" => Ok(Self::Parameters),
            _ => match s.split_once(':') {
                Some((kind, pattern)) if kind.eq_ignore_ascii_case("type") => {
                    compile(pattern)?;
                    Ok(Self::Type(pattern.to_string()))
                }
                _ => Err(CommError::Pipeline(format!(
                    "unknown partition method `{s}`: expected `uniform`, `parameters` \
                     (or `best`) or `type:REGEX`"
                ))),
            },
        }
    }

    /// The stage boundaries for layers with these parameter counts and type names.
    pub fn partition(
        &self,
        param_counts: &[usize],
        type_names: &[&str],
        stages: usize,
    ) -> Result<Vec<usize>> {
        match self {
            Self::Uniform => Ok(partition_uniform(param_counts.len(), stages)),
            Self::Parameters => {
                let w: Vec<f64> = param_counts.iter().map(|&c| c as f64).collect();
                Ok(partition_balanced(&w, stages))
            }
            Self::Type(pattern) => {
                let re = compile(pattern)?;
                let w: Vec<f64> = type_names
                    .iter()
                    .map(|t| if re.is_match(t) { 1.0 } else { 0.0 })
                    .collect();
                if w.iter().all(|&x| x == 0.0) {
                    return Err(CommError::Pipeline(format!(
                        "`type:{pattern}` matches none of the layer types {type_names:?}"
                    )));
                }
                Ok(partition_balanced(&w, stages))
            }
        }
    }
}

fn compile(pattern: &str) -> Result<regex::Regex> {
    RegexBuilder::new(pattern)
        .case_insensitive(true)
        .build()
        .map_err(|e| {
            CommError::Pipeline(format!(
                "`type:{pattern}` is not a valid regular expression: {e}"
            ))
        })
}

/// Inclusive prefix sums: `[3, 4, 5]` gives `[3, 7, 12]`.
pub fn prefix_sum_inc(weights: &[f64]) -> Vec<f64> {
    weights
        .iter()
        .scan(0.0, |acc, &w| {
            *acc += w;
            Some(*acc)
        })
        .collect()
}

/// `items` items in `parts` contiguous parts of equal size; the first `items % parts` parts
/// take one more. With fewer items than parts, the last parts are empty.
pub fn partition_uniform(items: usize, parts: usize) -> Vec<usize> {
    assert!(parts > 0, "a partition needs at least one part");
    let (chunk, extra) = (items / parts, items % parts);
    (0..=parts).map(|p| p * chunk + p.min(extra)).collect()
}

/// Contiguous parts of non-negative `weights` whose heaviest part is as light as possible;
/// every part gets at least one item when there are enough. Among the optimal partitions it
/// returns the one whose earlier parts are fullest (DeepSpeed's greedy probe).
pub fn partition_balanced(weights: &[f64], parts: usize) -> Vec<usize> {
    assert!(parts > 0, "a partition needs at least one part");
    let n = weights.len();
    if n <= parts {
        return partition_uniform(n, parts);
    }
    // The optimal bottleneck is the weight of some contiguous run: search those.
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(prefix_sum_inc(weights))
        .collect();
    let mut candidates: Vec<f64> = (0..n)
        .flat_map(|i| (i + 1..=n).map(move |j| (i, j)))
        .map(|(i, j)| prefix[j] - prefix[i])
        .collect();
    candidates.sort_by(f64::total_cmp);
    candidates.dedup();
    let (mut lo, mut hi) = (0, candidates.len() - 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if probe(&prefix, parts, candidates[mid]).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    probe(&prefix, parts, candidates[lo]).expect("the total weight is always feasible")
}

/// Greedy: each part takes as many items as fit under `bottleneck` while leaving one item
/// for every later part. `None` when the items do not fit.
fn probe(prefix: &[f64], parts: usize, bottleneck: f64) -> Option<Vec<usize>> {
    let n = prefix.len() - 1;
    // Relative slack for float sums.
    let limit = bottleneck * (1.0 + 1e-12);
    let mut bounds = vec![0];
    let mut start = 0;
    for p in 0..parts {
        let must_leave = parts - p - 1;
        let mut end = start;
        while end < n - must_leave && prefix[end + 1] - prefix[start] <= limit {
            end += 1;
        }
        if end == start {
            return None;
        }
        bounds.push(end);
        start = end;
    }
    (start == n).then_some(bounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(weights: &[f64], parts: &[usize]) -> Vec<f64> {
        parts
            .windows(2)
            .map(|w| weights[w[0]..w[1]].iter().sum())
            .collect()
    }

    fn assert_valid(parts: &[usize], n: usize, p: usize) {
        assert_eq!(parts.len(), p + 1);
        assert_eq!(parts[0], 0);
        assert_eq!(parts[p], n);
        assert!(parts.windows(2).all(|w| w[0] <= w[1]), "{parts:?}");
    }

    #[test]
    fn deepspeed_test_vectors() {
        assert_eq!(prefix_sum_inc(&[3.0, 4.0, 5.0]), vec![3.0, 7.0, 12.0]);
        let ints = [0.0, 1.0, 2.0, 3.0, 3.0, 3.0];
        assert_eq!(partition_balanced(&ints, 4), vec![0, 3, 4, 5, 6]);
        assert!(costs(&ints, &[0, 3, 4, 5, 6]).iter().all(|&c| c == 3.0));
        let floats = [0.0, 1.1, 1.9, 3.0, 3.0, 3.0];
        assert_eq!(partition_balanced(&floats, 4), vec![0, 3, 4, 5, 6]);
        let ones = [1.0; 8];
        for parts in [partition_uniform(8, 4), partition_balanced(&ones, 4)] {
            assert_valid(&parts, 8, 4);
            assert!(costs(&ones, &parts).iter().all(|&c| c == 2.0), "{parts:?}");
        }
        // Fewer items than parts, and a single part.
        assert_eq!(partition_uniform(2, 4), vec![0, 1, 2, 2, 2]);
        assert_eq!(partition_balanced(&[1.0, 1.0], 4), vec![0, 1, 2, 2, 2]);
        assert_eq!(partition_balanced(&[1.0; 10], 1), vec![0, 10]);
    }

    #[test]
    fn uniform_spreads_the_remainder_over_the_first_parts() {
        assert_eq!(partition_uniform(10, 4), vec![0, 3, 6, 8, 10]);
        assert_eq!(partition_uniform(6, 4), vec![0, 2, 4, 5, 6]);
    }

    #[test]
    fn balanced_is_optimal_and_never_leaves_a_stage_empty() {
        // Brute force over every split of small weight lists.
        fn best(w: &[f64], p: usize) -> f64 {
            if p == 1 {
                return w.iter().sum();
            }
            (1..=w.len() - (p - 1))
                .map(|k| w[..k].iter().sum::<f64>().max(best(&w[k..], p - 1)))
                .fold(f64::INFINITY, f64::min)
        }
        let mut seed = 7u64;
        for n in 1..=9 {
            for p in 1..=n {
                let w: Vec<f64> = (0..n)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        ((seed >> 33) % 10) as f64
                    })
                    .collect();
                let parts = partition_balanced(&w, p);
                assert_valid(&parts, n, p);
                assert!(parts.windows(2).all(|x| x[0] < x[1]), "{w:?} {parts:?}");
                let worst = costs(&w, &parts).into_iter().fold(0.0, f64::max);
                assert_eq!(worst, best(&w, p), "{w:?} into {p}: {parts:?}");
            }
        }
    }

    #[test]
    fn methods_parse_and_partition() {
        let counts = [1000, 10, 10, 10, 10, 500];
        let types = ["Embed", "Block", "Block", "Block", "Block", "Head"];
        let m = |s: &str| PartitionMethod::parse(s).unwrap();
        assert_eq!(m("best"), PartitionMethod::Parameters);
        assert_eq!(
            m("uniform").partition(&counts, &types, 2).unwrap(),
            vec![0, 3, 6]
        );
        assert_eq!(
            m("parameters").partition(&counts, &types, 2).unwrap(),
            vec![0, 1, 6]
        );
        // Two blocks per stage; the weightless embedding and head go with the neighbours.
        assert_eq!(
            m("type:^block$").partition(&counts, &types, 2).unwrap(),
            vec![0, 3, 6]
        );
        let e = PartitionMethod::parse("random").unwrap_err().to_string();
        assert!(e.contains("unknown partition method `random`"), "{e}");
        let e = PartitionMethod::parse("type:(").unwrap_err().to_string();
        assert!(e.contains("not a valid regular expression"), "{e}");
        let e = m("type:conv").partition(&counts, &types, 2).unwrap_err();
        assert!(e.to_string().contains("matches none"), "{e}");
    }
}
