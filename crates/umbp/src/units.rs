//! Sizes and durations as people write them: `64MiB`, `4GiB`, `512KiB`, `4096`; `500ms`, `5s`, `2m`.

use std::time::Duration;

/// A size or duration that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnitError {
    /// Not a size.
    #[error("{input:?} is not a size: expected bytes (4096) or a whole number with a unit (512KiB, 64MiB, 4GiB)")]
    BadSize {
        /// What was given.
        input: String,
    },
    /// A decimal unit (`KB`, `MB`, …), which people read both as 1000 and 1024.
    #[error("{input:?} is ambiguous: write {suggestion} (1024-based) or a plain byte count")]
    AmbiguousSize {
        /// What was given.
        input: String,
        /// The binary unit to write instead.
        suggestion: String,
    },
    /// Not a duration.
    #[error("{input:?} is not a duration: expected a whole number with a unit (250us, 500ms, 5s, 2m, 1h)")]
    BadDuration {
        /// What was given.
        input: String,
    },
    /// The value does not fit 64 bits.
    #[error("{input:?} is too large")]
    Overflow {
        /// What was given.
        input: String,
    },
}

const KIB: u64 = 1 << 10;

/// Splits `12MiB` into `("12", "MiB")`.
fn split_number(s: &str) -> (&str, &str) {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(end);
    (number, unit.trim_start())
}

/// Reads a byte size: a plain number of bytes, or a whole number with a binary unit — `B`, `KiB`,
/// `MiB`, `GiB`, `TiB` (case-insensitive; `K`, `M`, `G`, `T` are the same units). Decimal units
/// (`KB`, `MB`, …) are refused as ambiguous. Underscores group digits (`1_048_576`).
///
/// ```
/// assert_eq!(umbp::parse_size("64MiB"), Ok(64 << 20));
/// assert_eq!(umbp::parse_size("4096"), Ok(4096));
/// assert!(umbp::parse_size("4GB").is_err());
/// ```
pub fn parse_size(input: &str) -> Result<u64, UnitError> {
    let cleaned: String = input.trim().chars().filter(|c| *c != '_').collect();
    let (number, unit) = split_number(&cleaned);
    let bad = || UnitError::BadSize { input: input.to_owned() };
    if number.is_empty() {
        return Err(bad());
    }
    let value: u64 = number.parse().map_err(|_| UnitError::Overflow { input: input.to_owned() })?;
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => KIB.pow(2),
        "g" | "gib" => KIB.pow(3),
        "t" | "tib" => KIB.pow(4),
        decimal @ ("kb" | "mb" | "gb" | "tb") => {
            let suggestion = format!("{}{}iB", number, decimal[..1].to_ascii_uppercase());
            return Err(UnitError::AmbiguousSize { input: input.to_owned(), suggestion });
        }
        _ => return Err(bad()),
    };
    value.checked_mul(multiplier).ok_or_else(|| UnitError::Overflow { input: input.to_owned() })
}

/// Reads a duration: a whole number with a unit — `us`, `ms`, `s`, `m`, `h`. A bare number is
/// refused: `5` could mean seconds or milliseconds.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(umbp::parse_duration("500ms"), Ok(Duration::from_millis(500)));
/// assert_eq!(umbp::parse_duration("5s"), Ok(Duration::from_secs(5)));
/// assert!(umbp::parse_duration("5").is_err());
/// ```
pub fn parse_duration(input: &str) -> Result<Duration, UnitError> {
    let cleaned: String = input.trim().chars().filter(|c| *c != '_').collect();
    let (number, unit) = split_number(&cleaned);
    let bad = || UnitError::BadDuration { input: input.to_owned() };
    if number.is_empty() {
        return Err(bad());
    }
    let value: u64 = number.parse().map_err(|_| UnitError::Overflow { input: input.to_owned() })?;
    let overflow = || UnitError::Overflow { input: input.to_owned() };
    match unit {
        "us" | "µs" => Ok(Duration::from_micros(value)),
        "ms" => Ok(Duration::from_millis(value)),
        "s" => Ok(Duration::from_secs(value)),
        "m" | "min" => value.checked_mul(60).map(Duration::from_secs).ok_or_else(overflow),
        "h" => value.checked_mul(3600).map(Duration::from_secs).ok_or_else(overflow),
        _ => Err(bad()),
    }
}

/// Writes a size the way [`parse_size`] reads it, exactly: the largest binary unit that divides it
/// (`4GiB`, `1536KiB`, `100`).
pub fn format_size(bytes: u64) -> String {
    for (unit, size) in [("TiB", KIB.pow(4)), ("GiB", KIB.pow(3)), ("MiB", KIB.pow(2)), ("KiB", KIB)] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

/// Writes a size for people to read, rounded: `1.5 GiB`, `640 KiB`, `17 B`.
pub fn human_size(bytes: u64) -> String {
    let mut value = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"] {
        if value < 1024.0 || unit == "TiB" {
            return if unit == "B" {
                format!("{bytes} B")
            } else if value >= 100.0 || value.fract() == 0.0 {
                format!("{value:.0} {unit}")
            } else {
                format!("{value:.1} {unit}")
            };
        }
        value /= 1024.0;
    }
    format!("{bytes} B")
}

/// Writes a duration the way [`parse_duration`] reads it, exactly (`500ms`, `5s`, `2m`).
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        let s = d.as_secs();
        if s >= 3600 && s.is_multiple_of(3600) {
            return format!("{}h", s / 3600);
        }
        if s >= 60 && s.is_multiple_of(60) {
            return format!("{}m", s / 60);
        }
        return format!("{s}s");
    }
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{}ms", d.as_millis());
    }
    format!("{}us", d.as_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip_through_format() {
        for bytes in [0, 1, 100, 1024, 1536 << 10, 64 << 20, 4 << 30, 3 << 40, 4097] {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes), "{bytes}");
        }
    }

    #[test]
    fn durations_round_trip_through_format() {
        for d in [
            Duration::ZERO,
            Duration::from_micros(250),
            Duration::from_millis(500),
            Duration::from_millis(1500),
            Duration::from_secs(5),
            Duration::from_secs(120),
            Duration::from_secs(7200),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{d:?}");
        }
    }
}
