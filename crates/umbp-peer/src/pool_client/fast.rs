//! The hot path of a single key: one exchange with the holder's data server.
//!
//! A routed get pays a route call to the master, a resolve RPC to the holder's peer service, the
//! transfer (through the engine's worker threads) and a release; a routed put a route, an allocate
//! RPC, the transfer and a commit RPC. For a single key the client instead sends a **keyed
//! request** (`umbp_transfer`'s `KeyedClient`) from the calling thread to the holder's data server,
//! which resolves (or allocates), moves the bytes and releases (or commits) on its connection
//! thread — see `umbp_transfer`'s `keyed` module and this crate's `KeyedMedia`:
//!
//! - **get**: where the client last saw the key (its **location cache**, filled by keyed gets and
//!   puts and by routed reads from another node, entries living [`LOCATION_TTL`]; a value re-cached
//!   on this node's own medium drops its entry) → one GET_KEY; with no cached location, a route
//!   call first (which stamps the master's LRU) for a client that lends no medium, the routed path
//!   (its own medium first) for a node that does. A cache hit skips the master, so the key is queued as an
//!   **access hint**, sent with the others in one batch at most every [`HINT_EVERY`] in the
//!   background, so the master's LRU still sees the read. The holder's read lease covers the send;
//!   a send that outlived it arrives marked lapsed and is discarded, never returned.
//! - **put** (a client that lends no medium): a route call → one PUT_KEY (allocate, receive,
//!   commit); the holder's commit wakes its heartbeat, as a routed commit does.
//!
//! With `shared_memory` on (the default), a get asks a holder on this host to answer with where
//! the value lies in its shared memory instead of the bytes; the client copies them from its own
//! mapping of the holder's region, under the holder's read lease, and the exchange ends the lease
//! (see `umbp_transfer`'s `KeyedClient::get_shared`). A holder elsewhere, or a value the client
//! cannot map, is answered with the bytes, in the same exchange. A put of a large value (128 KiB
//! and up) likewise copies it into the slot the holder allocated, through the mapping, and the
//! holder commits it when told in time (`KeyedClient::put_shared`).
//!
//! Anything else falls back to the routed path, which keeps every rule it has: a miss, a busy or
//! unreachable holder, a lapsed lease, a holder that does not serve keyed requests (an older build,
//! a value in device memory), a caller buffer in device memory, a node with a medium of its own (its
//! local look comes first there). A miss or a failure also drops the cached location. So a stale
//! location costs one exchange, never wrong bytes: the holder resolves the key itself, and values
//! are write-once, so any holder's bytes for a key are that key's value.

use std::sync::atomic::{AtomicBool, Ordering};

use tracing::Instrument;
use umbp_transfer::{KeyedGet, KeyedPut};

use super::phases::{self, phase};
use super::support::{CallerBuf, StatCounters, blocking};
use super::*;
use crate::master_client::RoutePutDecision;

/// How long a cached location is trusted without a route call.
pub(super) const LOCATION_TTL: Duration = Duration::from_secs(30);
/// Locations cached at most (a full cache drops its expired entries, then everything).
const LOCATION_CAP: usize = 1 << 16;
/// Access hints are sent at most this often, in one batch.
pub(super) const HINT_EVERY: Duration = Duration::from_millis(50);
/// Hints waiting at most; more are dropped (they are hints).
const HINTS_CAP: usize = 16384;

/// Where a key was last read or written: its holder and the holder's data endpoint.
#[derive(Debug, Clone)]
struct Location {
    node: Arc<str>,
    endpoint: Arc<str>,
    until: Instant,
}

/// The client's location cache (see the module docs). foldhash (randomly seeded) rather than
/// SipHash: a batch looks up every key on the path its caller waits on.
#[derive(Debug, Default)]
pub(super) struct Locations {
    map: Mutex<foldhash::HashMap<String, Location>>,
}

impl Locations {
    fn get(&self, key: &str, now: Instant) -> Option<(Arc<str>, Arc<str>)> {
        Self::live(&self.map.lock(), key, now)
    }

    /// [`get`](Self::get) of every key under one lock, each live location refreshed as it is
    /// found (a batch about to read the keys there). Refreshed before the read rather than after
    /// it, the batch's end takes no second pass over its keys; a key that then misses there is
    /// forgotten, so a refresh never outlives a wrong location.
    pub(super) fn get_many_refreshed(&self, keys: &[&str], now: Instant) -> Vec<Option<(Arc<str>, Arc<str>)>> {
        let mut map = self.map.lock();
        keys.iter()
            .map(|key| {
                let l = map.get_mut(*key).filter(|l| l.until > now)?;
                l.until = now + LOCATION_TTL;
                Some((Arc::clone(&l.node), Arc::clone(&l.endpoint)))
            })
            .collect()
    }

    fn live(map: &foldhash::HashMap<String, Location>, key: &str, now: Instant) -> Option<(Arc<str>, Arc<str>)> {
        let l = map.get(key).filter(|l| l.until > now)?;
        Some((Arc::clone(&l.node), Arc::clone(&l.endpoint)))
    }

    pub(super) fn insert(&self, key: &str, node: &str, endpoint: &str, now: Instant) {
        let mut map = self.map.lock();
        let fresh = || Location { node: node.into(), endpoint: endpoint.into(), until: now + LOCATION_TTL };
        match map.get_mut(key) {
            Some(l) if *l.node == *node && *l.endpoint == *endpoint => l.until = now + LOCATION_TTL,
            Some(l) => *l = fresh(),
            None => Self::add(&mut map, key, fresh(), now),
        }
    }

    /// [`insert`](Self::insert) of every `(key, node, endpoint)` under one lock, sharing the
    /// holders' names: a batch's hits or writes, recorded after its copies, on the path a caller
    /// waits on. A key already cached is refreshed in place; a new one allocates its key only.
    pub(super) fn insert_many<'a>(
        &self,
        entries: impl IntoIterator<Item = (&'a str, &'a Arc<str>, &'a Arc<str>)>,
        now: Instant,
    ) {
        let mut map = self.map.lock();
        for (key, node, endpoint) in entries {
            let fresh =
                || Location { node: Arc::clone(node), endpoint: Arc::clone(endpoint), until: now + LOCATION_TTL };
            match map.get_mut(key) {
                Some(l) => *l = fresh(),
                None => Self::add(&mut map, key, fresh(), now),
            }
        }
    }

    /// Adds a key not cached yet, making room first when the cache is full.
    fn add(map: &mut foldhash::HashMap<String, Location>, key: &str, location: Location, now: Instant) {
        if map.len() >= LOCATION_CAP {
            map.retain(|_, l| l.until > now);
            if map.len() >= LOCATION_CAP {
                map.clear();
            }
        }
        map.insert(key.to_owned(), location);
    }

    pub(super) fn forget(&self, key: &str) {
        self.map.lock().remove(key);
    }

    /// Drops every location on `node` (it failed or went away).
    pub(super) fn forget_node(&self, node: &str) {
        self.map.lock().retain(|_, l| &*l.node != node);
    }
}

/// Keys read without a route call, waiting to be told to the master in one batch.
#[derive(Debug, Default)]
pub(super) struct Hints {
    keys: Mutex<Vec<String>>,
    scheduled: AtomicBool,
}

impl PoolClient {
    /// A holder's exchange failed as if it went away: its keys' locations, its idle connections
    /// and (soon) its mappings are dropped, so the next call asks the master.
    pub(super) fn forget_holder(&self, node: &str, endpoint: &str) {
        self.locations.forget_node(node);
        self.keyed.forget(endpoint);
        self.sweep_shared_memory();
    }

    /// A single-key get over one keyed exchange; `None`: take the routed path.
    pub(super) async fn get_fast(&self, key: &str, buf: CallerBuf) -> Option<Result<u64, KeyError>> {
        if !self.config.keyed_requests || key.is_empty() || self.in_device_registration(buf) {
            return None;
        }
        let now = self.clock.now();
        let (node, endpoint, cached) = match self.locations.get(key, now) {
            Some((node, endpoint)) => (node, endpoint, true),
            // A node with a medium looks at its own medium first: the routed path does that (and
            // remembers where it found a remote key).
            None if self.medium.is_some() => return None,
            None => {
                let routed = self
                    .master
                    .batch_route_get(&[key.to_owned()], &self.recently_unreachable())
                    .instrument(phase!(phases::GET_ROUTE))
                    .await;
                match routed.map(|mut hits| hits.pop().flatten()) {
                    Ok(Some(hit)) if !hit.data_endpoint.is_empty() && hit.node_id != self.config.node_id => {
                        (hit.node_id.into(), hit.data_endpoint.into(), false)
                    }
                    Ok(Some(_)) => return None,
                    Ok(None) => return Some(Err(KeyError::Miss)),
                    Err(e) => return Some(Err(KeyError::Routing(e.into()))),
                }
            }
        };
        let keyed = Arc::clone(&self.keyed);
        // A holder on this host may answer with where the value lies in its shared memory, which
        // the client then copies from its own mapping (`KeyedClient::get_shared`); off with the
        // shared path.
        let shared = self.config.shared_memory;
        // The holder judges its own lease (the trailer); the client's `read_lease` bounds the
        // exchange too, from before it was sent, as on the routed path (nodes of a cluster share
        // the setting: the stricter of the two rules).
        let sent = self.clock.now();
        let got = phase!(phases::GET_KEYED).in_scope(|| {
            blocking(|| {
                // SAFETY: `buf` is a caller buffer of this call (a slice it borrows, or a raw range
                // its contract keeps valid and unshared until the call returns), host memory (not in
                // a device registration: checked above); this blocks until the exchange is over.
                unsafe {
                    if shared {
                        keyed.get_shared(&endpoint, key, buf.ptr, buf.len)
                    } else {
                        keyed.get(&endpoint, key, buf.ptr, buf.len)
                    }
                }
            })
        });
        let got = match got {
            Ok(KeyedGet::Hit { .. }) if self.clock.now() > sent + self.config.read_lease => Ok(KeyedGet::Lapsed),
            other => other,
        };
        match got {
            Ok(KeyedGet::Hit { size, crc32c }) if !self.copy_is_intact(key, &node, buf, size, crc32c) => {
                // Corrupt bytes at that holder (or on the way): the routed path reads the key
                // elsewhere, or reports a miss (it checks again, and leaves that holder out).
                self.locations.forget(key);
                None
            }
            Ok(KeyedGet::Hit { size, .. }) => {
                if cached {
                    self.hint(key);
                }
                self.locations.insert(key, &node, &endpoint, now);
                StatCounters::add(&self.stats.keyed_gets, 1);
                Some(Ok(size))
            }
            Ok(KeyedGet::TooSmall(size)) => Some(Err(KeyError::BufferTooSmall { needed: size, got: buf.len as u64 })),
            Ok(other) => {
                if other == KeyedGet::Lapsed {
                    StatCounters::add(&self.stats.lease_lapses, 1);
                }
                tracing::trace!(key, node = %node, answer = ?other, "keyed get fell back to the routed path");
                self.locations.forget(key);
                None
            }
            Err(e) => {
                tracing::debug!(key, node = %node, error = %e, "keyed get failed; taking the routed path");
                self.forget_holder(&node, &endpoint);
                None
            }
        }
    }

    /// A single-key put over one route call and one keyed exchange, for a client that lends no
    /// medium; `None`: take the routed path.
    pub(super) async fn put_fast(&self, key: &str, value: CallerBuf) -> Option<Result<PutOutcome, KeyError>> {
        if !self.config.keyed_requests
            || self.medium.is_some()
            || key.is_empty()
            || value.len == 0
            || self.in_device_registration(value)
        {
            return None;
        }
        let routed = self
            .master
            .batch_route_put(&[key.to_owned()], &[value.len as u64], &self.recently_unreachable())
            .instrument(phase!(phases::PUT_ROUTE))
            .await;
        let (node, tier, endpoint) = match routed.map(|mut d| d.pop()) {
            Ok(Some(RoutePutDecision::Routed { node_id, tier, data_endpoint, .. })) if !data_endpoint.is_empty() => {
                (node_id, tier, data_endpoint)
            }
            Ok(Some(RoutePutDecision::AlreadyExists)) => return Some(Ok(PutOutcome::AlreadyPresent)),
            // No room (the routed path makes room), no data endpoint, or no answer: routed path.
            Ok(_) | Err(_) => return None,
        };
        let keyed = Arc::clone(&self.keyed);
        let crc32c = self.value_checksum(value);
        // A large value for a holder on this host is copied into the slot through the client's
        // mapping (`KeyedClient::put_shared`); off with the shared path.
        let shared = self.config.shared_memory;
        let put = phase!(phases::PUT_KEYED).in_scope(|| {
            blocking(|| {
                // SAFETY: `value` is a caller buffer of this call (a slice it borrows, or a raw
                // range its contract keeps valid and unwritten until the call returns), host memory
                // (checked above); only read, until this blocking call returns.
                let bytes = unsafe { std::slice::from_raw_parts(value.ptr.as_ptr().cast_const(), value.len) };
                if shared {
                    keyed.put_shared(&endpoint, key, u64::from(tier.wire()), bytes, crc32c)
                } else {
                    keyed.put(&endpoint, key, u64::from(tier.wire()), bytes, crc32c)
                }
            })
        });
        match put {
            Ok(KeyedPut::Written) => {
                self.locations.insert(key, &node, &endpoint, self.clock.now());
                StatCounters::add(&self.stats.keyed_puts, 1);
                Some(Ok(PutOutcome::Written))
            }
            Ok(KeyedPut::Exists) => Some(Ok(PutOutcome::AlreadyPresent)),
            Ok(other) => {
                tracing::trace!(key, node = %node, answer = ?other, "keyed put fell back to the routed path");
                None
            }
            Err(e) => {
                tracing::debug!(key, node = %node, error = %e, "keyed put failed; taking the routed path");
                self.forget_holder(&node, &endpoint);
                None
            }
        }
    }

    /// Queues `key` as read, for the master's LRU; one batch leaves at most every [`HINT_EVERY`].
    fn hint(&self, key: &str) {
        self.hint_all(std::iter::once(key.to_owned()));
    }

    /// Queues `keys` as read here without a route call (cache hits of the keyed path, local hits of
    /// the routed one), so the master's LRU eviction still sees them as recently used. One batch
    /// leaves at most every [`HINT_EVERY`], in the background; keys beyond [`HINTS_CAP`] waiting are
    /// dropped (they are hints).
    pub(super) fn hint_all(&self, keys: impl IntoIterator<Item = String>) {
        {
            let mut waiting = self.hints.keys.lock();
            let room = HINTS_CAP.saturating_sub(waiting.len());
            waiting.extend(keys.into_iter().take(room));
            if waiting.is_empty() {
                return;
            }
        }
        if self.hints.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.hints.scheduled.store(false, Ordering::Release);
            return;
        };
        let hints = Arc::clone(&self.hints);
        let master = Arc::clone(&self.master);
        runtime.spawn(async move {
            tokio::time::sleep(HINT_EVERY).await;
            hints.scheduled.store(false, Ordering::Release);
            let keys = std::mem::take(&mut *hints.keys.lock());
            if keys.is_empty() {
                return;
            }
            if let Err(e) = master.batch_route_get(&keys, &[]).await {
                tracing::debug!(error = %e, keys = keys.len(), "access hints did not reach the master");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(node: &str, endpoint: &str) -> (Arc<str>, Arc<str>) {
        (node.into(), endpoint.into())
    }

    #[test]
    fn a_batch_of_locations_is_recorded_refreshed_and_moved() {
        let cache = Locations::default();
        let t0 = Instant::now();
        let (a, a_at) = names("node-a", "127.0.0.1:1");
        let (b, b_at) = names("node-b", "127.0.0.1:2");
        cache.insert("k1", "node-a", "127.0.0.1:1", t0);
        cache.insert_many([("k1", &a, &a_at), ("k2", &a, &a_at)], t0 + Duration::from_secs(20));
        // k1 was refreshed in place: live past its first insert's TTL.
        let later = t0 + LOCATION_TTL + Duration::from_secs(5);
        let got = cache.get_many_refreshed(&["k1", "k2", "k3"], later);
        assert_eq!(got.iter().map(Option::is_some).collect::<Vec<_>>(), [true, true, false]);
        let (node, endpoint) = got[1].clone().expect("k2 cached");
        assert!(Arc::ptr_eq(&node, &a) && Arc::ptr_eq(&endpoint, &a_at), "the batch's names are shared, not copied");
        // A key written elsewhere moves.
        cache.insert_many([("k2", &b, &b_at)], later);
        let (node, endpoint) = cache.get("k2", later).expect("k2 cached");
        assert_eq!((&*node, &*endpoint), ("node-b", "127.0.0.1:2"));
        // Past the TTL of the last record, nothing is trusted.
        assert!(cache.get_many_refreshed(&["k1", "k2"], later + LOCATION_TTL).iter().all(Option::is_none));
    }

    #[test]
    fn a_batch_lookup_refreshes_what_it_finds() {
        let cache = Locations::default();
        let t0 = Instant::now();
        cache.insert("k1", "node-a", "127.0.0.1:1", t0);
        cache.insert("k2", "node-a", "127.0.0.1:1", t0);
        let looked = t0 + LOCATION_TTL / 2;
        assert!(cache.get_many_refreshed(&["k1"], looked)[0].is_some());
        // Past the first TTL: k1 lives on from its lookup, k2 (not looked up) has expired.
        let later = t0 + LOCATION_TTL + Duration::from_secs(1);
        assert!(cache.get("k1", later).is_some(), "refreshed by the lookup");
        assert!(cache.get("k2", later).is_none(), "not looked up: expired");
        // An expired location is not revived by a lookup.
        assert!(cache.get_many_refreshed(&["k2"], later)[0].is_none());
        assert!(cache.get("k2", later).is_none());
    }

    #[test]
    fn a_full_cache_drops_its_expired_locations_for_a_batch() {
        let cache = Locations::default();
        let t0 = Instant::now();
        let (a, a_at) = names("node-a", "127.0.0.1:1");
        let old: Vec<String> = (0..LOCATION_CAP).map(|i| format!("old-{i}")).collect();
        cache.insert_many(old.iter().map(|k| (k.as_str(), &a, &a_at)), t0);
        assert_eq!(cache.map.lock().len(), LOCATION_CAP);
        let later = t0 + LOCATION_TTL + Duration::from_secs(1);
        cache.insert_many([("new", &a, &a_at)], later);
        assert_eq!(cache.map.lock().len(), 1, "only the new key is left");
        assert!(cache.get("new", later).is_some());
    }
}
