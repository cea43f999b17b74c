//! Lenient number parsing: DeepSpeed configs write counts such as `5e8`, which JSON reads as a
//! float.

use serde::{Deserialize, Deserializer, de::Error};

/// A non-negative integer written as an integer or as a float with no fractional part.
pub fn count<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = serde_json::Number::deserialize(d)?;
    if let Some(u) = v.as_u64() {
        return Ok(u);
    }
    match v.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64 => Ok(f as u64),
        _ => Err(D::Error::custom(format!(
            "expected a non-negative whole number, found {v}"
        ))),
    }
}

/// An optional [`count`].
pub fn opt_count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrap(#[serde(deserialize_with = "count")] u64);
    Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
}
