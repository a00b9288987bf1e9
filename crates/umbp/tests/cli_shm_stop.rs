//! A holder process stopped (SIGSTOP) while a same-host reader copies a large value out of its
//! mapping of the holder's memory, then resumed (SIGCONT) — several times — and at last SIGKILLed
//! while stopped. The reader (this test process, a light client on the default same-host path:
//! keyed gets answered with a place in the holder's shared memory, batch gets through the
//! shared-memory engine) never crashes (no `SIGBUS`), never returns bytes other than the value,
//! and answers every call with the value or a clean error, in bounded time.
//!
//! A stop lands inside a copy: the values are 64 MiB, so a get spends nearly all its time copying
//! (the exchange with the holder is well under a millisecond), and the test checks that, at some
//! stop, a get that was in flight finished **while the holder was still stopped** — its copy needed
//! nothing from the stopped process — with the value's bytes.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const VALUE: usize = 64 << 20;
const KEYS: [&str; 2] = ["stop-a", "stop-b"];
/// SIGSTOP / SIGCONT cycles before the final SIGKILL.
const CYCLES: u64 = 10;

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill runs");
    assert!(status.success(), "kill {sig} {pid}");
}

/// What the reader shares with the test's controller.
#[derive(Default)]
struct Progress {
    /// The call in flight (its number, from 1), 0 between calls.
    in_flight: AtomicU64,
    /// When the call in flight began, microseconds after `base`.
    since_us: AtomicU64,
    base: Option<Instant>,
    /// The last call finished.
    done: AtomicU64,
    hits: AtomicU64,
    failures: AtomicU64,
    stop: AtomicBool,
}

/// Gets the two keys back to back — single keyed gets, and every third call a batch of both —
/// checking every hit byte for byte; returns when told to, or after the holder is gone (three
/// failures in a row).
async fn read_loop(client: Arc<PoolClient>, values: Arc<Vec<Vec<u8>>>, p: Arc<Progress>) {
    let mut bufs = [vec![0u8; VALUE], vec![0u8; VALUE]];
    let mut failed_in_a_row = 0;
    for call in 1u64.. {
        if p.stop.load(Ordering::Acquire) || failed_in_a_row >= 3 {
            return;
        }
        p.since_us.store(p.elapsed_us(), Ordering::Release);
        p.in_flight.store(call, Ordering::Release);
        let results: Vec<(usize, Result<u64, String>)> = if call % 3 == 0 {
            let (a, b) = bufs.split_at_mut(1);
            let mut slices: Vec<&mut [u8]> = vec![a[0].as_mut_slice(), b[0].as_mut_slice()];
            let got = client.batch_get(&KEYS, &mut slices).await;
            got.into_iter().enumerate().map(|(i, r)| (i, r.map_err(|e| e.to_string()))).collect()
        } else {
            let i = (call % 2) as usize;
            vec![(i, client.get(KEYS[i], &mut bufs[i]).await.map_err(|e| e.to_string()))]
        };
        p.in_flight.store(0, Ordering::Release);
        p.done.store(call, Ordering::Release);
        let mut failed = false;
        for (i, r) in results {
            match r {
                Ok(n) => {
                    assert_eq!(n as usize, VALUE, "{}", KEYS[i]);
                    assert!(
                        bufs[i] == values[i],
                        "call {call}: a hit on {} returned bytes other than the value",
                        KEYS[i]
                    );
                    p.hits.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    failed = true;
                    p.failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        failed_in_a_row = if failed { failed_in_a_row + 1 } else { 0 };
    }
}

impl Progress {
    fn elapsed_us(&self) -> u64 {
        self.base.map_or(0, |b| b.elapsed().as_micros() as u64)
    }

    /// Waits (at most 5 s) for a call that has been in flight for `min` — past its exchange with
    /// the holder (well under a millisecond), so copying — and returns its number.
    fn call_copying(&self, min: Duration) -> Option<u64> {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            let call = self.in_flight.load(Ordering::Acquire);
            let since = self.since_us.load(Ordering::Acquire);
            if call != 0 && self.elapsed_us().saturating_sub(since) >= min.as_micros() as u64 {
                return Some(call);
            }
            std::hint::spin_loop();
        }
        None
    }
}

/// Waits up to `limit` for call `call` to finish; whether it did.
fn finished(p: &Progress, call: u64, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    while p.done.load(Ordering::Acquire) < call {
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stopped_during_a_copy_never_crashes_or_misleads_the_reader() {
    let dir = TempDir::new("shm-sigstop");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let args = ["node", "--master", &address, "--node-id", "holder", "--medium", "dram", "--capacity", "192MiB"];
    let (mut holder, _) =
        Proc::try_start(&dir.0, "holder", &[&args[..], &["--prefault", "false"]].concat(), &[], "node holder")
            .unwrap_or_else(|e| panic!("{e}"));
    let pid = holder.child.id();
    let client = Arc::new(PoolClient::start(PoolClientConfig::new("reader", address.clone())).await.expect("client"));
    let values = Arc::new(KEYS.iter().map(|k| value(k, VALUE)).collect::<Vec<_>>());
    for (k, v) in KEYS.iter().zip(values.iter()) {
        client.put(k, v).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }

    let progress = Arc::new(Progress { base: Some(Instant::now()), ..Progress::default() });
    let reader = tokio::spawn(read_loop(Arc::clone(&client), Arc::clone(&values), Arc::clone(&progress)));
    // The controller blocks (sleeps, waits on `kill`): off the runtime's workers.
    let p = Arc::clone(&progress);
    let (landed, completed_while_stopped) = tokio::task::spawn_blocking(move || {
        let (mut landed, mut completed) = (0u32, 0u32);
        for cycle in 0..CYCLES {
            std::thread::sleep(Duration::from_millis(20 + 7 * cycle));
            let copying = p.call_copying(Duration::from_millis(1));
            signal(pid, "-STOP");
            let call = p.in_flight.load(Ordering::Acquire);
            if copying.is_some() && copying == Some(call) {
                landed += 1;
                // A copy in progress needs nothing from the stopped holder.
                if finished(&p, call, Duration::from_millis(500)) {
                    completed += 1;
                }
            }
            signal(pid, "-CONT");
            // Gets go on after the holder resumes.
            let next = p.done.load(Ordering::Acquire) + 2;
            assert!(finished(&p, next, Duration::from_secs(20)), "no progress after SIGCONT");
        }
        // At last: stopped, and killed while stopped, with a call in flight.
        let _ = p.call_copying(Duration::from_millis(1));
        signal(pid, "-STOP");
        std::thread::sleep(Duration::from_millis(5));
        signal(pid, "-KILL");
        (landed, completed)
    })
    .await
    .expect("controller");
    holder.kill9();
    // Calls after the kill fail (the holder is gone); the loop ends after three in a row.
    tokio::time::timeout(Duration::from_secs(60), reader).await.expect("no hang").expect("no panic, no SIGBUS");
    let hits = progress.hits.load(Ordering::Relaxed);
    let failures = progress.failures.load(Ordering::Relaxed);
    eprintln!(
        "{CYCLES} stops: {landed} landed on a get in flight for 1 ms or more, {completed_while_stopped} of which \
         finished while the holder was stopped; {hits} hits (every one the value), {failures} clean failures"
    );
    assert!(completed_while_stopped > 0, "no stop landed inside a copy ({landed} landed on a call in flight)");
    assert!(failures > 0, "the killed holder's keys cannot be read");

    // The reader works afterwards, promptly: the keys are gone with their holder.
    let started = Instant::now();
    let mut small = vec![0u8; 16];
    assert!(client.get(KEYS[0], &mut small).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    progress.stop.store(true, Ordering::Release);
}
