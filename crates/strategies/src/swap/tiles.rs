//! [`TilePlan`]: how a flat swapped state of several fields is laid out in its file, as plain
//! data.

use std::ops::Range;

use super::ALIGN;

/// A flat state of `len` `f32` elements per field (e.g. fp32 masters, m and v), cut into
/// tiles of `tile` elements. Tile `i` holds elements `range(i)` of every field, laid out in
/// the file as one record `[field 0 | field 1 | ...]`, each field padded to [`ALIGN`]: one
/// read and one write move a whole tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TilePlan {
    len: usize,
    tile: usize,
    fields: usize,
}

impl TilePlan {
    /// The plan of `len` elements per field in tiles of `tile` elements (clamped to
    /// `1..=len`; DeepSpeed's `sub_group_size`) over `fields` fields.
    pub fn new(len: usize, tile: usize, fields: usize) -> Self {
        Self {
            len,
            tile: tile.clamp(1, len.max(1)),
            fields: fields.max(1),
        }
    }

    /// Elements per field.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the state has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements per tile (the last one may hold fewer).
    pub fn tile(&self) -> usize {
        self.tile
    }

    /// Fields per record.
    pub fn fields(&self) -> usize {
        self.fields
    }

    /// Number of tiles.
    pub fn count(&self) -> usize {
        self.len.div_ceil(self.tile)
    }

    /// The elements tile `i` holds.
    pub fn range(&self, i: usize) -> Range<usize> {
        let start = i * self.tile;
        start..(start + self.tile).min(self.len)
    }

    /// Bytes one field occupies in a record.
    pub fn field_bytes(&self) -> usize {
        (4 * self.tile).div_ceil(ALIGN) * ALIGN
    }

    /// Bytes of one record (a whole tile).
    pub fn record_bytes(&self) -> usize {
        self.fields * self.field_bytes()
    }

    /// Where tile `i`'s record starts in the file.
    pub fn offset(&self, i: usize) -> u64 {
        (i * self.record_bytes()) as u64
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        (self.count() * self.record_bytes()) as u64
    }

    /// Where element `e` of field `f` of the tile's record sits, in `f32`s from the record's
    /// start.
    pub fn at(&self, f: usize, e: usize) -> usize {
        f * self.field_bytes() / 4 + e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_state_once_with_aligned_records() {
        for (len, tile, fields) in [(10, 3, 3), (1, 100, 2), (4096, 1024, 3), (1025, 1024, 1)] {
            let plan = TilePlan::new(len, tile, fields);
            let mut next = 0;
            for i in 0..plan.count() {
                let r = plan.range(i);
                assert_eq!(r.start, next);
                assert!(!r.is_empty() && r.len() <= plan.tile());
                next = r.end;
                assert_eq!(plan.offset(i) % ALIGN as u64, 0);
            }
            assert_eq!(next, len);
            assert_eq!(plan.field_bytes() % ALIGN, 0);
            assert!(plan.field_bytes() >= 4 * plan.tile());
            assert_eq!(
                plan.file_bytes(),
                (plan.count() * plan.record_bytes()) as u64
            );
        }
        let plan = TilePlan::new(10, 3, 3);
        assert_eq!((plan.count(), plan.range(3)), (4, 9..10));
        assert_eq!(plan.at(2, 1), 2 * 1024 + 1);
        assert_eq!(TilePlan::new(0, 5, 3).count(), 0);
    }
}
