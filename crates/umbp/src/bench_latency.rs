//! The single-call probes of `umbp bench`: the p50 / p99 latency of single 64 KiB remote gets and
//! puts on both client paths (keyed and routed) and of single 1 MiB same-host gets and puts through
//! shared memory beside TCP, each pair measured in alternating blocks (`probe_pair`).

use std::fmt;
use std::time::Instant;

use umbp_peer::pool_client::{PoolClient, PutOutcome};

use crate::bench::{BenchError, LATENCY_BLOCKS, LATENCY_LARGE_VALUE, LATENCY_VALUE, WARM_UP, until_indexed};
use crate::units::human_size;

/// Single-call latency percentiles, microseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Latency {
    /// Calls timed.
    pub calls: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

impl Latency {
    /// The percentiles of `samples` (µs, any order; at least one).
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        let calls = samples.len();
        Self { calls, p50_us: samples[calls / 2], p99_us: samples[(calls * 99 / 100).min(calls - 1)] }
    }

    pub(crate) fn to_json(&self) -> String {
        self.to_json_of(LATENCY_VALUE)
    }

    pub(crate) fn to_json_of(&self, value_bytes: usize) -> String {
        format!(
            "{{\"value_bytes\":{value_bytes},\"calls\":{},\"p50_us\":{:.1},\"p99_us\":{:.1}}}",
            self.calls, self.p50_us, self.p99_us
        )
    }
}

/// The single 64 KiB remote get and put on both client paths, measured in alternating blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Latencies {
    /// Gets of the default client: the keyed path (one exchange with the holder's data server).
    pub get: Latency,
    /// Gets of a client with `keyed_requests = false`: route, resolve RPC, TCP read, release.
    pub get_routed: Latency,
    /// Puts of distinct keys, each written, by the default client: a route and one keyed exchange.
    pub put: Latency,
    /// Puts of distinct keys by the routed client: route, allocate RPC, TCP write, commit RPC.
    pub put_routed: Latency,
    /// Single 1 MiB gets of the default client from the same-host child: the keyed exchange, the
    /// bytes copied from the client's mapping of the holder's memory.
    pub get_large: Latency,
    /// The same gets by a client with `shared_memory = false`: the keyed exchange over TCP.
    pub get_large_tcp: Latency,
    /// Single 1 MiB puts of distinct new keys by the default client: a route and the keyed
    /// exchange, the bytes copied into the holder's slot through the mapping.
    pub put_large: Latency,
    /// The same puts by the client with `shared_memory = false`: the bytes over TCP.
    pub put_large_tcp: Latency,
}

impl fmt::Display for Latencies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = human_size(LATENCY_VALUE as u64);
        let ratio = |keyed: &Latency, routed: &Latency| {
            format!("keyed/routed p50 {:.2}, p99 {:.2}", keyed.p50_us / routed.p50_us, keyed.p99_us / routed.p99_us)
        };
        let line = |l: &Latency| format!("p50 {:.0} µs, p99 {:.0} µs", l.p50_us, l.p99_us);
        writeln!(
            f,
            "single {value} remote get, {} calls per path in {LATENCY_BLOCKS} alternating blocks: keyed (one exchange \
             with the holder) {}; routed (route + resolve + TCP read + release) {}; {}",
            self.get.calls,
            line(&self.get),
            line(&self.get_routed),
            ratio(&self.get, &self.get_routed)
        )?;
        writeln!(
            f,
            "single {value} remote put of a new key, {} calls per path in {LATENCY_BLOCKS} alternating blocks: keyed \
             (route + one exchange) {}; routed (route + allocate + TCP write + commit) {}; {}",
            self.put.calls,
            line(&self.put),
            line(&self.put_routed),
            ratio(&self.put, &self.put_routed)
        )?;
        let large = human_size(LATENCY_LARGE_VALUE as u64);
        let shm_ratio = |shm: &Latency, tcp: &Latency| {
            format!("shared/TCP p50 {:.2}, p99 {:.2}", shm.p50_us / tcp.p50_us, shm.p99_us / tcp.p99_us)
        };
        writeln!(
            f,
            "single {large} same-host get, {} calls per path in {LATENCY_BLOCKS} alternating blocks: shared memory \
             (keyed, copied from the holder's mapping) {}; TCP (keyed, shared_memory = false) {}; {}",
            self.get_large.calls,
            line(&self.get_large),
            line(&self.get_large_tcp),
            shm_ratio(&self.get_large, &self.get_large_tcp)
        )?;
        write!(
            f,
            "single {large} same-host put of a new key, {} calls per path in {LATENCY_BLOCKS} alternating blocks: \
             shared memory (route + keyed, copied into the slot's mapping) {}; TCP (route + keyed, shared_memory = \
             false) {}; {}",
            self.put_large.calls,
            line(&self.put_large),
            line(&self.put_large_tcp),
            shm_ratio(&self.put_large, &self.put_large_tcp)
        )
    }
}

/// The key of the latency probe's value.
pub(crate) const LATENCY_KEY: &str = "bench-latency-key";

/// `calls` split into [`LATENCY_BLOCKS`] consecutive ranges of (nearly) equal length.
pub(crate) fn latency_blocks(calls: usize) -> Vec<std::ops::Range<usize>> {
    let mut start = 0;
    (0..LATENCY_BLOCKS)
        .map(|b| {
            let n = calls / LATENCY_BLOCKS + usize::from(b < calls % LATENCY_BLOCKS);
            start += n;
            start - n..start
        })
        .collect()
}

/// One single-call probe: `clients[0]` stores `key` (a value of `len` bytes), then each client, after
/// [`WARM_UP`] untimed calls of each kind, gets `key` `calls` times and puts `calls` distinct new
/// keys (`bench-latency-put-{prefix}{name}-{i}`, each checked to be written), in [`LATENCY_BLOCKS`]
/// blocks alternating the clients (the first client alternates too, so a change in the machine's
/// load reaches both alike). Returns the gets' and the puts' percentiles per client.
async fn probe_pair(
    clients: [&PoolClient; 2],
    names: [&str; 2],
    key: &str,
    len: usize,
    prefix: &str,
    calls: usize,
) -> Result<([Latency; 2], [Latency; 2]), BenchError> {
    let value: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let size = human_size(len as u64);
    let failed = |what: &str, e: &dyn fmt::Display| BenchError::Failed(format!("{size} latency {what}: {e}"));
    clients[0].put(key, &value).await.map_err(|e| failed("put", &e))?;
    until_indexed(clients[0], &[key.to_owned()]).await?;
    let mut buf = vec![0u8; len];
    let get = async |client: &PoolClient, buf: &mut [u8]| {
        let t = Instant::now();
        client.get(key, buf).await.map_err(|e| failed("get", &e))?;
        Ok::<_, BenchError>(t.elapsed().as_secs_f64() * 1e6)
    };
    let put = async |client: &PoolClient, key: &str| {
        let t = Instant::now();
        let outcome = client.put_outcome(key, &value).await.map_err(|e| failed("put", &e))?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        match outcome {
            PutOutcome::Written => Ok(us),
            PutOutcome::AlreadyPresent => Err(failed("put", &format_args!("{key} was already present"))),
        }
    };
    let put_key = |path: usize, i: usize| format!("bench-latency-put-{prefix}{}-{i}", names[path]);
    for (p, client) in clients.iter().enumerate() {
        for i in 0..WARM_UP {
            get(client, &mut buf).await?;
            put(client, &put_key(p, calls + i)).await?;
        }
    }
    crate::progress::note(format_args!(
        "umbp bench: {calls} single {size} gets and {calls} single {size} puts per path ({}, {}) for the latency \
         percentiles",
        names[0], names[1]
    ));
    let mut gets = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
    for (b, block) in latency_blocks(calls).into_iter().enumerate() {
        for p in [b % 2, (b + 1) % 2] {
            for _ in block.clone() {
                gets[p].push(get(clients[p], &mut buf).await?);
            }
        }
    }
    if buf != value {
        return Err(failed("get", &"other bytes than were put"));
    }
    let mut puts = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
    for (b, block) in latency_blocks(calls).into_iter().enumerate() {
        for p in [b % 2, (b + 1) % 2] {
            for i in block.clone() {
                puts[p].push(put(clients[p], &put_key(p, i)).await?);
            }
        }
    }
    Ok((gets.map(Latency::of), puts.map(Latency::of)))
}

/// The single 64 KiB remote get (of one key, [`LATENCY_KEY`]) and put (of distinct new keys) of
/// `keyed` (the default client) and `routed` (`keyed_requests = false`), `calls` of each per path
/// ([`probe_pair`]); the large fields are left empty for [`measure_large_latency`].
pub(crate) async fn measure_latency(
    keyed: &PoolClient,
    routed: &PoolClient,
    calls: usize,
) -> Result<Latencies, BenchError> {
    let before = keyed.stats();
    let ([get, get_routed], [put, put_routed]) =
        probe_pair([keyed, routed], ["keyed", "routed"], LATENCY_KEY, LATENCY_VALUE, "", calls).await?;
    // Say so when the default client did not take the keyed path every time (a fallback is routed).
    let after = keyed.stats();
    let (keyed_gets, keyed_puts) = (after.keyed_gets - before.keyed_gets, after.keyed_puts - before.keyed_puts);
    let expected = (calls + WARM_UP) as u64;
    if keyed_gets < expected || keyed_puts < expected {
        crate::progress::note(format_args!(
            "umbp bench: warning: only {keyed_gets} of {expected} gets and {keyed_puts} of {expected} puts of the \
             default client took the keyed path"
        ));
    }
    let none = Latency { calls: 0, p50_us: 0.0, p99_us: 0.0 };
    Ok(Latencies {
        get,
        get_routed,
        put,
        put_routed,
        get_large: none.clone(),
        get_large_tcp: none.clone(),
        put_large: none.clone(),
        put_large_tcp: none,
    })
}

/// The key of the 1 MiB latency probe's value.
const LATENCY_LARGE_KEY: &str = "bench-latency-key-1m";

/// The single 1 MiB get and put of `shm` (the default client: shared memory with the same-host
/// child) beside `tcp` (`shared_memory = false`: the keyed exchange over TCP), `calls` of each per
/// path ([`probe_pair`]); fills `out`'s large fields. Fails when the default client's bytes did
/// not go through shared memory, or the other client's did.
pub(crate) async fn measure_large_latency(
    shm: &PoolClient,
    tcp: &PoolClient,
    calls: usize,
    out: &mut Latencies,
) -> Result<(), BenchError> {
    const SHM: &str = "SharedMemoryEngine";
    let before = shm.transferred_bytes(SHM);
    let ([get, get_tcp], [put, put_tcp]) =
        probe_pair([shm, tcp], ["shm", "tcp"], LATENCY_LARGE_KEY, LATENCY_LARGE_VALUE, "1m-", calls).await?;
    // The store, the warm-ups and every timed call (keyed copies count as shared-memory bytes).
    let through_shm = shm.transferred_bytes(SHM) - before;
    let expected = ((2 * (calls + WARM_UP) + 1) * LATENCY_LARGE_VALUE) as u64;
    if through_shm < expected || tcp.transferred_bytes(SHM) != 0 {
        return Err(BenchError::Failed(format!(
            "the 1 MiB single calls did not take their paths: {through_shm} of {expected} bytes of the default \
             client through shared memory, {} of the TCP client",
            tcp.transferred_bytes(SHM)
        )));
    }
    (out.get_large, out.get_large_tcp, out.put_large, out.put_large_tcp) = (get, get_tcp, put, put_tcp);
    Ok(())
}
