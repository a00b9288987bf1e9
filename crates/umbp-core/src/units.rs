//! Sizes and durations as people write them: `64MiB`, `4GiB`, `512KiB`, `4096`; `500ms`, `5s`, `2m`.
//!
//! Here, not in the command line, because every component config reads them: the [`serde`] helpers
//! below let a config field of bytes or of a [`Duration`] deserialize from the same text the settings
//! file, the environment and the flags accept, so each crate declares its settings once.

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
/// assert_eq!(umbp_core::units::parse_size("64MiB"), Ok(64 << 20));
/// assert_eq!(umbp_core::units::parse_size("4096"), Ok(4096));
/// assert!(umbp_core::units::parse_size("4GB").is_err());
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
/// assert_eq!(umbp_core::units::parse_duration("500ms"), Ok(Duration::from_millis(500)));
/// assert_eq!(umbp_core::units::parse_duration("5s"), Ok(Duration::from_secs(5)));
/// assert!(umbp_core::units::parse_duration("5").is_err());
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

impl UnitError {
    /// What the caller does next: fix the text (always [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput)).
    pub fn kind(&self) -> crate::ErrorKind {
        crate::ErrorKind::InvalidInput
    }
}

/// `#[serde(with = …)]` helpers: config fields in bytes or durations, read from the human syntax
/// (and written back in it, so a config serializes to a file that reads back the same).
pub mod serde {
    use std::time::Duration;

    use serde::de::{self, Deserializer, Visitor};
    use serde::ser::Serializer;

    use super::{format_duration, format_size, parse_duration, parse_size};

    /// Bytes (`u64`): an integer, or a string with a binary unit (`"64MiB"`).
    pub mod size {
        use super::*;

        /// Reads bytes.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = u64;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a size: bytes (4096) or a string with a unit (\"64MiB\")")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
                    Ok(v)
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
                    u64::try_from(v).map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
                    parse_size(v).map_err(E::custom)
                }
            }
            d.deserialize_any(V)
        }

        /// Writes bytes as [`format_size`] does (`"4GiB"`).
        pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&format_size(*v))
        }
    }

    /// Bytes as `usize` (a message limit): as [`size`], refusing what does not fit.
    pub mod size_usize {
        use super::*;

        /// Reads bytes.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
            let v = super::size::deserialize(d)?;
            usize::try_from(v).map_err(|_| de::Error::custom(format!("{v} is too large")))
        }

        /// Writes bytes as [`format_size`] does.
        pub fn serialize<S: Serializer>(v: &usize, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&format_size(*v as u64))
        }
    }

    /// A [`Duration`]: a string with a unit (`"500ms"`, `"5s"`); a bare number is refused.
    pub mod duration {
        use super::*;

        struct V;
        impl Visitor<'_> for V {
            type Value = Duration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration with a unit (\"500ms\", \"5s\")")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
                Err(E::custom(format!("a duration needs a unit: write \"{v}s\" or \"{v}ms\"")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
                Err(E::custom(format!("a duration needs a unit: write \"{v}s\" or \"{v}ms\"")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                parse_duration(v).map_err(E::custom)
            }
        }

        /// Reads a duration.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
            d.deserialize_any(V)
        }

        /// Writes a duration as [`format_duration`] does (`"5s"`).
        pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&format_duration(*v))
        }
    }

    /// An optional period: a duration greater than zero, or `"off"` (`None`).
    pub mod period_or_off {
        use super::*;

        /// Reads `"off"` (also `"false"`, `"none"`) as `None`, else a duration greater than zero.
        pub fn parse(text: &str) -> Result<Option<Duration>, String> {
            match text.trim() {
                "off" | "false" | "none" => Ok(None),
                t => match parse_duration(t) {
                    Ok(d) if !d.is_zero() => Ok(Some(d)),
                    Ok(_) => Err("must be greater than zero (\"off\" turns it off)".into()),
                    Err(e) => Err(e.to_string()),
                },
            }
        }

        /// Reads a period or `"off"`.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Option<Duration>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a duration with a unit (\"1s\") or \"off\"")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<Duration>, E> {
                    parse(v).map_err(E::custom)
                }
            }
            d.deserialize_any(V)
        }

        /// Writes `"off"` or the duration.
        pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                None => s.serialize_str("off"),
                Some(d) => s.serialize_str(&format_duration(*d)),
            }
        }
    }

    /// A value read with its [`FromStr`](std::str::FromStr) and written with its `Display`.
    pub mod from_str {
        use std::fmt::Display;
        use std::str::FromStr;

        use super::*;

        /// Reads the value from a string.
        pub fn deserialize<'de, D, T>(d: D) -> Result<T, D::Error>
        where
            D: Deserializer<'de>,
            T: FromStr,
            T::Err: Display,
        {
            let text = <String as ::serde::Deserialize>::deserialize(d)?;
            text.parse().map_err(de::Error::custom)
        }

        /// Writes the value's `Display`.
        pub fn serialize<S: Serializer, T: Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(v)
        }
    }
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

#[cfg(test)]
mod serde_tests {
    use std::time::Duration;

    #[derive(Debug, ::serde::Deserialize, ::serde::Serialize, PartialEq)]
    struct S {
        #[serde(with = "super::serde::size")]
        bytes: u64,
        #[serde(with = "super::serde::duration")]
        every: Duration,
        #[serde(with = "super::serde::period_or_off")]
        sync: Option<Duration>,
    }

    #[test]
    fn fields_read_the_human_syntax_and_refuse_a_bare_duration() {
        let s: S = serde_json::from_str(r#"{"bytes":"64MiB","every":"5s","sync":"off"}"#).expect("valid");
        assert_eq!(s, S { bytes: 64 << 20, every: Duration::from_secs(5), sync: None });
        let back: S = serde_json::from_str(&serde_json::to_string(&s).expect("write")).expect("read back");
        assert_eq!(back, s);
        assert!(serde_json::from_str::<S>(r#"{"bytes":1,"every":5,"sync":"1s"}"#).is_err());
        assert!(serde_json::from_str::<S>(r#"{"bytes":"4GB","every":"5s","sync":"1s"}"#).is_err());
        assert!(serde_json::from_str::<S>(r#"{"bytes":1,"every":"5s","sync":"0s"}"#).is_err());
        assert_eq!(super::UnitError::BadSize { input: String::new() }.kind(), crate::ErrorKind::InvalidInput);
    }
}
