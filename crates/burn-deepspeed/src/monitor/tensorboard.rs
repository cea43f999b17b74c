//! TensorBoard event files: scalars written the way TensorFlow's summary writer writes them,
//! and read back.
//!
//! An event file is a sequence of TFRecords (`u64` length, masked CRC-32C of the length, the
//! payload, masked CRC-32C of the payload, little-endian), each payload one `Event` protocol
//! buffer: the first carries `file_version = "brain.Event:2"`, each later one a `Summary` of
//! `simple_value` scalars at a step. TensorBoard loads every file whose name contains
//! `tfevents` in the folder it is pointed at.
//!
//! No maintained Rust crate writes these files (`tensorboard-rs`, the one the Burn ecosystem
//! names, has been unmaintained since 2022 and brings image and protobuf stacks along), and
//! the subset scalars need is small: the three message fields are encoded here by hand,
//! and [`read_scalars`] decodes them again, checking every checksum, for tests and tools.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{DeepSpeedError, Result};

/// One scalar of an event file: `tag` at `step`, written at `wall_time` (seconds since the
/// Unix epoch).
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarEvent {
    /// Wall-clock time the event was written.
    pub wall_time: f64,
    /// The step (DeepSpeed's monitor uses the samples seen so far).
    pub step: i64,
    /// The scalar's name, e.g. `Train/Samples/train_loss`.
    pub tag: String,
    /// Its value.
    pub value: f32,
}

/// Appends scalar events to one TensorBoard event file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it, named as TensorFlow names them
    /// (`events.out.tfevents.<seconds>.<host>.<pid>`, with `.<n>` added when this process
    /// made one with that name already, as two engines in one second do), starting with the
    /// file-version event. Never an existing file.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| DeepSpeedError::io(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let now = wall_time();
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        );
        let mut n = 0;
        let (path, file) = loop {
            let path = match n {
                0 => dir.join(&name),
                n => dir.join(format!("{name}.{n}")),
            };
            match OpenOptions::new().create_new(true).write(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1024 => n += 1,
                Err(e) => return Err(DeepSpeedError::io(&path, e)),
            }
        };
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event holding `scalars` at `step`.
    pub fn write_scalars(&mut self, step: i64, scalars: &[(&str, f32)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_float(&mut v, 2, *value);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| DeepSpeedError::io(&self.path, e))
    }

    fn record(&mut self, payload: &[u8]) -> Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(payload.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&masked_crc(&len).to_le_bytes());
        frame.extend_from_slice(payload);
        frame.extend_from_slice(&masked_crc(payload).to_le_bytes());
        self.out
            .write_all(&frame)
            .map_err(|e| DeepSpeedError::io(&self.path, e))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// Every scalar in the event file at `path`, in file order. Refuses a file whose framing or
/// checksums are wrong, naming the record.
pub fn read_scalars(path: &Path) -> Result<Vec<ScalarEvent>> {
    let bytes = std::fs::read(path).map_err(|e| DeepSpeedError::io(path, e))?;
    let corrupt = |record: usize, why: &str| {
        DeepSpeedError::Data(format!("{}: event record {record}: {why}", path.display()))
    };
    let mut out = Vec::new();
    let mut at = 0;
    let mut record = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| corrupt(record, "truncated header"))?;
        let (len_bytes, crc) = header.split_at(8);
        if masked_crc(len_bytes).to_le_bytes() != crc {
            return Err(corrupt(record, "length checksum mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let payload = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| corrupt(record, "truncated payload"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| corrupt(record, "truncated payload checksum"))?;
        if masked_crc(payload).to_le_bytes() != crc {
            return Err(corrupt(record, "payload checksum mismatch"));
        }
        decode_event(payload, &mut out).map_err(|why| corrupt(record, why))?;
        at += 16 + len;
        record += 1;
    }
    Ok(out)
}

fn decode_event(event: &[u8], out: &mut Vec<ScalarEvent>) -> std::result::Result<(), &'static str> {
    let (mut wall_time, mut step, mut summaries) = (0.0, 0i64, Vec::new());
    for field in Fields(event) {
        match field? {
            (1, Value::Fixed64(v)) => wall_time = f64::from_bits(v),
            (2, Value::Varint(v)) => step = v as i64,
            (5, Value::Bytes(b)) => summaries.push(b),
            _ => {}
        }
    }
    for summary in summaries {
        for field in Fields(summary) {
            let (1, Value::Bytes(value)) = field? else {
                continue;
            };
            let (mut tag, mut scalar) = (None, None);
            for field in Fields(value) {
                match field? {
                    (1, Value::Bytes(b)) => {
                        tag = Some(String::from_utf8(b.to_vec()).map_err(|_| "tag not UTF-8")?)
                    }
                    (2, Value::Fixed32(v)) => scalar = Some(f32::from_bits(v)),
                    _ => {}
                }
            }
            if let (Some(tag), Some(value)) = (tag, scalar) {
                out.push(ScalarEvent {
                    wall_time,
                    step,
                    tag,
                    value,
                });
            }
        }
    }
    Ok(())
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// Protocol-buffer wire format, the four field kinds an `Event` of scalars uses.

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, v: u64) {
    put_varint(out, field << 3);
    put_varint(out, v);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_varint(out, (field << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u64, v: f32) {
    put_varint(out, (field << 3) | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// The fields of one encoded message, in order.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = std::result::Result<(u64, Value<'a>), &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let parsed = (|| {
            let key = take_varint(&mut self.0)?;
            let value = match key & 7 {
                0 => Value::Varint(take_varint(&mut self.0)?),
                1 => Value::Fixed64(u64::from_le_bytes(take(&mut self.0, 8)?.try_into().ok()?)),
                2 => {
                    let len = take_varint(&mut self.0)? as usize;
                    Value::Bytes(take(&mut self.0, len)?)
                }
                5 => Value::Fixed32(u32::from_le_bytes(take(&mut self.0, 4)?.try_into().ok()?)),
                _ => return None,
            };
            Some((key >> 3, value))
        })();
        match parsed {
            Some(field) => Some(Ok(field)),
            None => {
                self.0 = &[];
                Some(Err("malformed protocol buffer"))
            }
        }
    }
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if b.len() < n {
        return None;
    }
    let (head, tail) = b.split_at(n);
    *b = tail;
    Some(head)
}

fn take_varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *take(b, 1)?.first()?;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit through a table.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// TFRecord's masking of a CRC (so that a CRC of data holding CRCs stays well mixed).
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two writers made in one second by one process (two engines) get files of their own.
    #[test]
    fn writers_made_together_get_files_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let a = EventWriter::create(dir.path()).unwrap();
        let b = EventWriter::create(dir.path()).unwrap();
        assert_ne!(a.path(), b.path());
        assert!(b.path().to_string_lossy().contains("tfevents"));
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn scalars_round_trip_and_corruption_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        for step in 0..5i64 {
            let loss = 3.0 - step as f32 * 0.25;
            w.write_scalars(
                step * 16,
                &[("Train/Samples/train_loss", loss), ("lr", 1e-3)],
            )
            .unwrap();
        }
        w.flush().unwrap();
        let path = w.path().to_path_buf();
        assert!(
            path.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .contains("tfevents")
        );
        let events = read_scalars(&path).unwrap();
        assert_eq!(events.len(), 10);
        let losses: Vec<(i64, f32)> = events
            .iter()
            .filter(|e| e.tag == "Train/Samples/train_loss")
            .map(|e| (e.step, e.value))
            .collect();
        assert_eq!(
            losses,
            vec![(0, 3.0), (16, 2.75), (32, 2.5), (48, 2.25), (64, 2.0)]
        );
        assert!(events.iter().all(|e| e.wall_time > 1.6e9));

        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = read_scalars(&path).unwrap_err().to_string();
        assert!(e.contains("record 5") && e.contains("checksum"), "{e}");
        bytes.truncate(n - 3);
        std::fs::write(&path, &bytes).unwrap();
        let e = read_scalars(&path).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
