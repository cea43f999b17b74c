//! Moving a rank's buffer (its pieces of many tensors back to back, as a
//! [`Segment`] list describes) to and from per-tensor storage one range at a time: the
//! optimizer's tiles on one side, a parameter store's tensors on the other. Plain data,
//! tested without tensors.

use std::ops::Range;

use burn_deepspeed_strategies::zero::Segment;

use burn_deepspeed_strategies::Result;

/// Fills ranges of a rank's buffer, in order, from whole pieces read one tensor at a time
/// (the last one kept for the next range).
#[derive(Debug)]
pub struct PieceReader<'a> {
    segments: &'a [Segment],
    next: usize,
    cached: Option<(usize, Vec<f32>)>,
}

impl<'a> PieceReader<'a> {
    /// A reader over `segments` (sorted by their place in the buffer, as a plan gives them).
    pub fn new(segments: &'a [Segment]) -> Self {
        Self {
            segments,
            next: 0,
            cached: None,
        }
    }

    /// Fills `out` with the buffer's `range` (after the previous range), reading a tensor's
    /// piece with `piece(t)` when the range first reaches it.
    pub fn fill(
        &mut self,
        range: Range<usize>,
        out: &mut [f32],
        mut piece: impl FnMut(usize) -> Result<Vec<f32>>,
    ) -> Result<()> {
        while let Some(seg) = self.segments.get(self.next) {
            let (lo, hi) = (
                seg.local.start.max(range.start),
                seg.local.end.min(range.end),
            );
            if lo < hi {
                if self.cached.as_ref().map(|c| c.0) != Some(seg.tensor) {
                    self.cached = Some((seg.tensor, piece(seg.tensor)?));
                }
                let values = &self.cached.as_ref().expect("cached above").1;
                out[lo - range.start..hi - range.start]
                    .copy_from_slice(&values[lo - seg.local.start..hi - seg.local.start]);
            }
            if seg.local.end > range.end {
                break;
            }
            self.next += 1;
        }
        Ok(())
    }
}

/// Collects ranges of a rank's buffer, in order, into whole pieces, and hands each piece on
/// when its last element arrives.
#[derive(Debug)]
pub struct PieceWriter<'a> {
    segments: &'a [Segment],
    next: usize,
    partial: Vec<f32>,
}

impl<'a> PieceWriter<'a> {
    /// A writer over `segments` (sorted by their place in the buffer).
    pub fn new(segments: &'a [Segment]) -> Self {
        Self {
            segments,
            next: 0,
            partial: Vec::new(),
        }
    }

    /// Takes the buffer's `range` (after the previous range) as `values`, calling
    /// `done(t, piece)` for every tensor whose piece is now complete. A piece that lies
    /// within one range is handed on without a copy.
    pub fn push(
        &mut self,
        range: Range<usize>,
        values: &[f32],
        mut done: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let mut at = range.start;
        while at < range.end {
            let Some(seg) = self.segments.get(self.next) else {
                break;
            };
            let end = seg.local.end.min(range.end);
            let part = &values[at - range.start..end - range.start];
            let complete = end == seg.local.end;
            match (at == seg.local.start, complete) {
                (true, true) => done(seg.tensor, part)?,
                _ => {
                    self.partial.extend_from_slice(part);
                    if complete {
                        done(seg.tensor, &self.partial)?;
                        self.partial.clear();
                    }
                }
            }
            if complete {
                self.next += 1;
            }
            at = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::zero::ShardPlan;

    /// Whatever the tiling, the writer hands every piece on once, whole and in order, and the
    /// reader rebuilds the buffer from the pieces, reading each tensor once.
    #[test]
    fn pieces_round_trip_through_any_tiling() {
        let plan = ShardPlan::new(&[7, 1, 300, 2, 1000, 64], 3, 0, 0);
        for rank in 0..3 {
            let segments = plan.segments(rank);
            let len = plan.own_len(rank);
            let buffer: Vec<f32> = (0..len).map(|i| i as f32).collect();
            for tile in [1, 3, 64, 97, len.max(1), len + 5] {
                let mut pieces: Vec<(usize, Vec<f32>)> = Vec::new();
                let mut writer = PieceWriter::new(&segments);
                for start in (0..len).step_by(tile) {
                    let r = start..(start + tile).min(len);
                    writer
                        .push(r.clone(), &buffer[r], |t, p| {
                            pieces.push((t, p.to_vec()));
                            Ok(())
                        })
                        .unwrap();
                }
                let tensors: Vec<usize> = segments.iter().map(|s| s.tensor).collect();
                assert_eq!(pieces.iter().map(|p| p.0).collect::<Vec<_>>(), tensors);
                for (seg, (_, p)) in segments.iter().zip(&pieces) {
                    assert_eq!(p[..], buffer[seg.local.clone()]);
                }
                let mut reads = Vec::new();
                let mut reader = PieceReader::new(&segments);
                let mut back = vec![0.0; len];
                for start in (0..len).step_by(tile) {
                    let r = start..(start + tile).min(len);
                    reader
                        .fill(r.clone(), &mut back[r], |t| {
                            reads.push(t);
                            Ok(pieces.iter().find(|p| p.0 == t).unwrap().1.clone())
                        })
                        .unwrap();
                }
                assert_eq!(back, buffer, "rank {rank} tile {tile}");
                assert_eq!(reads, tensors, "each piece read once");
            }
        }
    }
}
