//! Each rank's measured figures, gathered to every rank for the report.

use burn_deepspeed::Result;
use burn_deepspeed::comm::{Communicator, CommunicatorExt};
use burn_deepspeed::grid::AxisBytes;

use super::report::*;

/// One rank's end-of-run figures.
pub(crate) struct RankFigures {
    pub(crate) axis: AxisBytes,
    pub(crate) sent: u64,
    pub(crate) model_sent: u64,
    pub(crate) state: u64,
    /// The formula's model state (pipelined runs: this stage's).
    pub(crate) formula: u64,
    pub(crate) peak_state: u64,
    pub(crate) rss: u64,
    pub(crate) bubble: f64,
    pub(crate) live_activations: u64,
    /// Data-parallel runs: the mean phase times.
    pub(crate) breakdown: StepBreakdown,
}

/// Every rank's figures, in rank order (moved as little-endian bytes: the communicator
/// moves u8).
pub(crate) fn gather_figures(
    comm: &dyn Communicator,
    mine: RankFigures,
) -> Result<Vec<RankFigures>> {
    let words = [
        mine.sent,
        mine.model_sent,
        mine.state,
        mine.formula,
        mine.peak_state,
        mine.rss,
        mine.bubble.to_bits(),
        mine.live_activations,
        mine.axis.tensor,
        mine.axis.pipe,
        mine.axis.data,
        mine.axis.other,
        mine.axis.sequence,
    ]
    .into_iter()
    .chain(mine.breakdown.words().map(f64::to_bits))
    .collect::<Vec<u64>>();
    let bytes: Vec<u8> = words.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut all = vec![0u8; bytes.len() * comm.world_size()];
    comm.all_gather_equal(&bytes, &mut all)?;
    Ok(all
        .chunks(bytes.len())
        .map(|c| {
            let v = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            RankFigures {
                sent: v(0),
                model_sent: v(1),
                state: v(2),
                formula: v(3),
                peak_state: v(4),
                rss: v(5),
                bubble: f64::from_bits(v(6)),
                live_activations: v(7),
                axis: AxisBytes {
                    tensor: v(8),
                    pipe: v(9),
                    data: v(10),
                    other: v(11),
                    sequence: v(12),
                },
                breakdown: StepBreakdown::from_words(std::array::from_fn(|i| {
                    f64::from_bits(v(13 + i))
                })),
            }
        })
        .collect())
}

/// The process's peak resident set size (`VmHWM`), or 0 where `/proc` is unavailable.
pub fn peak_rss_bytes() -> u64 {
    burn_deepspeed::monitor::peak_rss_bytes().unwrap_or(0)
}
