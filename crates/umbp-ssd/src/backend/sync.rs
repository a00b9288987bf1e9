//! Durability of the SSD medium: the periodic and on-demand `fdatasync` of the segments written
//! since the last sync (see `docs/ssd.md`, "Durability").

use super::*;

impl Inner {
    /// `fdatasync`s every segment written since the last sync (no lock held during the syncs).
    pub(super) fn sync_segments(&self) {
        // One pass at a time: a pass that finds a segment clean because another pass took it waits
        // for that pass's syncs to complete first.
        let _pass = self.sync_pass.lock();
        let files = self.state.lock().log_mut().take_unsynced();
        for f in files {
            let Some(file) = f.if_open() else { continue };
            match file.sync_data() {
                Ok(()) => bump(&self.counters.segment_sync),
                Err(e) => {
                    bump(&self.counters.segment_sync_error);
                    tracing::warn!(segment = %f.path.display(), error = %e, "fdatasync of a segment failed");
                }
            }
        }
    }

    /// The reaper's periodic sync: runs [`sync_segments`](Self::sync_segments) once
    /// `sync_interval` has passed since the last one.
    pub(super) fn maybe_sync(&self, now: Instant) {
        let Some(interval) = self.config.sync_interval else { return };
        {
            let mut last = self.last_sync.lock();
            if last.is_some_and(|t| now < t + interval) {
                return;
            }
            *last = Some(now);
        }
        self.sync_segments();
    }
}
