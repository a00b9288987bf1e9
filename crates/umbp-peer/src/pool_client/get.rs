//! The get path, per pipelined chunk: route → resolve on every holder concurrently, right before the one submit → wait
//! → keep only copies that finished inside the read lease, re-reading the rest.
//!
//! A resolve takes a read lease on the holder (`read_lease`, 500 ms by default) that protects the
//! pages from eviction while the copy runs. The wire carries no lease length, so the client uses its
//! own `read_lease` setting (nodes of one cluster share it) and measures from the instant *before*
//! the resolve RPC was sent (earlier than the holder's clock starts: conservative). A copy that ends
//! after that deadline may have read pages already reused by another key: it is discarded
//! ([`KeyError::LeaseExpired`] once re-reads are exhausted), never returned as a hit.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::support::{chunk_by_bytes, join_all, medium_call, pipelined};
use super::*;
use crate::peer_service::decode_batch_resolve;
use umbp_core::PageLocation;

/// Where a found key lives: size, pages, the holder's buffer refs by index, page size.
type Located = (u64, Vec<PageLocation>, Vec<Option<TransferRef>>, u64);

/// What reading one chunk produced.
struct ChunkRead {
    /// One result per key of the chunk.
    results: Vec<Result<u64, KeyError>>,
    /// Positions fetched from another node (re-cache candidates).
    fetched_remote: Vec<usize>,
    /// Keys found on this node's medium (the master hears of them in one hint per batch).
    local_hits: Vec<String>,
}

/// One key's planned read.
struct Planned {
    index: usize,
    size: u64,
    node: String,
    lease_end: Instant,
}

impl PoolClient {
    /// Reads `key` into `buf`; returns the value's size.
    pub async fn get(&self, key: &str, buf: &mut [u8]) -> Result<u64, KeyError> {
        let mut bufs = [buf];
        self.batch_get(&[key], &mut bufs).await.pop().unwrap_or(Err(KeyError::Failed("empty result".into())))
    }

    /// Reads every key into its buffer; one result per key (the value's size), in order. A buffer
    /// shorter than the value is an error for that key; a longer one is filled up to the size. A key
    /// without a buffer (fewer buffers than keys) gets [`KeyError::NoBuffer`]. On an error the
    /// buffer's contents are unspecified.
    pub async fn batch_get(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<Result<u64, KeyError>> {
        // The caller's buffers, borrowed for this call (every transfer is waited for).
        let targets: Vec<CallerBuf> = bufs.iter_mut().map(|b| CallerBuf::of_mut(b)).collect();
        self.get_bufs(keys, &targets).await
    }

    /// [`batch_get`](Self::batch_get) into raw ranges `(ptr, len)`: the way to get into memory no
    /// Rust slice may cover, such as device buffers registered with
    /// [`register_memory_at`](Self::register_memory_at). The client never dereferences a range
    /// inside a device registration (a fetched value is re-cached locally only from host memory);
    /// only the transfer engine that registered the memory copies into it.
    ///
    /// # Safety
    /// Each `len` bytes at `ptr` lie inside one region registered with this client
    /// ([`register_memory`](Self::register_memory) or [`register_memory_at`](Self::register_memory_at),
    /// at its true location), or are valid host memory; they stay valid, and are neither read nor
    /// written by anyone else, until the returned future completes or is dropped; no two ranges
    /// overlap; and a registration is not undone before then.
    pub async unsafe fn batch_get_raw(
        &self,
        keys: &[&str],
        bufs: &[(NonNull<u8>, usize)],
    ) -> Vec<Result<u64, KeyError>> {
        let targets: Vec<CallerBuf> = bufs.iter().map(|(ptr, len)| CallerBuf { ptr: *ptr, len: *len }).collect();
        self.get_bufs(keys, &targets).await
    }

    /// The get path over caller buffers (slices or raw ranges).
    async fn get_bufs(&self, keys: &[&str], targets: &[CallerBuf]) -> Vec<Result<u64, KeyError>> {
        let bufs = targets;
        let gate = self.gate.read().await;
        if *gate {
            return vec![Err(KeyError::Closed); keys.len()];
        }
        let n = keys.len();
        let mut results: Vec<Option<Result<u64, KeyError>>> = vec![None; n];
        for (i, k) in keys.iter().enumerate() {
            if k.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if i >= bufs.len() {
                results[i] = Some(Err(KeyError::NoBuffer));
            }
        }
        let valid: Vec<usize> = (0..n).filter(|i| results[*i].is_none()).collect();
        // Chunks run as a pipeline: one chunk's route and resolve overlap another's transfer. A
        // buffer's length stands for its value's size.
        let chunks = chunk_by_bytes(valid, |i| targets[i].len as u64);
        let outcomes = pipelined(&chunks, |chunk| {
            let chunk_keys: Vec<&str> = chunk.iter().map(|i| keys[*i]).collect();
            let chunk_targets: Vec<CallerBuf> = chunk.iter().map(|i| targets[*i]).collect();
            async move { self.get_chunk(&chunk_keys, &chunk_targets).await }
        })
        .await;
        let mut fetched_remote: Vec<usize> = Vec::new();
        let mut local_hits: Vec<String> = Vec::new();
        for (chunk, outcome) in chunks.iter().zip(outcomes) {
            for (i, r) in chunk.iter().zip(outcome.results) {
                results[*i] = Some(r);
            }
            fetched_remote.extend(outcome.fetched_remote.into_iter().map(|j| chunk[j]));
            local_hits.extend(outcome.local_hits);
        }
        // One access hint for the whole batch's local hits.
        self.touch(local_hits);
        self.queue_recache(keys, targets, &results, &fetched_remote);
        results.into_iter().map(|r| r.unwrap_or(Err(KeyError::Miss))).collect()
    }

    /// Reads one chunk: `keys[j]` into `targets[j]`, with bounded re-routes.
    async fn get_chunk(&self, keys: &[&str], targets: &[CallerBuf]) -> ChunkRead {
        let n = keys.len();
        let mut results: Vec<Option<Result<u64, KeyError>>> = vec![None; n];
        let mut exclude: Vec<BTreeSet<String>> = vec![BTreeSet::new(); n];
        let mut last_error: HashMap<usize, KeyError> = HashMap::new();
        let mut fetched_remote: Vec<usize> = Vec::new();
        let me = self.config.node_id.clone();
        // Local first: what this node holds is read without asking the master (a route call per
        // chunk saved). Misses, and every key on a node without a medium, are routed below, with
        // this node excluded. Their copies join the first round's submit.
        let mut carried: (Vec<TransferItem>, Vec<Planned>) = (Vec::new(), Vec::new());
        let mut read_locally = vec![false; n];
        let mut local_hits = Vec::new();
        if let Some(m) = &self.medium {
            let all: Vec<(usize, bool)> = (0..n).map(|i| (i, true)).collect();
            let found = self.read_here(m, keys, targets, &all, &mut carried.0, &mut carried.1, &mut results).await;
            for (i, found) in found.into_iter().enumerate() {
                exclude[i].insert(me.clone());
                read_locally[i] = found;
                if found {
                    local_hits.push(keys[i].to_owned());
                }
            }
        }
        for attempt in 0..=self.config.max_reroutes {
            let pending: Vec<usize> =
                (0..n).filter(|i| results[*i].is_none() && !(attempt == 0 && read_locally[*i])).collect();
            let (mut transfers, mut planned) = std::mem::take(&mut carried);
            if pending.is_empty() && planned.is_empty() {
                break;
            }
            if attempt > 0 {
                StatCounters::add(&self.stats.reroutes, pending.len() as u64);
            }
            // Route, one call per distinct exclude set, concurrently.
            let unreachable = self.recently_unreachable();
            let mut by_set: BTreeMap<Vec<String>, Vec<usize>> = BTreeMap::new();
            for i in &pending {
                let mut set = exclude[*i].clone();
                set.extend(unreachable.iter().cloned());
                by_set.entry(set.into_iter().collect()).or_default().push(*i);
            }
            let sets: Vec<(Vec<String>, Vec<usize>)> = by_set.into_iter().collect();
            let calls = sets
                .iter()
                .map(|(set, indexes)| async move {
                    let route_keys: Vec<String> = indexes.iter().map(|i| keys[*i].to_owned()).collect();
                    self.master.batch_route_get(&route_keys, set).await
                })
                .collect();
            // (local, routed here) and remote groups.
            let mut local: Vec<(usize, bool)> = Vec::new();
            let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
            for ((_, indexes), hits) in sets.iter().zip(join_all(calls).await) {
                let hits = match hits {
                    Ok(h) => h,
                    Err(e) => {
                        for i in indexes {
                            results[*i] = Some(Err(KeyError::Routing(e.to_string())));
                        }
                        continue;
                    }
                };
                for (i, hit) in indexes.iter().zip(hits) {
                    match hit {
                        // Not indexed (yet): the key may have been written here before the master
                        // heard. Without a medium, or once tried here, it is a miss at once.
                        None if self.medium.is_none() || exclude[*i].contains(&me) => {
                            results[*i] = Some(Err(last_error.remove(i).unwrap_or(KeyError::Miss)))
                        }
                        None => local.push((*i, false)),
                        Some(h) if h.node_id == me => local.push((*i, true)),
                        Some(h) => groups.entry((h.node_id, h.peer_address)).or_default().push(*i),
                    }
                }
            }
            // Resolve on every holder concurrently, right before the submit.
            let groups: Vec<((String, String), Vec<usize>)> = groups.into_iter().collect();
            let resolves = join_all(
                groups.iter().map(|((node, peer), indexes)| self.resolve_remote(keys, indexes, node, peer)).collect(),
            )
            .await;
            for (((node, _), indexes), (start, found)) in groups.iter().zip(resolves) {
                let found = match found {
                    Ok(f) => f,
                    Err(e) => {
                        for i in indexes {
                            exclude[*i].insert(node.clone());
                            last_error.insert(*i, e.clone());
                        }
                        continue;
                    }
                };
                let lease_end = start + self.config.read_lease;
                for (i, f) in indexes.iter().zip(found) {
                    match f {
                        None => {
                            // A stale route: re-route without this node.
                            exclude[*i].insert(node.clone());
                            last_error.insert(*i, KeyError::Miss);
                        }
                        Some((size, pages, refs, page_size)) => {
                            let plan = Planned { index: *i, size, node: node.clone(), lease_end };
                            self.plan_get(
                                plan,
                                &pages,
                                &refs,
                                page_size,
                                targets[*i],
                                &mut transfers,
                                &mut planned,
                                &mut results,
                            );
                        }
                    }
                }
            }
            // This node's part, in the gap before the submit.
            if let Some(m) = &self.medium
                && !local.is_empty()
            {
                let found = self.read_here(m, keys, targets, &local, &mut transfers, &mut planned, &mut results).await;
                for ((i, routed_here), found) in local.iter().zip(found) {
                    exclude[*i].insert(me.clone());
                    if found {
                        continue;
                    }
                    if *routed_here {
                        // The master's index is stale: try another replica.
                        last_error.insert(*i, KeyError::Miss);
                    } else {
                        // No route and no local copy: a miss at once.
                        results[*i] = Some(Err(KeyError::Miss));
                    }
                }
            }
            let failed = self.run_transfers(transfers).await;
            let ended = Instant::now();
            for p in planned {
                if let Some((kind, message)) = failed.get(&(p.index as u64)) {
                    last_error.insert(
                        p.index,
                        KeyError::Transfer { node: p.node.clone(), kind: *kind, message: message.clone() },
                    );
                    exclude[p.index].insert(p.node.clone());
                    if p.node != me {
                        self.forget_peer(&p.node);
                    }
                } else if ended > p.lease_end {
                    // The pages may have been evicted and reused under the copy: read again.
                    StatCounters::add(&self.stats.lease_lapses, 1);
                    exclude[p.index].remove(&p.node);
                    last_error.insert(p.index, KeyError::LeaseExpired { node: p.node });
                } else {
                    results[p.index] = Some(Ok(p.size));
                    if p.node != me {
                        fetched_remote.push(p.index);
                    }
                }
            }
        }
        let results = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(last_error.remove(&i).unwrap_or(KeyError::Miss))))
            .collect();
        ChunkRead { results, fetched_remote, local_hits }
    }

    /// Resolves `local` (index, whether the master routed it here) on this node's medium and plans
    /// the copies of the keys found, each under the medium's read lease. Returns, per entry, whether
    /// the key was found.
    #[expect(clippy::too_many_arguments, reason = "the chunk's keys and the round's accumulators")]
    async fn read_here(
        &self,
        m: &Arc<dyn MediumBackend>,
        keys: &[&str],
        targets: &[CallerBuf],
        local: &[(usize, bool)],
        transfers: &mut Vec<TransferItem>,
        planned: &mut Vec<Planned>,
        results: &mut [Option<Result<u64, KeyError>>],
    ) -> Vec<bool> {
        let local_keys: Vec<String> = local.iter().map(|(i, _)| keys[*i].to_owned()).collect();
        let start = Instant::now();
        // A panicked resolve reads nothing here: every key is then routed elsewhere.
        let (resolved, refs) = medium_call(m, self.medium_drive_io, move |m| {
            let refs: Vec<Option<TransferRef>> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
            (m.batch_resolve(&local_keys, false), refs)
        })
        .await
        .unwrap_or_default();
        let mut found = vec![false; local.len()];
        for ((f, (i, _)), r) in found.iter_mut().zip(local).zip(resolved) {
            if r.found {
                *f = true;
                let plan = Planned {
                    index: *i,
                    size: r.size,
                    node: self.config.node_id.clone(),
                    lease_end: start + self.config.read_lease,
                };
                self.plan_get(plan, &r.pages, &refs, r.page_size, targets[*i], transfers, planned, results);
            }
        }
        found
    }

    /// Tells the master, in the background, that `keys` were just read here, so its LRU eviction
    /// sees them as recently used (a local hit skips the route call that would have stamped them).
    /// A hint: dropped when [`TOUCHES_IN_FLIGHT`] hints are already in flight.
    fn touch(&self, keys: Vec<String>) {
        if keys.is_empty() {
            return;
        }
        let Ok(permit) = Arc::clone(&self.touches).try_acquire_owned() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let master = Arc::clone(&self.master);
        runtime.spawn(async move {
            let _permit = permit;
            if let Err(e) = master.batch_route_get(&keys, &[]).await {
                tracing::debug!(error = %e, "access hint for local hits did not reach the master");
            }
        });
    }

    #[expect(clippy::too_many_arguments, reason = "one key's read plan and the round's accumulators")]
    fn plan_get(
        &self,
        plan: Planned,
        pages: &[PageLocation],
        refs: &[Option<TransferRef>],
        page_size: u64,
        target: CallerBuf,
        transfers: &mut Vec<TransferItem>,
        planned: &mut Vec<Planned>,
        results: &mut [Option<Result<u64, KeyError>>],
    ) {
        let (i, size) = (plan.index, plan.size);
        if (target.len as u64) < size {
            results[i] = Some(Err(KeyError::BufferTooSmall { needed: size, got: target.len as u64 }));
            return;
        }
        let (dst, dst_base) = self.caller_ref(CallerBuf { ptr: target.ptr, len: size as usize });
        match page_items(&dst, dst_base, size, pages, refs, page_size, i as u64, false) {
            Ok(items) => {
                transfers.extend(items);
                planned.push(plan);
            }
            Err(e) => results[i] = Some(Err(KeyError::Failed(format!("malformed pages from {}: {e}", plan.node)))),
        }
    }

    /// Resolves `indexes` on `node`: the instant just before the resolve was sent (the lease's
    /// conservative start) and one entry per key.
    async fn resolve_remote(
        &self,
        keys: &[&str],
        indexes: &[usize],
        node: &str,
        peer: &str,
    ) -> (Instant, Result<Vec<Option<Located>>, KeyError>) {
        let mut client = match self.peer(node, peer).await {
            Ok(c) => c,
            Err(e) => return (Instant::now(), Err(e)),
        };
        let bad = |message: String| KeyError::Unreachable { node: node.to_owned(), message };
        let omit_descs = self.directory.has_remote_buffers(node);
        let request =
            pb::BatchResolveKeysRequest { keys: indexes.iter().map(|i| keys[*i].to_owned()).collect(), omit_descs };
        let start = Instant::now();
        let reply = match client.batch_resolve_keys(self.request(request)).await {
            Ok(r) => r.into_inner(),
            Err(e) => {
                self.mark_unreachable(node);
                return (start, Err(bad(format!("resolve: {}", e.message()))));
            }
        };
        let decoded = match decode_batch_resolve(&reply) {
            Ok(d) => d,
            Err(e) => return (start, Err(bad(format!("malformed resolve reply: {e}")))),
        };
        if decoded.keys.len() != indexes.len() {
            return (start, Err(bad(format!("answered {} of {} keys", decoded.keys.len(), indexes.len()))));
        }
        self.directory.replace_remote_buffers(node, &decoded.descs);
        let mut shelves: HashMap<u32, Vec<Option<TransferRef>>> = HashMap::new();
        let found = decoded
            .keys
            .into_iter()
            .map(|k| {
                k.map(|k| {
                    let refs = shelves
                        .entry(k.backend_id)
                        .or_insert_with(|| self.directory.remote_buffer_snapshot(node, k.backend_id))
                        .clone();
                    (k.size, k.pages, refs, decoded.page_size)
                })
            })
            .collect();
        (start, Ok(found))
    }

    /// Queues remotely fetched values for the local medium when the admission policy allows; a full
    /// queue drops the job (counted). Never blocks the caller beyond one copy of the admitted bytes.
    /// A buffer inside a device (non-host) registration is skipped: the CPU cannot read it.
    fn queue_recache(
        &self,
        keys: &[&str],
        bufs: &[CallerBuf],
        results: &[Option<Result<u64, KeyError>>],
        fetched: &[usize],
    ) {
        let tx = self.recache_tx.lock().clone();
        let Some(tx) = tx else { return };
        let admit = |size: u64| match self.config.recache {
            RecachePolicy::Off => false,
            RecachePolicy::UpTo(cap) => size <= cap,
            RecachePolicy::Always => true,
        };
        for i in fetched {
            let Some(Some(Ok(size))) = results.get(*i) else { continue };
            let Some(buf) = bufs.get(*i).filter(|b| *size as usize <= b.len) else { continue };
            if !admit(*size) || self.in_device_registration(*buf) {
                continue;
            }
            let Ok(permit) = tx.try_reserve() else {
                StatCounters::add(&self.stats.recache_dropped, 1);
                continue;
            };
            // SAFETY: `buf` is a caller buffer of this call (a slice it borrows, or a raw range its
            // contract keeps valid until the call returns) that is not device memory registered
            // with this client, so host memory; the value's `size <= len` bytes were just written
            // by the finished transfer, and nothing else writes them during the call.
            let bytes = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr(), *size as usize) }.to_vec();
            permit.send(RecacheJob { key: keys[*i].to_owned(), bytes });
            StatCounters::add(&self.stats.recache_queued, 1);
        }
    }
}
