//! Errors from parsing or validating routing and eviction settings.

/// A routing or eviction setting that cannot be used.
///
/// The master refuses to start on an unknown strategy name (the reference fell back to the default
/// with a warning, which hides a typo), on invalid watermarks and on zero durations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RoutingConfigError {
    /// `UMBP_ROUTE_PUT_SELECT_ALGO` named no known algorithm.
    #[error("unknown put select algorithm {value:?} (expected `most_available` or `random`)")]
    UnknownSelectAlgo {
        /// The rejected text.
        value: String,
    },
    /// `UMBP_ROUTE_PUT_NODE_AFFINITY` named no known affinity.
    #[error("unknown put node affinity {value:?} (expected `none`, `same` or `local`)")]
    UnknownAffinity {
        /// The rejected text.
        value: String,
    },
    /// A get strategy name that is not known.
    #[error("unknown get strategy {value:?} (expected `local_preferring` or `random`)")]
    UnknownGetAlgo {
        /// The rejected text.
        value: String,
    },
    /// The watermarks do not satisfy `0 < low < high <= 1`.
    #[error("eviction watermarks need 0 < low ({low}) < high ({high}) <= 1")]
    InvalidWatermarks {
        /// The high watermark given.
        high: f64,
        /// The low watermark given.
        low: f64,
    },
    /// An eviction period or deadline of zero, which would spin or time out at once.
    #[error("eviction setting `{name}` must be greater than zero")]
    ZeroDuration {
        /// Which setting.
        name: &'static str,
    },
}

impl RoutingConfigError {
    /// What the caller should do next: every variant is a setting to fix, never to retry.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        umbp_core::ErrorKind::InvalidInput
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_routing_config_error_is_invalid_input() {
        let errors = [
            RoutingConfigError::UnknownSelectAlgo { value: "x".into() },
            RoutingConfigError::UnknownAffinity { value: "x".into() },
            RoutingConfigError::UnknownGetAlgo { value: "x".into() },
            RoutingConfigError::InvalidWatermarks { high: 0.5, low: 0.9 },
            RoutingConfigError::ZeroDuration { name: "eviction_period" },
        ];
        for err in errors {
            assert_eq!(err.kind(), umbp_core::ErrorKind::InvalidInput, "{err}");
        }
    }
}
