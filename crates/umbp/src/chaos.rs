//! `umbp chaos-client` (hidden from `--help`): one long-lived client process of the chaos test
//! (`crates/umbp/tests/chaos.rs`), and the value and log formats its checker reads.
//!
//! The client puts fresh keys and gets its own and other clients' keys for a fixed time, and
//! appends one line per operation to its log. Each value describes itself — a magic, its length,
//! its key, a payload drawn from the key, and a 64-bit hash of all of it — so a get that returns
//! another key's bytes, a torn value or a stale length is caught where it happens, whatever the
//! faults around it. Keys are written once each (`chaos-c{client}-{seq}`), so "the bytes put under
//! that key" is one value.
//!
//! The pool does not say which node took a put, so the client asks the master: a few hundred
//! milliseconds after each acknowledged put, and again until it is indexed (at most
//! [`LOCATE_FOR`]), it route-gets the key and logs the node that holds it (`loc`). That is how the
//! checker knows which puts an SSD node acknowledged.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig, PutOutcome};

use crate::units::parse_duration;

/// The first bytes of every chaos value.
pub const MAGIC: [u8; 4] = *b"UMBC";
/// Magic, total length (u32), key length (u16).
const HEADER: usize = 10;
/// The trailing hash.
const TRAILER: usize = 8;
/// How long an acknowledged put is route-got until the master indexes it (milliseconds after its
/// commit when the holder ships each event at once; a master restart takes a few seconds).
pub const LOCATE_FOR: Duration = Duration::from_secs(10);
/// How often the pending puts are route-got.
const LOCATE_EVERY: Duration = Duration::from_millis(250);
/// Most keys one route-get of a locate round asks for.
const LOCATE_BATCH: usize = 512;

/// `umbp chaos-client` (hidden): a chaos-test client.
#[derive(Debug, Clone, Args)]
pub struct ChaosClientArgs {
    /// The master (required)
    #[arg(long, value_name = "ADDR")]
    pub master: String,
    /// This client's number: its keys are `chaos-c{ID}-{seq}`
    #[arg(long, value_name = "ID")]
    pub client_id: u32,
    /// How many clients run (gets also read the others' keys)
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub clients: u32,
    /// The seed of this client's choices
    #[arg(long, value_name = "SEED")]
    pub seed: u64,
    /// How long to run
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Duration,
    /// Largest value, in bytes (at least 256)
    #[arg(long, value_name = "BYTES", default_value_t = 48 * 1024)]
    pub max_value: usize,
    /// The append-only operation log
    #[arg(long, value_name = "FILE")]
    pub log: PathBuf,
}

/// The key of a client's `seq`-th put.
pub fn key_name(client: u32, seq: u64) -> String {
    format!("chaos-c{client}-{seq}")
}

/// SplitMix64: small, seedable, good enough to pick operations and fill payloads.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo { lo } else { lo + self.next_u64() % (hi - lo) }
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}

/// FNV-1a over 64 bits, eight bytes a step (the value's trailer).
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h ^ (bytes.len() as u64)
}

/// The shortest value `key` can have.
pub fn min_value_len(key: &str) -> usize {
    HEADER + key.len() + TRAILER
}

/// The value of `key`, `len` bytes long (at least [`min_value_len`]): every put of a key writes the
/// same bytes, and no two keys' values are alike.
pub fn make_value(key: &str, len: usize) -> Vec<u8> {
    let len = len.max(min_value_len(key));
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    v.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
    v.extend_from_slice(key.as_bytes());
    fill_payload(key, &mut v, len - TRAILER);
    let h = hash64(&v);
    v.extend_from_slice(&h.to_le_bytes());
    v
}

fn fill_payload(key: &str, v: &mut Vec<u8>, upto: usize) {
    let mut rng = SplitMix64(hash64(key.as_bytes()));
    while v.len() < upto {
        let word = rng.next_u64().to_le_bytes();
        let n = (upto - v.len()).min(8);
        v.extend_from_slice(&word[..n]);
    }
}

/// Why bytes a get returned are not the value put under its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueFault {
    /// Shorter than any chaos value.
    #[error("{0} bytes: too short for a chaos value")]
    Short(usize),
    /// Not a chaos value at all.
    #[error("no chaos magic")]
    Magic,
    /// The stored length is not what came back.
    #[error("the value says {stored} bytes, the get returned {got}")]
    Length {
        /// What the value says.
        stored: usize,
        /// What the get returned.
        got: usize,
    },
    /// Another key's value.
    #[error("the value of another key ({0})")]
    OtherKey(String),
    /// The trailer does not match the bytes (torn, or corrupted).
    #[error("checksum mismatch")]
    Checksum,
    /// The hash matches but the payload is not the key's (a value forged with a valid trailer).
    #[error("payload differs from the key's")]
    Payload,
}

/// Checks that `bytes` is the value of `key`; returns its digest (the trailer).
///
/// # Errors
/// The first [`ValueFault`] found.
pub fn check_value(key: &str, bytes: &[u8]) -> Result<u64, ValueFault> {
    if bytes.len() < HEADER + TRAILER {
        return Err(ValueFault::Short(bytes.len()));
    }
    if bytes[..4] != MAGIC {
        return Err(ValueFault::Magic);
    }
    let word = |r: std::ops::Range<usize>| bytes[r].iter().rev().fold(0usize, |a, &b| (a << 8) | usize::from(b));
    let stored = word(4..8);
    if stored != bytes.len() {
        return Err(ValueFault::Length { stored, got: bytes.len() });
    }
    let key_len = word(8..10);
    let body = bytes.len() - TRAILER;
    if HEADER + key_len > body {
        return Err(ValueFault::Short(bytes.len()));
    }
    let found = &bytes[HEADER..HEADER + key_len];
    if found != key.as_bytes() {
        return Err(ValueFault::OtherKey(String::from_utf8_lossy(found).into_owned()));
    }
    let h = hash64(&bytes[..body]);
    if bytes[body..] != h.to_le_bytes() {
        return Err(ValueFault::Checksum);
    }
    let mut expected = bytes[..HEADER + key_len].to_vec();
    fill_payload(key, &mut expected, body);
    if expected[..] != bytes[..body] {
        return Err(ValueFault::Payload);
    }
    Ok(h)
}

/// How a logged put ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutResult {
    /// These bytes are the key's value.
    Written,
    /// The pool already held the key.
    Kept,
    /// The put failed (the value may still have been committed).
    Failed(String),
}

/// How a logged get ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GetResult {
    /// The key's value, with this digest.
    Hit(u64),
    /// Not found.
    Miss,
    /// An error (no bytes returned).
    Failed(String),
    /// Bytes that are not the key's value: the violation the test exists to catch.
    Bad(String),
}

/// One line of a client's log. `t` is milliseconds since the Unix epoch, taken when the operation
/// ended (for a `put`, when it was acknowledged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A put of `len` bytes whose value has `digest`.
    Put {
        /// When it ended.
        t: u64,
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
        /// The value's trailer.
        digest: u64,
        /// How it ended.
        result: PutResult,
    },
    /// A get.
    Get {
        /// When it ended.
        t: u64,
        /// The key.
        key: String,
        /// How it ended.
        result: GetResult,
    },
    /// The master routed a get of an acknowledged key to `node`.
    Loc {
        /// When the route came back.
        t: u64,
        /// The key.
        key: String,
        /// Its holder.
        node: String,
    },
    /// The client stopped: `puts` and `gets` done.
    End {
        /// When.
        t: u64,
        /// Puts attempted.
        puts: u64,
        /// Gets attempted.
        gets: u64,
    },
}

/// One line, for the log (messages on one line, at the end).
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Put { t, key, len, digest, result } => {
                write!(f, "{t} put {key} {len} {digest:016x} ")?;
                match result {
                    PutResult::Written => f.write_str("written"),
                    PutResult::Kept => f.write_str("kept"),
                    PutResult::Failed(m) => write!(f, "err {}", one_line(m)),
                }
            }
            Self::Get { t, key, result } => {
                write!(f, "{t} get {key} ")?;
                match result {
                    GetResult::Hit(d) => write!(f, "hit {d:016x}"),
                    GetResult::Miss => f.write_str("miss"),
                    GetResult::Failed(m) => write!(f, "err {}", one_line(m)),
                    GetResult::Bad(m) => write!(f, "bad {}", one_line(m)),
                }
            }
            Self::Loc { t, key, node } => write!(f, "{t} loc {key} {node}"),
            Self::End { t, puts, gets } => write!(f, "{t} end {puts} {gets}"),
        }
    }
}

/// A log line that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed chaos log line: {0:?}")]
pub struct BadLine(pub String);

impl FromStr for Record {
    type Err = BadLine;

    fn from_str(line: &str) -> Result<Self, BadLine> {
        let bad = || BadLine(line.to_owned());
        let mut w = line.splitn(6, ' ');
        let mut next = || w.next().ok_or_else(bad);
        let t: u64 = next()?.parse().map_err(|_| bad())?;
        let op = next()?;
        match op {
            "put" => {
                let key = next()?.to_owned();
                let len = next()?.parse().map_err(|_| bad())?;
                let digest = u64::from_str_radix(next()?, 16).map_err(|_| bad())?;
                let rest = next()?;
                let result = match rest {
                    "written" => PutResult::Written,
                    "kept" => PutResult::Kept,
                    r => PutResult::Failed(r.strip_prefix("err ").ok_or_else(bad)?.to_owned()),
                };
                Ok(Self::Put { t, key, len, digest, result })
            }
            "get" => {
                let key = next()?.to_owned();
                let rest = line.splitn(4, ' ').nth(3).ok_or_else(bad)?;
                let result = match rest.split_once(' ') {
                    None if rest == "miss" => GetResult::Miss,
                    Some(("hit", d)) => GetResult::Hit(u64::from_str_radix(d, 16).map_err(|_| bad())?),
                    Some(("err", m)) => GetResult::Failed(m.to_owned()),
                    Some(("bad", m)) => GetResult::Bad(m.to_owned()),
                    _ => return Err(bad()),
                };
                Ok(Self::Get { t, key, result })
            }
            "loc" => Ok(Self::Loc { t, key: next()?.to_owned(), node: next()?.to_owned() }),
            "end" => {
                let puts = next()?.parse().map_err(|_| bad())?;
                let gets = next()?.parse().map_err(|_| bad())?;
                Ok(Self::End { t, puts, gets })
            }
            _ => Err(bad()),
        }
    }
}

/// Milliseconds since the Unix epoch (the clock the test's fault schedule is logged in).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs one chaos client until its duration is up; returns the exit status (0: it ran; a wrong
/// value is logged, not an exit status, so the checker sees every one).
///
/// # Errors
/// The log cannot be written, or the client cannot join the pool.
pub async fn run(args: &ChaosClientArgs) -> anyhow::Result<u8> {
    let file = File::create(&args.log).with_context(|| format!("creating {}", args.log.display()))?;
    let mut log = LineWriter::new(file);
    let config = PoolClientConfig::new(format!("chaos-c{}-{}", args.client_id, std::process::id()), &args.master);
    let client = PoolClient::start(config).await.with_context(|| format!("joining the pool at {}", args.master))?;
    let result = workload(&client, args, &mut log).await;
    client.close().await;
    result.map(|()| 0)
}

async fn workload(client: &PoolClient, args: &ChaosClientArgs, log: &mut impl Write) -> anyhow::Result<()> {
    let mut rng = SplitMix64(args.seed);
    let max_value = args.max_value.max(256);
    let mut buf = vec![0u8; max_value];
    let (mut seq, mut gets) = (0u64, 0u64);
    // Acknowledged puts not located yet: key, acknowledgement time.
    let mut pending: Vec<(String, Instant)> = Vec::new();
    let mut next_locate = Instant::now() + LOCATE_EVERY;
    let end = Instant::now() + args.duration;
    while Instant::now() < end {
        if rng.chance(50) || seq == 0 {
            let key = key_name(args.client_id, seq);
            seq += 1;
            let len = usize::try_from(rng.range(min_value_len(&key) as u64, max_value as u64 + 1)).unwrap_or(256);
            let value = make_value(&key, len);
            let digest = hash64(&value[..value.len() - TRAILER]);
            let result = match client.put_outcome(&key, &value).await {
                Ok(PutOutcome::Written) => PutResult::Written,
                Ok(PutOutcome::AlreadyPresent) => PutResult::Kept,
                Err(e) => PutResult::Failed(e.to_string()),
            };
            if result == PutResult::Written {
                pending.push((key.clone(), Instant::now()));
            }
            emit(log, Record::Put { t: now_ms(), key, len: value.len(), digest, result })?;
        } else {
            // Mostly its own keys, some of the others' (their seq guessed around its own).
            let owner = if args.clients > 1 && rng.chance(40) {
                u32::try_from(rng.range(0, u64::from(args.clients))).unwrap_or(0)
            } else {
                args.client_id
            };
            let key = key_name(owner, rng.range(0, seq + 2));
            gets += 1;
            let result = match client.get(&key, &mut buf).await {
                Ok(n) => {
                    let got = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len());
                    match check_value(&key, &buf[..got]) {
                        Ok(d) => GetResult::Hit(d),
                        Err(fault) => GetResult::Bad(fault.to_string()),
                    }
                }
                Err(KeyError::Miss) => GetResult::Miss,
                Err(e) => GetResult::Failed(e.to_string()),
            };
            // A stale buffer must never pass for the next get's bytes.
            buf.fill(0);
            emit(log, Record::Get { t: now_ms(), key, result })?;
        }
        if Instant::now() >= next_locate {
            locate(client, &mut pending, log).await?;
            next_locate = Instant::now() + LOCATE_EVERY;
        }
    }
    // The last puts' holders, while the pool still runs.
    let until = Instant::now() + Duration::from_secs(3);
    while !pending.is_empty() && Instant::now() < until {
        tokio::time::sleep(LOCATE_EVERY).await;
        locate(client, &mut pending, log).await?;
    }
    emit(log, Record::End { t: now_ms(), puts: seq, gets })?;
    log.flush().context("writing the chaos log")
}

fn emit(log: &mut impl Write, r: Record) -> anyhow::Result<()> {
    writeln!(log, "{r}").context("writing the chaos log")
}

/// Route-gets every pending key (in batches); logs and drops each one the master names a holder
/// for, and drops those pending longer than [`LOCATE_FOR`] (evicted, or lost, before the master
/// indexed them). A master that does not answer leaves them pending. Every pending key is asked
/// each round: asking only the oldest would starve the new ones behind keys that never show up.
async fn locate(client: &PoolClient, pending: &mut Vec<(String, Instant)>, log: &mut impl Write) -> anyhow::Result<()> {
    pending.retain(|(_, at)| at.elapsed() < LOCATE_FOR);
    let keys: Vec<String> = pending.iter().map(|(k, _)| k.clone()).collect();
    let mut found = HashSet::new();
    for chunk in keys.chunks(LOCATE_BATCH) {
        let Ok(hits) = client.master().batch_route_get(chunk, &[]).await else { break };
        for (key, hit) in chunk.iter().zip(hits) {
            if let Some(hit) = hit {
                emit(log, Record::Loc { t: now_ms(), key: key.clone(), node: hit.node_id })?;
                found.insert(key.clone());
            }
        }
    }
    pending.retain(|(k, _)| !found.contains(k));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_checks_under_its_key_and_every_fault_is_named() {
        let v = make_value("chaos-c0-1", 1000);
        assert_eq!(v.len(), 1000);
        let d = check_value("chaos-c0-1", &v).expect("its own value");
        assert_eq!(d, hash64(&v[..v.len() - TRAILER]));
        assert_eq!(check_value("chaos-c0-2", &v), Err(ValueFault::OtherKey("chaos-c0-1".into())));
        assert_eq!(check_value("chaos-c0-1", &v[..999]), Err(ValueFault::Length { stored: 1000, got: 999 }));
        let mut flipped = v.clone();
        flipped[500] ^= 1;
        assert_eq!(check_value("chaos-c0-1", &flipped), Err(ValueFault::Checksum));
        let mut forged = v.clone();
        forged[500] ^= 1;
        let body = forged.len() - TRAILER;
        let h = hash64(&forged[..body]);
        forged[body..].copy_from_slice(&h.to_le_bytes());
        assert_eq!(check_value("chaos-c0-1", &forged), Err(ValueFault::Payload));
        assert_eq!(check_value("chaos-c0-1", &[0u8; 1000]), Err(ValueFault::Magic));
        assert_eq!(check_value("chaos-c0-1", &[0u8; 3]), Err(ValueFault::Short(3)));
        // Two keys' values of one length differ beyond the key.
        let (a, b) = (make_value("chaos-c0-3", 400), make_value("chaos-c1-3", 400));
        assert_ne!(a[30..300], b[30..300]);
    }

    /// The locator asks every pending key each round: 600 keys that never show up ahead of 300
    /// that are indexed do not hide the 300 (asking only the oldest batch starved them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_locate_round_finds_new_keys_behind_many_that_never_show_up() {
        use umbp_master::MasterConfig;
        use umbp_peer::pool_client::{DramConfig, Medium};

        let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let master = umbp_master::start(MasterConfig { listen, ..MasterConfig::default() }).await.expect("master");
        let addr = master.local_addr().to_string();
        let mut config = PoolClientConfig::new("locate-node", addr.clone()).with_medium(Medium::Dram(DramConfig {
            capacity_bytes: 8 << 20,
            prefault: false,
            ..DramConfig::default()
        }));
        config.page_size = 4096;
        let node = PoolClient::start(config).await.expect("node");
        let client = PoolClient::start(PoolClientConfig::new("locate-client", addr)).await.expect("client");
        let mut pending: Vec<(String, Instant)> = (0..600).map(|i| (format!("never-{i}"), Instant::now())).collect();
        let real: Vec<String> = (0..300).map(|i| key_name(0, i)).collect();
        for key in &real {
            client.put(key, &make_value(key, 100)).await.expect("put");
            pending.push((key.clone(), Instant::now()));
        }
        node.flush();
        let mut log = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while pending.len() > 600 && Instant::now() < deadline {
            locate(&client, &mut pending, &mut log).await.expect("locate");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let text = String::from_utf8(log).expect("utf-8 log");
        let located: HashSet<String> = text
            .lines()
            .filter_map(|l| match l.parse::<Record>() {
                Ok(Record::Loc { key, node, .. }) if node == "locate-node" => Some(key),
                _ => None,
            })
            .collect();
        assert_eq!(located.len(), 300, "every indexed key is located");
        assert!(real.iter().all(|k| located.contains(k)));
        assert_eq!(pending.len(), 600, "only the keys that never show up stay pending");
        client.close().await;
        node.close().await;
        master.shutdown().await;
    }

    #[test]
    fn every_record_reads_back_as_written() {
        let records = [
            Record::Put { t: 1, key: "k".into(), len: 9, digest: 0xab, result: PutResult::Written },
            Record::Put { t: 2, key: "k".into(), len: 9, digest: 0xab, result: PutResult::Kept },
            Record::Put { t: 3, key: "k".into(), len: 9, digest: 1, result: PutResult::Failed("no node: x y".into()) },
            Record::Get { t: 4, key: "k".into(), result: GetResult::Hit(u64::MAX) },
            Record::Get { t: 5, key: "k".into(), result: GetResult::Miss },
            Record::Get { t: 6, key: "k".into(), result: GetResult::Failed("n1 unreachable: gone".into()) },
            Record::Get { t: 7, key: "k".into(), result: GetResult::Bad("checksum mismatch".into()) },
            Record::Loc { t: 8, key: "k".into(), node: "s1".into() },
            Record::End { t: 9, puts: 10, gets: 11 },
        ];
        for r in records {
            assert_eq!(r.to_string().parse::<Record>(), Ok(r.clone()), "{r}");
        }
        assert!("12 put k".parse::<Record>().is_err());
        assert!("x get k miss".parse::<Record>().is_err());
    }
}
