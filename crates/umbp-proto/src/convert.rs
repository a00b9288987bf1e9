//! Conversions between `umbp-core` values and the `umbp.v1` messages that every speaker of the
//! protocols shares (the master, the master client, the peer service and its clients).

use umbp_core::TierType;

/// The wire value of a tier.
pub fn tier_to_wire(tier: TierType) -> i32 {
    // Tier numbers are small: always representable.
    i32::try_from(tier.wire()).unwrap_or(0)
}

/// A tier from the wire; negative or unknown numbers become [`TierType::Unknown`], so a newer peer's
/// tier is ignored rather than an error.
pub fn tier_from_wire(value: i32) -> TierType {
    u32::try_from(value).map_or(TierType::Unknown, TierType::from_wire)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_round_trip_and_strangers_are_unknown() {
        for tier in TierType::ALL {
            assert_eq!(tier_from_wire(tier_to_wire(tier)), tier);
            assert_eq!(tier_to_wire(tier), crate::v1::TierType::try_from(tier_to_wire(tier)).expect("known") as i32);
        }
        assert_eq!(tier_from_wire(-1), TierType::Unknown);
        assert_eq!(tier_from_wire(99), TierType::Unknown);
        assert_eq!(tier_to_wire(TierType::Unknown), 0);
        assert_eq!(tier_to_wire(TierType::Dram), crate::v1::TierType::TierDram as i32);
    }
}
