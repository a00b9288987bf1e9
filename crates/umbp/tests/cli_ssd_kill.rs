//! `umbp node --medium ssd` as a process:
//!
//! - killed with SIGKILL (no shutdown, no final sync) and restarted on the same directory: it
//!   recovers its log, announces the keys in its full sync, and a remote client reads every value
//!   back byte-exact;
//! - started under an open-files soft limit too low for its log's worst case (one descriptor per
//!   segment): it raises the soft limit to the hard one and starts.
//!
//! Every child is killed by a guard's `Drop`; every wait is bounded.

use std::path::Path;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const PAGE: usize = 64 * 1024;
/// Short heartbeats: the killed node expires within seconds, so its restart can register again.
const ENV: &[(&str, &str)] =
    &[("UMBP_HEARTBEAT_TTL_SEC", "1"), ("UMBP_MAX_MISSED_HEARTBEATS", "2"), ("UMBP_REAPER_INTERVAL_SEC", "1")];

/// Waits until the master's index has every key.
async fn until_indexed(client: &PoolClient, keys: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(found) = client.master().batch_lookup(keys).await
            && found.iter().all(|f| *f)
        {
            return;
        }
        assert!(Instant::now() < deadline, "the master never saw every key");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn start_node(dir: &Path, master: &str, ssd_dir: &Path) -> Result<(Proc, String), String> {
    let ssd_dir = ssd_dir.to_str().expect("utf-8 path");
    let args = [
        "node",
        "--master",
        master,
        "--node-id",
        "s1",
        "--medium",
        "ssd",
        "--ssd-dir",
        ssd_dir,
        "--ssd-capacity",
        "16MiB",
        "--page-size",
        "64KiB",
        // Room for every read of the check below at once (a resolve with no free staging page is
        // a miss, pinned in umbp-ssd).
        "--ssd-staging-pages",
        "64",
    ];
    Proc::try_start(dir, "s1", &args, ENV, "node s1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssd_node_killed_with_sigkill_serves_every_acknowledged_value_after_a_restart() {
    let dir = TempDir::new("ssd-kill9");
    let ssd_dir = dir.0.join("drive");
    std::fs::create_dir_all(&ssd_dir).expect("the drive directory");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], ENV, "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let master = field(&line, "listen").to_owned();
    let (mut node, line) = start_node(&dir.0, &master, &ssd_dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(field(&line, "medium"), "ssd", "{line}");
    let client = PoolClient::start(PoolClientConfig::new("ssd-kill-client", master.clone())).await.expect("client");

    let sizes = [100usize, 3000, PAGE - 1, PAGE];
    let keys: Vec<String> = (0..40).map(|i| format!("ssd-k9-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, k)| value(k, sizes[i % sizes.len()])).collect();
    for (k, v) in keys.iter().zip(&values) {
        // Acknowledged: the node committed the record to its drive log.
        client.put(k, v).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    until_indexed(&client, &keys).await;

    // Killed: no shutdown, no final fdatasync, no tombstone flush.
    node.kill9();
    drop(node);

    // The restart registers once the master has expired the dead registration.
    let deadline = Instant::now() + Duration::from_secs(60);
    let _node = loop {
        match start_node(&dir.0, &master, &ssd_dir) {
            Ok((node, _)) => break node,
            Err(e) => {
                assert!(Instant::now() < deadline, "the node never came back: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    until_indexed(&client, &keys).await;
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len() + 1]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let results = client.batch_get(&refs, &mut slices).await;
        let mut all = true;
        for (i, r) in results.iter().enumerate() {
            match r {
                Ok(n) => {
                    assert_eq!(*n as usize, values[i].len(), "size of {}", keys[i]);
                    assert!(bufs[i][..values[i].len()] == values[i][..], "{} came back with other bytes", keys[i]);
                }
                Err(_) => all = false,
            }
        }
        if all {
            break;
        }
        // A get can race the restarted node's announcement; never wrong bytes, only a retry.
        assert!(Instant::now() < deadline, "not every acknowledged key came back: {results:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    client.close().await;
}

#[test]
fn an_ssd_node_raises_a_low_open_files_soft_limit_and_starts() {
    use std::os::unix::process::CommandExt;
    let mut hard = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `hard` is a valid, writable rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) }, 0);
    // 75 GiB in 256 MiB segments needs about 304 descriptors at worst.
    if hard.rlim_max < 400 {
        // `UMBP_REQUIRE_OPEN_FILES=1` (umbp-testkit's `require::OPEN_FILES`): fail instead of skipping.
        let why = format!("the hard open-files limit ({}) is below what the check needs", hard.rlim_max);
        assert!(
            !std::env::var("UMBP_REQUIRE_OPEN_FILES").is_ok_and(|v| v.trim() == "1"),
            "UMBP_REQUIRE_OPEN_FILES=1 but {why}"
        );
        eprintln!("skipped: {why} (set UMBP_REQUIRE_OPEN_FILES=1 to fail instead)");
        return;
    }
    let dir = TempDir::new("ssd-nofile");
    let ssd_dir = dir.0.join("drive");
    std::fs::create_dir_all(&ssd_dir).expect("the drive directory");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], ENV, "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let master = field(&line, "listen").to_owned();
    let args = [
        "node",
        "--master",
        &master,
        "--node-id",
        "nofile",
        "--medium",
        "ssd",
        "--ssd-dir",
        ssd_dir.to_str().expect("utf-8 path"),
        "--ssd-capacity",
        "75GiB",
    ];
    let mut cmd = cli_support::command(&args, ENV);
    let log = dir.0.join("nofile.log");
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .stdin(std::process::Stdio::null());
    // SAFETY: the closure only calls setrlimit, which is async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            l.rlim_cur = 128;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn umbp node");
    let stdout = child.stdout.take().expect("stdout");
    let ready = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout).lines().map_while(Result::ok).find(|l| l.contains(" ready "))
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let started = loop {
        if ready.is_finished() {
            break ready.join().expect("reader").is_some();
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(started, "the node did not start under a soft limit of 128:\n{text}");
}
