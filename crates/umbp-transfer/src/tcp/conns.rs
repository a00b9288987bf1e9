//! The data server's table of authenticated connections: their places under the caps, and which
//! one is idle longest when a newcomer needs a place.
//!
//! Each connection publishes its activity in one atomic word ([`Activity`]): busy (a request is
//! being read or handled), idle since an instant, or evicted. The gate evicts by swapping an idle
//! word for *evicted* (so a connection that just became busy is never taken) and shutting the
//! socket down; the connection's thread sees the word, or the end of stream, and ends. A request
//! that was in flight to an evicted connection is lost with it; clients resend such requests once
//! on a fresh connection (see the client's retry), so an eviction costs a reconnect, not a failure.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use super::server::{Shared, bump};
use crate::warn::warn_limited;

/// The activity word of a busy connection.
const BUSY: u64 = 0;
/// …of an evicted one. Any other value is idle: `IDLE_BASE +` nanoseconds from the server's epoch.
const EVICTED: u64 = 1;
const IDLE_BASE: u64 = 2;

/// One authenticated connection's activity, shared by its thread and the gate.
#[derive(Debug)]
pub(crate) struct Activity {
    word: AtomicU64,
    epoch: Instant,
}

/// The connection was evicted to make room for another.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Evicted;

impl Activity {
    /// A connection idle from now on (authenticated, no request yet).
    fn new(epoch: Instant) -> Self {
        let a = Self { word: AtomicU64::new(BUSY), epoch };
        a.word.store(a.idle_now(), Ordering::SeqCst);
        a
    }

    fn idle_now(&self) -> u64 {
        let nanos = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX - IDLE_BASE);
        nanos.saturating_add(IDLE_BASE)
    }

    /// About to wait for the next request: evictable from now (idle since the last request ended,
    /// or since the handshake when there was none).
    pub(crate) fn idle(&self) -> Result<(), Evicted> {
        let now = self.idle_now();
        self.word
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| match w {
                EVICTED => None,
                BUSY => Some(now),
                since => Some(since),
            })
            .map(drop)
            .map_err(|_| Evicted)
    }

    /// Request bytes arrived: not evictable until [`idle`](Self::idle) again.
    pub(crate) fn busy(&self) -> Result<(), Evicted> {
        self.word
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| (w != EVICTED).then_some(BUSY))
            .map(drop)
            .map_err(|_| Evicted)
    }

    pub(crate) fn is_evicted(&self) -> bool {
        self.word.load(Ordering::SeqCst) == EVICTED
    }
}

#[derive(Debug)]
struct ConnRecord {
    /// A clone of the socket, to shut it down on eviction and server shutdown.
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
    ip: IpAddr,
    activity: Arc<Activity>,
    /// Whether it holds a place under the caps (false once evicted: its place went to another).
    counted: bool,
}

/// The authenticated connections, and the places they hold.
#[derive(Debug, Default)]
pub(crate) struct Conns {
    map: HashMap<u64, ConnRecord>,
    next_id: u64,
    /// Places held, in total and per source address.
    serving: usize,
    per_ip: HashMap<IpAddr, usize>,
}

impl Conns {
    /// Connections open now (including evicted ones whose thread has not ended yet).
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// A place for a newly authenticated connection from `ip` (`stream`: a clone of its socket),
    /// closing the connection idle longest (of `ip` at the per-peer cap, of anyone at the total
    /// cap) if a cap is reached; `None` when every candidate is busy. Returns the connection's id
    /// and its activity word.
    pub(crate) fn admit(&mut self, shared: &Shared, ip: IpAddr, stream: TcpStream) -> Option<(u64, Arc<Activity>)> {
        let config = &shared.config;
        if self.per_ip.get(&ip).copied().unwrap_or(0) >= config.max_connections_per_peer.max(1)
            && !self.evict_idlest(shared, Some(ip), "connection cap per peer")
        {
            return None;
        }
        if self.serving >= config.max_connections.max(1) && !self.evict_idlest(shared, None, "connection cap") {
            return None;
        }
        self.serving += 1;
        *self.per_ip.entry(ip).or_default() += 1;
        self.next_id += 1;
        let id = self.next_id;
        let activity = Arc::new(Activity::new(shared.epoch));
        self.map.insert(id, ConnRecord { stream, thread: None, ip, activity: Arc::clone(&activity), counted: true });
        Some((id, activity))
    }

    /// Records the thread serving `id` (joined on shutdown).
    pub(crate) fn set_thread(&mut self, id: u64, thread: JoinHandle<()>) {
        if let Some(rec) = self.map.get_mut(&id) {
            rec.thread = Some(thread);
        }
        // Else the thread already ended (and removed its record): it is left detached, finished.
    }

    /// Forgets connection `id` (its thread ended, or it never started), giving its place back.
    pub(crate) fn remove(&mut self, id: u64) {
        if let Some(rec) = self.map.remove(&id)
            && rec.counted
        {
            self.release(rec.ip);
        }
    }

    fn release(&mut self, ip: IpAddr) {
        self.serving = self.serving.saturating_sub(1);
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    /// Evicts the counted connection idle longest (from `ip`, if given); false when none is idle.
    /// `why` goes into the warning.
    pub(crate) fn evict_idlest(&mut self, shared: &Shared, ip: Option<IpAddr>, why: &'static str) -> bool {
        // A candidate may turn busy between the scan and the swap: then scan again (bounded).
        for _ in 0..self.map.len().max(1) {
            let idlest = self
                .map
                .iter()
                .filter(|(_, r)| r.counted && ip.is_none_or(|ip| r.ip == ip))
                .filter_map(|(id, r)| {
                    let w = r.activity.word.load(Ordering::SeqCst);
                    (w >= IDLE_BASE).then_some((w, *id))
                })
                .min();
            let Some((word, id)) = idlest else { return false };
            let Some(rec) = self.map.get_mut(&id) else { return false };
            if rec.activity.word.compare_exchange(word, EVICTED, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                continue;
            }
            rec.counted = false;
            let _ = rec.stream.shutdown(Shutdown::Both);
            let (victim_ip, idle_for) = (rec.ip, shared.epoch.elapsed().saturating_sub(nanos(word - IDLE_BASE)));
            self.release(victim_ip);
            bump(&shared.metrics.idle_evicted);
            warn_limited!(shared.warns, "idle_evicted", peer = %victim_ip, idle_ms = idle_for.as_millis(), why,
                "tcp data server: closed the connection idle longest to make room");
            return true;
        }
        false
    }

    /// Shuts every connection down and hands out their threads (server shutdown).
    pub(crate) fn drain(&mut self) -> Vec<(TcpStream, Option<JoinHandle<()>>)> {
        self.serving = 0;
        self.per_ip.clear();
        self.map.drain().map(|(_, r)| (r.stream, r.thread)).collect()
    }
}

fn nanos(n: u64) -> std::time::Duration {
    std::time::Duration::from_nanos(n)
}
