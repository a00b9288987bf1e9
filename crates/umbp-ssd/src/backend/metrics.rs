//! The SSD medium's counters: what `stats()` and the metrics publisher read, without the lock.

use super::*;

/// Medium-internal counters, sampled without the lock.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) device_read_ok: AtomicU64,
    pub(super) device_read_error: AtomicU64,
    pub(super) device_read_corrupt: AtomicU64,
    pub(super) device_write_ok: AtomicU64,
    pub(super) device_write_error: AtomicU64,
    pub(super) device_read_bytes: AtomicU64,
    pub(super) device_write_bytes: AtomicU64,
    pub(super) staged_hit: AtomicU64,
    pub(super) single_flight_lead: AtomicU64,
    pub(super) single_flight_merged: AtomicU64,
    pub(super) staging_full_reject: AtomicU64,
    pub(super) staging_busy_allocate: AtomicU64,
    pub(super) lease_released: AtomicU64,
    pub(super) staging_expired_reclaim: AtomicU64,
    pub(super) eviction_round: AtomicU64,
    pub(super) eviction_victim: AtomicU64,
    pub(super) segment_reclaimed: AtomicU64,
    pub(super) compaction_moved: AtomicU64,
    pub(super) recovery_record: AtomicU64,
    pub(super) recovery_corrupt: AtomicU64,
    pub(super) recovery_torn_tail: AtomicU64,
    pub(super) segment_sync: AtomicU64,
    pub(super) segment_sync_error: AtomicU64,
    pub(super) staging_in_use: AtomicU64,
    pub(super) partial_read: AtomicU64,
    pub(super) partial_read_avoided_bytes: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Medium-internal facts for tests and operators, read without IO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SsdStats {
    /// Drive reads issued for resolves (excluding recovery and compaction).
    pub device_reads: u64,
    /// Drive writes issued for commits.
    pub device_writes: u64,
    /// Resolves served from a cached staged copy without a drive read.
    pub staged_hits: u64,
    /// Resolves that waited for another resolve's read of the same key.
    pub single_flight_merged: u64,
    /// Resolves that found the key but no free staging page (answered busy: retry here).
    pub staging_full_rejects: u64,
    /// Allocations the drive had room for but no staging page was free for (answered
    /// [`AllocateOutcome::Busy`]: the writer retries here once pages come back).
    pub staging_busy_allocations: u64,
    /// Read leases on staged copies that ended because their last reader released them (before
    /// their expiry).
    pub leases_released: u64,
    /// Records whose CRC failed on a read (dropped, answered as a miss).
    pub corrupt_reads: u64,
    /// Keys evicted by the medium's own LRU.
    pub evicted: u64,
    /// Records recovered from the log at `init`.
    pub recovered: u64,
    /// Records skipped at recovery because their CRC failed.
    pub recovery_corrupt: u64,
    /// Segments whose tail was torn (scan stopped early) at recovery.
    pub torn_tails: u64,
    /// Segment files deleted because nothing live was left in them.
    pub segments_reclaimed: u64,
    /// Records moved by compaction.
    pub compaction_moved: u64,
    /// Segment files currently on the drives.
    pub segments: u64,
    /// Bytes the segment files occupy.
    pub log_bytes: u64,
    /// Bytes of live records.
    pub live_bytes: u64,
    /// Staging pages in use (pending, cached or leased).
    pub staging_pages_in_use: u64,
    /// Tombstones in force on the drives (evicted keys a restart must not bring back).
    pub tombstones: u64,
    /// Segment `fdatasync`s done by the periodic sync (and [`SsdBackend::sync`]).
    pub segment_syncs: u64,
    /// Bytes read from the drives for resolves (headers and values, whole or partial).
    pub device_read_bytes: u64,
    /// Partial reads: ranged resolves that staged only the pages their ranges cover.
    pub partial_reads: u64,
    /// Drive bytes the partial reads did not read (their records' bytes beyond what they read).
    pub partial_read_avoided_bytes: u64,
}

impl SsdBackend {
    /// Counters and gauges of the medium.
    pub fn stats(&self) -> SsdStats {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (segments, log_bytes, live_bytes, tombstones) = {
            let s = self.inner.state.lock();
            (s.log().segs.len() as u64, s.log().physical_bytes(), s.log().live_bytes(), s.tomb_count() as u64)
        };
        SsdStats {
            device_reads: l(&c.device_read_ok) + l(&c.device_read_error) + l(&c.device_read_corrupt),
            device_writes: l(&c.device_write_ok) + l(&c.device_write_error),
            staged_hits: l(&c.staged_hit),
            single_flight_merged: l(&c.single_flight_merged),
            staging_full_rejects: l(&c.staging_full_reject),
            staging_busy_allocations: l(&c.staging_busy_allocate),
            leases_released: l(&c.lease_released),
            corrupt_reads: l(&c.device_read_corrupt),
            evicted: l(&c.eviction_victim),
            recovered: l(&c.recovery_record),
            recovery_corrupt: l(&c.recovery_corrupt),
            torn_tails: l(&c.recovery_torn_tail),
            segments_reclaimed: l(&c.segment_reclaimed),
            compaction_moved: l(&c.compaction_moved),
            segments,
            log_bytes,
            live_bytes,
            staging_pages_in_use: l(&c.staging_in_use),
            tombstones,
            segment_syncs: l(&c.segment_sync),
            device_read_bytes: l(&c.device_read_bytes),
            partial_reads: l(&c.partial_read),
            partial_read_avoided_bytes: l(&c.partial_read_avoided_bytes),
        }
    }
}

impl MetricSource for SsdBackend {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let c = &self.inner.counters;
        let mut out = Vec::new();
        let events: [(&str, &AtomicU64); 22] = [
            ("device_read_ok", &c.device_read_ok),
            ("device_read_error", &c.device_read_error),
            ("device_read_corrupt", &c.device_read_corrupt),
            ("device_write_ok", &c.device_write_ok),
            ("device_write_error", &c.device_write_error),
            ("staged_copy_hit", &c.staged_hit),
            ("single_flight_lead", &c.single_flight_lead),
            ("single_flight_merged", &c.single_flight_merged),
            ("staging_slot_full_reject", &c.staging_full_reject),
            ("staging_allocate_busy", &c.staging_busy_allocate),
            ("read_lease_released", &c.lease_released),
            ("staging_expired_reclaim", &c.staging_expired_reclaim),
            ("eviction_round", &c.eviction_round),
            ("eviction_victim", &c.eviction_victim),
            ("segment_reclaimed", &c.segment_reclaimed),
            ("compaction_moved", &c.compaction_moved),
            ("recovery_record", &c.recovery_record),
            ("recovery_corrupt", &c.recovery_corrupt),
            ("recovery_torn_tail", &c.recovery_torn_tail),
            ("segment_sync", &c.segment_sync),
            ("segment_sync_error", &c.segment_sync_error),
            ("partial_read", &c.partial_read),
        ];
        for (event, v) in events {
            let v = v.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(
                    metric_names::MEDIUM_EVENTS_TOTAL,
                    metric_names::MEDIUM_EVENTS_TOTAL_HELP,
                    vec![("event".into(), event.into())],
                    v,
                ));
            }
        }
        for (event, v) in [
            ("device_read", &c.device_read_bytes),
            ("device_write", &c.device_write_bytes),
            ("partial_read_avoided", &c.partial_read_avoided_bytes),
        ] {
            let v = v.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(
                    metric_names::MEDIUM_BYTES_TOTAL,
                    metric_names::MEDIUM_BYTES_TOTAL_HELP,
                    vec![("event".into(), event.into())],
                    v,
                ));
            }
        }
        let gauge = |state: &str, value: u64| {
            MetricSample::gauge(
                metric_names::MEDIUM_STATE,
                metric_names::MEDIUM_STATE_HELP,
                vec![("state".into(), state.into())],
                value,
            )
        };
        out.push(gauge("staging_pages_in_use", c.staging_in_use.load(Ordering::Relaxed)));
        out.push(gauge("staging_pages_total", self.inner.config.staging_pages));
        // Sampled outside every lock but this short one (the publisher never holds a backend lock).
        let (segments, log_bytes, live_bytes) = {
            let s = self.inner.state.lock();
            (s.log().segs.len() as u64, s.log().physical_bytes(), s.log().live_bytes())
        };
        out.push(gauge("log_segments", segments));
        out.push(gauge("log_bytes", log_bytes));
        out.push(gauge("log_live_bytes", live_bytes));
        out
    }
}
