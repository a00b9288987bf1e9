//! Sizes and durations as people write them: `64MiB`, `4GiB`, `512KiB`, `4096`; `500ms`, `5s`, `2m`.
//! The syntax lives in [`umbp_core::units`], where every component config's fields read it.

pub use umbp_core::units::{UnitError, format_duration, format_size, human_size, parse_duration, parse_size};
