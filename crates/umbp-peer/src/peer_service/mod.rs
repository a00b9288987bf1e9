//! The `UMBPPeer` gRPC service: a node's slot lifecycle and lookups, dispatched into its
//! [`BackendRegistry`](umbp_core::BackendRegistry). Bytes never pass through here: writers and readers
//! move them over the data plane into and out of the pages this service hands out.
//!
//! - [`PeerService`] implements the generated `UmbpPeer` trait over a snapshot of the registry's
//!   media; [`PeerServer::start`] serves it on a TCP listener with the cluster token check, message
//!   limits, `TCP_NODELAY` and a bounded graceful shutdown ([`PeerServerHandle::shutdown`]).
//! - The wire conversions (`From` / `TryFrom`, [`umbp_proto::convert`]) and the struct-of-arrays
//!   codec of `BatchResolveKeys` ([`encode_batch_resolve`] / [`decode_batch_resolve`], from
//!   [`umbp_proto::resolve`]) live in `umbp-proto`, shared by the service and its clients.
//!
//! # Semantics (reference §10, with the choices below)
//! - **Slot ids are tagged** with the tier of the medium that issued them:
//!   `wire = tier << 56 | local` ([`tag_slot`]). Commit and abort carry no tier, so they dispatch on
//!   `wire >> 56` ([`slot_tier`]). Slot 0, or any id whose tier has no medium here, reaches no
//!   backend: commit answers `false`, abort `true` (idempotent). A backend slot id that does not fit
//!   56 bits is never truncated: the slot is aborted on its backend, logged, and the entry answers
//!   `FAILED`.
//! - **Every batch is answered per entry, in request order.** Entries are grouped by tier (ascending)
//!   and each present medium gets one batch call. A tier without a medium (or `UNKNOWN`), an empty
//!   key or a size of 0 is a per-entry `FAILED` / `false` / miss — never an RPC error.
//! - **Descriptors are stamped at the wire** with the registry's backend id (media publish 0, and
//!   buffer indexes collide across media). `GetPeerInfo` lists every buffer of every medium.
//! - **Resolve takes the first medium that holds the key**, in registry order (ascending tier).
//!   `BatchResolveKeys` asks each medium only for the keys no earlier medium answered. The reference
//!   asks every medium for every key (its §14.6): a mirrored key then takes a read lease on every
//!   medium that holds it — pages pinned against eviction that no reader will touch — and each medium
//!   does work whose answer is discarded. Asking only for the remaining keys gives the same answers
//!   (the first hit wins either way) and leases only the medium that serves the key. The media are
//!   still asked one after another, as in the reference.
//! - **Busy is not a miss.** A medium that holds a key but cannot serve it now (no free staging page)
//!   answers busy; the key is busy on the wire (`busy`, a per-key array sent only when needed)
//!   unless a later medium serves it. Readers retry a busy node; they never exclude it for that.
//! - **Hits name their read lease** (`lease_id`), and `ReleaseReads` hands each `(key, lease,
//!   backend id)` back to the medium that served it, which ends the lease when its last reader
//!   released it. Releases of unknown media, empty keys or lease 0 are ignored.
//! - **Evict fans out**: every medium evicts every key; the freed bytes are summed per key.
//! - **Backend calls run off the reactor**: every handler does its backend work in one
//!   `tokio::task::spawn_blocking` call (media take locks and may do IO). A panicking medium fails
//!   only the call that hit it (`INTERNAL`).
//! - The media list is snapshotted when the service is built: register every medium first.

mod keyed;
mod server;
mod service;

use umbp_core::TierType;

pub use keyed::KeyedMedia;
pub use server::{PeerServer, PeerServerConfig, PeerServerHandle, PeerServiceError};
pub use service::{ChangeHook, PeerService};
pub use umbp_proto::resolve::{DecodedResolve, ResolvedKey, decode_batch_resolve, encode_batch_resolve};

/// How far the tier is shifted into a wire slot id.
pub const SLOT_TIER_SHIFT: u32 = 56;

/// The largest backend-local slot id that fits a wire slot id (2^56 − 1).
pub const MAX_LOCAL_SLOT_ID: u64 = (1 << SLOT_TIER_SHIFT) - 1;

/// The wire slot id of a backend's `local` slot on the medium of `tier`; `None` when `local` does not
/// fit in 56 bits (it must then be refused, never truncated: a truncated id could commit someone
/// else's slot).
pub const fn tag_slot(tier: TierType, local: u64) -> Option<u64> {
    if local > MAX_LOCAL_SLOT_ID {
        return None;
    }
    Some(((tier.wire() as u64) << SLOT_TIER_SHIFT) | local)
}

/// The tier a wire slot id was issued by; [`TierType::Unknown`] for slot 0 and for tiers this build
/// does not know.
pub const fn slot_tier(wire: u64) -> TierType {
    // The shifted value is < 256: the cast is lossless.
    TierType::from_wire((wire >> SLOT_TIER_SHIFT) as u32)
}

/// The backend-local part of a wire slot id.
pub const fn slot_local(wire: u64) -> u64 {
    wire & MAX_LOCAL_SLOT_ID
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_ids_round_trip_through_the_tag() {
        for tier in TierType::ALL {
            for local in [1, 42, MAX_LOCAL_SLOT_ID] {
                let wire = tag_slot(tier, local).expect("fits");
                assert_eq!(slot_tier(wire), tier);
                assert_eq!(slot_local(wire), local);
            }
        }
        assert_eq!(tag_slot(TierType::Hbm, 7), Some((1 << 56) | 7));
    }

    #[test]
    fn slot_zero_and_unknown_tiers_reach_no_backend() {
        assert_eq!(slot_tier(0), TierType::Unknown);
        assert_eq!(slot_tier(42), TierType::Unknown);
        assert_eq!(slot_tier(9 << SLOT_TIER_SHIFT), TierType::Unknown);
        assert_eq!(slot_tier(u64::MAX), TierType::Unknown);
    }

    #[test]
    fn every_peer_service_error_is_fixed_in_the_settings() {
        let bind = PeerServiceError::Bind {
            addr: ([127, 0, 0, 1], 1).into(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        let config = PeerServiceError::InvalidConfig { reason: "x".into() };
        for e in [bind, config] {
            assert_eq!(e.kind(), umbp_core::ErrorKind::InvalidInput, "{e}");
        }
    }

    #[test]
    fn a_local_id_past_56_bits_is_refused_not_truncated() {
        assert_eq!(tag_slot(TierType::Dram, MAX_LOCAL_SLOT_ID + 1), None);
        assert_eq!(tag_slot(TierType::Dram, u64::MAX), None);
    }
}
