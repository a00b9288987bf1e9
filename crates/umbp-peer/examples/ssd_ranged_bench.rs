//! A ranged get of an eighth of each value from an SSD node against a whole-value get of the same
//! keys' values (issue 21: "an SSD node reads only the blocks the ranges cover"), measured in the
//! same run.
//!
//! A master and an SSD node (one 1 MiB page per value, committed values not kept in staging, so
//! every first read reaches the drive) in this process, and a client-only node reading over TCP.
//! Each round puts two batches of fresh keys; one batch is read whole (`batch_get`), the other as
//! one range of an eighth per key (`batch_get_ranges`), in alternating order by round. Reported:
//! median milliseconds per batch and per key, and the drive bytes the node read per key (from its
//! medium's counters). Every read is checked byte for byte.
//!
//! ```text
//! cargo run --release -p umbp-peer --example ssd_ranged_bench -- [--dir PATH] [--keys 32] [--rounds 5]
//! ```
//!
//! `--dir` must be on a drive (direct IO): the default is `target/ssd-ranged-bench`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use umbp_core::metric_names;
use umbp_master::MasterConfig;
use umbp_peer::pool_client::{Medium, PoolClient, PoolClientConfig, RecachePolicy, SsdConfig};

const VALUE: usize = 1 << 20;
const EIGHTH: usize = VALUE / 8;

struct Args {
    dir: PathBuf,
    keys: usize,
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args { dir: PathBuf::from("target/ssd-ranged-bench"), keys: 32, rounds: 5 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--dir" => a.dir = value.into(),
            "--keys" => a.keys = value.parse().unwrap_or(a.keys),
            "--rounds" => a.rounds = value.parse().unwrap_or(a.rounds),
            other => {
                eprintln!("unknown flag {other}");
                std::process::exit(2);
            }
        }
    }
    a
}

fn node_config(master: &str, id: &str, medium: Medium) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master).with_medium(medium);
    c.page_size = VALUE as u64;
    c.recache = RecachePolicy::Off;
    c.shared_memory = false;
    c.read_lease = Duration::from_secs(30);
    c
}

fn drive_read_bytes(node: &PoolClient) -> u64 {
    let Some(medium) = node.medium() else { return 0 };
    medium
        .sample_metrics()
        .iter()
        .filter(|s| {
            s.name == metric_names::MEDIUM_BYTES_TOTAL
                && s.labels.iter().any(|(k, v)| k == "event" && v == "device_read")
        })
        .map(|s| s.value)
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn value(seed: usize) -> Vec<u8> {
    (0..VALUE).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8).collect()
}

async fn indexed(client: &PoolClient, keys: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client.master().batch_lookup(keys).await.expect("lookup").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let a = args();
    std::fs::create_dir_all(&a.dir).expect("bench directory");
    let dir = tempfile::Builder::new().prefix("ssd-ranged").tempdir_in(&a.dir).expect("tempdir");
    let master =
        umbp_master::start(MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() })
            .await
            .expect("master");
    let addr = master.local_addr().to_string();
    let per_round = 2 * a.keys as u64 * VALUE as u64;
    let ssd = SsdConfig {
        dirs: vec![dir.path().to_owned()],
        capacity_bytes: (a.rounds as u64 + 1) * per_round * 2,
        staging_pages: 2 * a.keys as u64,
        cache_committed: false,
        read_lease: Duration::from_secs(30),
        ..SsdConfig::default()
    };
    let node = PoolClient::start(node_config(&addr, "ssd", Medium::Ssd(ssd))).await.expect("ssd node");
    let reader = PoolClient::start(node_config(&addr, "reader", Medium::None)).await.expect("reader");
    let (mut whole_ms, mut part_ms, mut whole_drive, mut part_drive) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let whole_keys: Vec<String> = (0..a.keys).map(|i| format!("w-{round}-{i}")).collect();
        let part_keys: Vec<String> = (0..a.keys).map(|i| format!("p-{round}-{i}")).collect();
        let values: Vec<Vec<u8>> = (0..a.keys).map(|i| value(round * 1000 + i)).collect();
        for keys in [&whole_keys, &part_keys] {
            let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            for r in reader.batch_put(&items).await {
                r.expect("put");
            }
            indexed(&reader, keys).await;
        }
        for turn in 0..2 {
            let before = drive_read_bytes(&node);
            if (turn == 0) == (round % 2 == 0) {
                let refs: Vec<&str> = whole_keys.iter().map(String::as_str).collect();
                let mut bufs: Vec<Vec<u8>> = (0..a.keys).map(|_| vec![0u8; VALUE]).collect();
                let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                let t = Instant::now();
                let r = reader.batch_get(&refs, &mut slices).await;
                whole_ms.push(t.elapsed().as_secs_f64() * 1e3);
                assert!(r.iter().all(Result::is_ok), "whole get: {r:?}");
                assert!(bufs.iter().zip(&values).all(|(b, v)| b == v), "whole get: wrong bytes");
                whole_drive.push((drive_read_bytes(&node) - before) as f64 / a.keys as f64);
            } else {
                let refs: Vec<&str> = part_keys.iter().map(String::as_str).collect();
                let mut bufs: Vec<Vec<u8>> = (0..a.keys).map(|_| vec![0u8; EIGHTH]).collect();
                let mut lists: Vec<Vec<(&mut [u8], u64)>> =
                    bufs.iter_mut().map(|b| vec![(b.as_mut_slice(), 3 * EIGHTH as u64)]).collect();
                let t = Instant::now();
                let r = reader.batch_get_ranges(&refs, &mut lists).await;
                part_ms.push(t.elapsed().as_secs_f64() * 1e3);
                drop(lists);
                assert!(r.iter().all(Result::is_ok), "ranged get: {r:?}");
                assert!(
                    bufs.iter().zip(&values).all(|(b, v)| b[..] == v[3 * EIGHTH..4 * EIGHTH]),
                    "ranged get: wrong bytes"
                );
                part_drive.push((drive_read_bytes(&node) - before) as f64 / a.keys as f64);
            }
        }
        let all: Vec<&str> = whole_keys.iter().chain(&part_keys).map(String::as_str).collect();
        let _ = reader.remove(&all).await;
    }
    let (w, p) = (median(whole_ms), median(part_ms));
    println!("SSD node, {} keys of 1 MiB per batch over TCP, medians of {} rounds:", a.keys, a.rounds);
    println!();
    println!("| get | ms per batch | ms per key | drive KiB read per key |");
    println!("|---|---|---|---|");
    println!("| whole value | {w:.2} | {:.3} | {:.0} |", w / a.keys as f64, median(whole_drive) / 1024.0);
    println!("| an eighth (one range) | {p:.2} | {:.3} | {:.0} |", p / a.keys as f64, median(part_drive) / 1024.0);
    println!();
    println!("eighth / whole time: {:.2}", p / w);
    reader.close().await;
    node.close().await;
    master.shutdown().await;
}
