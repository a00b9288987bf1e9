//! The holder's side: a socket that admits same-user, token-holding peers and hands them the memory
//! files of registered regions.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::epochs::{EpochTable, check_backing};
use super::wire::{self, RegionReply, Status};
use super::{ShmError, socket_name, tokens_equal};

/// Settings of a [`ShmServer`].
#[derive(Debug, Clone)]
pub struct ShmServerConfig {
    /// The node's data endpoint (`host:port`, as its remote refs name it); the socket is named after
    /// it ([`socket_name`](super::socket_name)).
    pub endpoint: String,
    /// The cluster token a peer must present (empty: none asked for, as on the TCP data plane).
    pub token: Vec<u8>,
    /// Besides peers running as this process's effective user, admit peers whose effective group is
    /// this one. Default: `None` (same user only).
    pub allowed_gid: Option<u32>,
    /// Regions that may be registered at once (slots of the epoch table). Default: 65,536.
    pub max_regions: u32,
    /// Connections served at once; one more is closed at once. Default: 256.
    pub max_connections: usize,
    /// A hello must arrive within this. Default: 1 s.
    pub handshake_timeout: Duration,
}

impl ShmServerConfig {
    /// Defaults for the node at `endpoint` with cluster token `token`.
    pub fn new(endpoint: impl Into<String>, token: impl Into<Vec<u8>>) -> Self {
        Self {
            endpoint: endpoint.into(),
            token: token.into(),
            allowed_gid: None,
            max_regions: 65_536,
            max_connections: 256,
            handshake_timeout: Duration::from_secs(1),
        }
    }
}

/// One shareable region.
#[derive(Debug)]
struct Region {
    /// This server's own duplicate of the region's file.
    file: OwnedFd,
    reply: RegionReply,
}

#[derive(Debug, Default)]
struct Regions {
    by_id: HashMap<u64, Region>,
    free_slots: Vec<u32>,
    next_slot: u32,
    /// The last epoch handed out; epochs are never reused.
    last_epoch: u64,
}

#[derive(Debug)]
struct Shared {
    config: ShmServerConfig,
    name: String,
    uid: u32,
    server_id: u64,
    table: EpochTable,
    table_file: OwnedFd,
    regions: Mutex<Regions>,
    stopping: AtomicBool,
    /// Live connections (a clone of each stream, to shut them down on stop).
    conns: Mutex<HashMap<u64, UnixStream>>,
    next_conn: AtomicU64,
}

/// The shared-memory server of one node; see the [module docs](super). Stops on
/// [`shutdown`](Self::shutdown) or drop: the socket closes, every connection is shut, every region's
/// epoch is cleared (so every client's mapping reads as stale) and the files are closed.
#[derive(Debug)]
pub struct ShmServer {
    shared: Arc<Shared>,
    listener: UnixListener,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl ShmServer {
    /// Binds the socket and starts the accepting thread.
    pub fn start(config: ShmServerConfig) -> Result<Self, ShmError> {
        let name = socket_name(&config.endpoint)?;
        if config.max_regions == 0 || config.max_connections == 0 {
            return Err(ShmError::Invalid("max_regions and max_connections must be positive".into()));
        }
        let endpoint = config.endpoint.clone();
        let io = |context| {
            let peer = endpoint.clone();
            move |source| ShmError::Io { peer, context, source }
        };
        let (table, table_file) = EpochTable::create(config.max_regions).map_err(io("creating the epoch table"))?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io("naming the socket"))?;
        let listener = UnixListener::bind_addr(&addr).map_err(io("binding the socket"))?;
        let accept_from = listener.try_clone().map_err(io("cloning the listener"))?;
        let shared = Arc::new(Shared {
            uid: rustix::process::geteuid().as_raw(),
            server_id: random_id(),
            table,
            table_file,
            name,
            config,
            regions: Mutex::new(Regions::default()),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
        });
        if let Some(gid) = shared.config.allowed_gid {
            // A widening of who may read and write this node's memory: said once, where an operator looks.
            tracing::info!(endpoint = %shared.config.endpoint, uid = shared.uid, gid,
                "shm server admits this group's processes besides this user's");
        }
        let thread_shared = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("umbp-shm-accept".into())
            .spawn(move || accept_loop(&thread_shared, &accept_from))
            .map_err(io("starting the accepting thread"))?;
        Ok(Self { shared, listener, acceptor: Mutex::new(Some(acceptor)) })
    }

    /// The abstract socket name clients connect to.
    pub fn socket_name(&self) -> &str {
        &self.shared.name
    }

    /// The random id of this server instance (a restarted holder has another).
    pub fn server_id(&self) -> u64 {
        self.shared.server_id
    }

    /// Makes `len` bytes of `file` from `offset` on shareable as region `region_id` (the id the node's
    /// data plane gave the region), and returns the registration's epoch. The server keeps its own
    /// duplicate of the file until [`deregister`](Self::deregister). The file must be sealed against
    /// shrinking and hold the range, so no client's mapping can fault. Registering an id again
    /// replaces it under a new epoch.
    pub fn register(&self, region_id: u64, file: BorrowedFd<'_>, offset: u64, len: u64) -> Result<u64, ShmError> {
        check_backing(file, offset, len).map_err(|e| ShmError::Invalid(format!("region {region_id:#x}: {e}")))?;
        let file = file.try_clone_to_owned().map_err(|source| ShmError::Io {
            peer: self.shared.config.endpoint.clone(),
            context: "duplicating a region's file",
            source,
        })?;
        let mut regions = self.shared.regions.lock();
        if let Some(old) = regions.by_id.remove(&region_id) {
            self.shared.table.store(old.reply.slot, 0);
            regions.free_slots.push(old.reply.slot);
        }
        let slot = match regions.free_slots.pop() {
            Some(slot) => slot,
            None if regions.next_slot < self.shared.table.slots() => {
                regions.next_slot += 1;
                regions.next_slot - 1
            }
            None => {
                return Err(ShmError::Invalid(format!(
                    "more than {} shareable regions registered",
                    self.shared.table.slots()
                )));
            }
        };
        regions.last_epoch += 1;
        let epoch = regions.last_epoch;
        self.shared.table.store(slot, epoch);
        regions.by_id.insert(region_id, Region { file, reply: RegionReply { slot, offset, len, epoch } });
        Ok(epoch)
    }

    /// Stops sharing region `region_id`: its epoch is cleared at once, so every client sees its
    /// mapping stale before its next copy, and no new client gets the file. Whether it was
    /// registered.
    pub fn deregister(&self, region_id: u64) -> bool {
        let mut regions = self.shared.regions.lock();
        let Some(old) = regions.by_id.remove(&region_id) else { return false };
        self.shared.table.store(old.reply.slot, 0);
        regions.free_slots.push(old.reply.slot);
        true
    }

    /// Regions registered now.
    pub fn region_count(&self) -> usize {
        self.shared.regions.lock().by_id.len()
    }

    /// Connections open now.
    pub fn connection_count(&self) -> usize {
        self.shared.conns.lock().len()
    }

    /// Stops the server (idempotent); see the type docs.
    pub fn shutdown(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wakes the accepting thread: a shut listening socket fails `accept` on Linux.
        let _ = rustix::net::shutdown(&self.listener, rustix::net::Shutdown::Both);
        // And, should it not, a connection does (the thread sees `stopping` and drops it).
        if let Ok(addr) = SocketAddr::from_abstract_name(self.shared.name.as_bytes()) {
            let _ = UnixStream::connect_addr(&addr);
        }
        if let Some(thread) = self.acceptor.lock().take()
            && thread.join().is_err()
        {
            tracing::error!(endpoint = %self.shared.config.endpoint, "shm accepting thread panicked");
        }
        for (_, conn) in self.shared.conns.lock().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        let mut regions = self.shared.regions.lock();
        for (_, region) in regions.by_id.drain() {
            self.shared.table.store(region.reply.slot, 0);
        }
    }
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => {
                tracing::warn!(endpoint = %shared.config.endpoint, error = %err, "shm accept failed");
                // Out of descriptors and the like: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = shared.conns.lock();
            if conns.len() >= shared.config.max_connections {
                tracing::warn!(endpoint = %shared.config.endpoint, "shm connection cap reached; closing a new one");
                continue;
            }
            match stream.try_clone() {
                Ok(clone) => conns.insert(id, clone),
                Err(_) => continue,
            };
        }
        let conn_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new().name("umbp-shm-conn".into()).spawn(move || {
            if let Err(err) = serve(&conn_shared, stream) {
                tracing::debug!(endpoint = %conn_shared.config.endpoint, error = %err, "shm connection ended");
            }
            conn_shared.conns.lock().remove(&id);
        });
        if spawned.is_err() {
            shared.conns.lock().remove(&id);
        }
    }
}

/// Runs one connection: the handshake, then requests until the peer hangs up.
fn serve(shared: &Shared, mut stream: UnixStream) -> io::Result<()> {
    stream.set_read_timeout(Some(shared.config.handshake_timeout))?;
    stream.set_write_timeout(Some(shared.config.handshake_timeout))?;
    let mut fixed = [0u8; wire::HELLO_LEN];
    stream.read_exact(&mut fixed)?;
    let refuse = |stream: &mut UnixStream, status: Status| {
        let _ = wire::send_with_fd(stream, &wire::encode_hello_reply(status, 0, 0), None);
    };
    let Some(token_len) = wire::decode_hello(&fixed) else {
        refuse(&mut stream, Status::BadRequest);
        return Ok(());
    };
    let mut token = vec![0u8; token_len];
    stream.read_exact(&mut token)?;
    // Credentials first: a peer of another user learns nothing about the token.
    let cred = rustix::net::sockopt::socket_peercred(&stream)?;
    let (uid, gid) = (cred.uid.as_raw(), cred.gid.as_raw());
    if uid != shared.uid && shared.config.allowed_gid != Some(gid) {
        tracing::warn!(endpoint = %shared.config.endpoint, uid, gid, pid = cred.pid.as_raw_nonzero().get(),
            "shm peer refused: another user");
        refuse(&mut stream, Status::Forbidden);
        return Ok(());
    }
    if !tokens_equal(&token, &shared.config.token) {
        tracing::warn!(endpoint = %shared.config.endpoint, uid, "shm peer refused: wrong cluster token");
        refuse(&mut stream, Status::BadToken);
        return Ok(());
    }
    let reply = wire::encode_hello_reply(Status::Ok, shared.table.slots(), shared.server_id);
    wire::send_with_fd(&mut stream, &reply, Some(shared.table_file.as_fd()))?;
    // An authenticated client keeps its connection as long as it maps our regions.
    stream.set_read_timeout(None)?;
    loop {
        let mut request = [0u8; wire::REQUEST_LEN];
        match stream.read_exact(&mut request) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let Some(region_id) = wire::decode_request(&request) else {
            let _ = wire::send_with_fd(
                &mut stream,
                &wire::encode_region_reply(Status::BadRequest, RegionReply::default()),
                None,
            );
            return Ok(());
        };
        // The file is duplicated under the lock so that a concurrent deregistration cannot close it
        // mid-send; the client validates the epoch against the table anyway.
        let found = shared.regions.lock().by_id.get(&region_id).map(|r| (r.file.try_clone(), r.reply));
        match found {
            Some((Ok(file), reply)) => {
                wire::send_with_fd(&mut stream, &wire::encode_region_reply(Status::Ok, reply), Some(file.as_fd()))?;
            }
            Some((Err(e), _)) => return Err(e),
            None => {
                let reply = wire::encode_region_reply(Status::UnknownRegion, RegionReply::default());
                wire::send_with_fd(&mut stream, &reply, None)?;
            }
        }
    }
}

/// A random 64-bit id (std's per-process random hash keys; nothing cryptographic is needed).
fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}
