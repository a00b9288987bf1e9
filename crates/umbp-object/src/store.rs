//! The object stores: S3 over presigned requests (`rusty-s3` signs, `ureq` sends, both
//! synchronous: no async runtime), and a local directory. Every request is bounded (one request's
//! timeout, a deadline over its retries) and retried with backoff when the failure is transient:
//! HTTP 5xx, 429 or 408, a refused, reset or timed-out connection.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rusty_s3::{Bucket, S3Action, UrlStyle};
use umbp_core::ErrorKind;

use crate::config::{Credentials, ObjectConfig, ObjectUrl};

/// How long a presigned request stays valid (it is sent at once; this covers clock skew).
const SIGN_FOR: Duration = Duration::from_secs(300);

/// A store request that failed; each message says what was asked and what to check.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The object does not exist (deleted, never written, or the store lost it).
    #[error("{op} {name}: no such object")]
    NotFound {
        /// The request.
        op: &'static str,
        /// The object.
        name: String,
    },
    /// The store answered with an error status.
    #[error("{op} {name}: the store answered HTTP {status} {detail}; {hint}")]
    Status {
        /// The request.
        op: &'static str,
        /// The object (or bucket).
        name: String,
        /// The HTTP status.
        status: u16,
        /// The start of the error body (S3's error code and message).
        detail: String,
        /// What to check.
        hint: &'static str,
    },
    /// The store could not be reached or the exchange broke off.
    #[error("{op} {name}: could not reach the store at {endpoint}: {source}; is it up, and is the endpoint right?")]
    Transport {
        /// The request.
        op: &'static str,
        /// The object.
        name: String,
        /// The endpoint.
        endpoint: String,
        /// What the HTTP client said.
        #[source]
        source: Box<ureq::Error>,
    },
    /// A local-directory store's file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The request.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The request was never sent: the medium is shutting down, or the caller's deadline passed
    /// while it waited for a worker.
    #[error("{op} {name}: not sent ({why})")]
    Skipped {
        /// The request.
        op: &'static str,
        /// The object.
        name: String,
        /// Why not.
        why: &'static str,
    },
    /// A listing the store sent could not be read.
    #[error("list {prefix:?}: the store's answer is not a ListObjectsV2 result: {why}")]
    Listing {
        /// The prefix listed.
        prefix: String,
        /// The parser's message.
        why: String,
    },
}

impl StoreError {
    /// Whether the same request may succeed if sent again shortly.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            Self::Transport { source, .. } => matches!(
                **source,
                ureq::Error::Io(_) | ureq::Error::Timeout(_) | ureq::Error::ConnectionFailed | ureq::Error::Protocol(_)
            ),
            Self::NotFound { .. } | Self::Io { .. } | Self::Listing { .. } | Self::Skipped { .. } => false,
        }
    }

    /// What the caller should do next.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::NotFound { .. } => ErrorKind::InvalidInput,
            _ if self.is_transient() => ErrorKind::Unavailable,
            Self::Status { status: 401 | 403 | 404, .. } => ErrorKind::InvalidInput,
            Self::Status { .. } | Self::Io { .. } | Self::Transport { .. } => ErrorKind::Unavailable,
            Self::Skipped { .. } => ErrorKind::Closed,
            Self::Listing { .. } => ErrorKind::Internal,
        }
    }
}

fn hint(status: u16) -> &'static str {
    match status {
        401 | 403 => "check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION and the bucket's policy",
        404 => "does the bucket exist? create it, or start the node with create_bucket (--object-create-bucket)",
        s if s >= 500 || s == 429 => "the store is failing or throttling; the request was retried with backoff",
        _ => "the request was refused",
    }
}

/// One object store. Every method blocks its thread for at most about `deadline` (the retries stop
/// there) plus one request's timeout.
pub(crate) trait Store: Send + Sync + fmt::Debug {
    /// Writes `body` as object `name`, replacing any object of that name.
    fn put(&self, name: &str, body: &[u8], deadline: Instant) -> Result<(), StoreError>;
    /// Reads object `name` whole; `limit` caps the bytes accepted.
    fn get(&self, name: &str, limit: u64, deadline: Instant) -> Result<Vec<u8>, StoreError>;
    /// Reads the first `len` bytes of object `name` (fewer when it is shorter).
    fn get_head(&self, name: &str, len: u64, deadline: Instant) -> Result<Vec<u8>, StoreError>;
    /// Deletes object `name`; deleting a missing object succeeds.
    fn delete(&self, name: &str, deadline: Instant) -> Result<(), StoreError>;
    /// Every object under `prefix`: name and size.
    fn list(&self, prefix: &str, deadline: Instant) -> Result<Vec<(String, u64)>, StoreError>;
    /// Makes sure the bucket (directory) exists, creating it when `create` is set.
    fn ensure_bucket(&self, create: bool, deadline: Instant) -> Result<(), StoreError>;
    /// Requests retried so far (for logs and tests).
    fn retries(&self) -> u64;
}

/// The retry policy shared by both stores.
#[derive(Debug)]
struct Retry {
    retries: u32,
    backoff: Duration,
    backoff_max: Duration,
    retried: AtomicU64,
}

impl Retry {
    /// Runs `f` until it succeeds, fails for good, runs out of retries or passes `deadline`.
    fn run<T>(&self, deadline: Instant, mut f: impl FnMut() -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut wait = self.backoff;
        let mut attempt = 0;
        loop {
            match f() {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() && attempt < self.retries => {
                    // Full jitter in [wait/2, wait): many workers failing at once do not retry in step.
                    let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
                    let pause = Duration::from_nanos(nanos / 2 + jitter() % (nanos / 2).max(1));
                    if Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    attempt += 1;
                    self.retried.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, attempt, ?pause, "object store request failed; retrying");
                    std::thread::sleep(pause);
                    wait = (wait * 2).min(self.backoff_max);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A cheap, thread-local pseudo-random number (for jitter only).
fn jitter() -> u64 {
    use std::cell::Cell;
    thread_local!(static STATE: Cell<u64> = const { Cell::new(0) });
    STATE.with(|s| {
        let mut x = s.get();
        if x == 0 {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos());
            x = (t as u64) | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

/// Builds the store `config` names.
pub(crate) fn open(config: &ObjectConfig) -> Result<Box<dyn Store>, StoreError> {
    let retry = Retry {
        retries: config.retries,
        backoff: config.backoff,
        backoff_max: config.backoff_max,
        retried: AtomicU64::new(0),
    };
    match (&config.url, &config.endpoint, &config.credentials) {
        (ObjectUrl::S3 { bucket, .. }, Some(endpoint), Some(credentials)) => {
            Ok(Box::new(S3Store::new(endpoint, bucket, &config.region, credentials, config, retry)?))
        }
        (ObjectUrl::File { dir }, _, _) => Ok(Box::new(FsStore { dir: dir.clone(), retry })),
        // `ObjectConfigBuilder::build` resolves both for every S3 URL.
        (ObjectUrl::S3 { bucket, .. }, _, _) => Err(StoreError::Status {
            op: "open",
            name: bucket.clone(),
            status: 0,
            detail: "without an endpoint or credentials".into(),
            hint: "build the configuration with ObjectConfig::builder",
        }),
    }
}

/// An S3-compatible store: path-style presigned requests over one pooled HTTP agent.
pub(crate) struct S3Store {
    bucket: Bucket,
    credentials: rusty_s3::Credentials,
    agent: ureq::Agent,
    endpoint: String,
    retry: Retry,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store").field("bucket", &self.bucket.name()).field("endpoint", &self.endpoint).finish()
    }
}

impl S3Store {
    fn new(
        endpoint: &url::Url,
        bucket: &str,
        region: &str,
        credentials: &Credentials,
        config: &ObjectConfig,
        retry: Retry,
    ) -> Result<Self, StoreError> {
        let bucket =
            Bucket::new(endpoint.clone(), UrlStyle::Path, bucket.to_owned(), region.to_owned()).map_err(|e| {
                StoreError::Status {
                    op: "open",
                    name: bucket.to_owned(),
                    status: 0,
                    detail: format!("({e:?})"),
                    hint: "the endpoint must be http://host[:port]",
                }
            })?;
        let credentials = match &credentials.token {
            Some(t) => rusty_s3::Credentials::new_with_token(&credentials.key, &credentials.secret, t),
            None => rusty_s3::Credentials::new(&credentials.key, &credentials.secret),
        };
        let agent = ureq::Agent::config_builder()
            // Statuses are answers to classify (404, 503), not transport errors.
            .http_status_as_error(false)
            .timeout_global(Some(config.request_timeout))
            .max_idle_connections(config.io_threads * 2)
            .max_idle_connections_per_host(config.io_threads * 2)
            .build()
            .new_agent();
        Ok(Self { bucket, credentials, agent, endpoint: endpoint.to_string(), retry })
    }

    fn transport(&self, op: &'static str, name: &str, e: ureq::Error) -> StoreError {
        StoreError::Transport { op, name: name.to_owned(), endpoint: self.endpoint.clone(), source: Box::new(e) }
    }

    /// Turns a response into its body, or into the error its status means.
    fn answer(
        &self,
        op: &'static str,
        name: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
        limit: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let mut response = response.map_err(|e| self.transport(op, name, e))?;
        let status = response.status().as_u16();
        let body = response.body_mut().with_config().limit(limit.max(4096)).read_to_vec();
        match status {
            200..=299 => body.map_err(|e| self.transport(op, name, e)),
            404 => Err(StoreError::NotFound { op, name: name.to_owned() }),
            _ => {
                let text =
                    body.map(|b| String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned()).unwrap_or_default();
                Err(StoreError::Status { op, name: name.to_owned(), status, detail: text, hint: hint(status) })
            }
        }
    }
}

impl Store for S3Store {
    fn put(&self, name: &str, body: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let url = self.bucket.put_object(Some(&self.credentials), name).sign(SIGN_FOR);
        self.retry.run(deadline, || self.answer("put", name, self.agent.put(url.as_str()).send(body), 4096).map(drop))
    }

    fn get(&self, name: &str, limit: u64, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        let url = self.bucket.get_object(Some(&self.credentials), name).sign(SIGN_FOR);
        self.retry.run(deadline, || self.answer("get", name, self.agent.get(url.as_str()).call(), limit))
    }

    fn get_head(&self, name: &str, len: u64, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        let url = self.bucket.get_object(Some(&self.credentials), name).sign(SIGN_FOR);
        let range = format!("bytes=0-{}", len.saturating_sub(1));
        self.retry.run(deadline, || {
            let r = self.agent.get(url.as_str()).header("range", &range).call();
            // A store that ignores Range sends the whole object: keep the head only.
            self.answer("get", name, r, u64::MAX).map(|mut b| {
                b.truncate(usize::try_from(len).unwrap_or(usize::MAX));
                b
            })
        })
    }

    fn delete(&self, name: &str, deadline: Instant) -> Result<(), StoreError> {
        let url = self.bucket.delete_object(Some(&self.credentials), name).sign(SIGN_FOR);
        self.retry.run(deadline, || match self.answer("delete", name, self.agent.delete(url.as_str()).call(), 4096) {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        })
    }

    fn list(&self, prefix: &str, deadline: Instant) -> Result<Vec<(String, u64)>, StoreError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut action = self.bucket.list_objects_v2(Some(&self.credentials));
            action.with_prefix(prefix);
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(SIGN_FOR);
            let body = self
                .retry
                .run(deadline, || self.answer("list", prefix, self.agent.get(url.as_str()).call(), 64 << 20))?;
            let text = String::from_utf8_lossy(&body);
            let page = rusty_s3::actions::ListObjectsV2::parse_response(&text)
                .map_err(|e| StoreError::Listing { prefix: prefix.to_owned(), why: e.to_string() })?;
            out.extend(page.contents.into_iter().map(|c| (c.key, c.size.unwrap_or(0))));
            match page.next_continuation_token {
                Some(t) if Instant::now() < deadline => token = Some(t),
                Some(_) => {
                    return Err(StoreError::Listing {
                        prefix: prefix.to_owned(),
                        why: "the listing outlasted its deadline".into(),
                    });
                }
                None => return Ok(out),
            }
        }
    }

    fn ensure_bucket(&self, create: bool, deadline: Instant) -> Result<(), StoreError> {
        let name = self.bucket.name().to_owned();
        let url = self.bucket.head_bucket(Some(&self.credentials)).sign(SIGN_FOR);
        let found =
            self.retry.run(deadline, || self.answer("head bucket", &name, self.agent.head(url.as_str()).call(), 4096));
        match found {
            Ok(_) => Ok(()),
            Err(StoreError::NotFound { .. }) if create => {
                let action = self.bucket.create_bucket(&self.credentials);
                let url = action.sign(SIGN_FOR);
                let body = action.body();
                self.retry.run(deadline, || {
                    match self.answer("create bucket", &name, self.agent.put(url.as_str()).send(body.as_str()), 4096) {
                        // Created meanwhile by another node: fine.
                        Err(StoreError::Status { status: 409, .. }) | Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    }
                })
            }
            Err(StoreError::NotFound { op, name }) => {
                Err(StoreError::Status { op, name, status: 404, detail: "NoSuchBucket".into(), hint: hint(404) })
            }
            Err(e) => Err(e),
        }
    }

    fn retries(&self) -> u64 {
        self.retry.retried.load(Ordering::Relaxed)
    }
}

/// A local directory: one file per object, written to a temporary name and renamed, so a reader
/// never sees half an object.
#[derive(Debug)]
pub(crate) struct FsStore {
    dir: PathBuf,
    retry: Retry,
}

impl FsStore {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

fn fs_err(op: &'static str, path: &Path, source: io::Error) -> StoreError {
    StoreError::Io { op, path: path.to_owned(), source }
}

impl Store for FsStore {
    fn put(&self, name: &str, body: &[u8], _deadline: Instant) -> Result<(), StoreError> {
        let path = self.path(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, body).map_err(|e| fs_err("put", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| fs_err("put", &path, e))
    }

    fn get(&self, name: &str, limit: u64, _deadline: Instant) -> Result<Vec<u8>, StoreError> {
        let path = self.path(name);
        match std::fs::read(&path) {
            Ok(b) if b.len() as u64 <= limit => Ok(b),
            Ok(b) => Err(fs_err("get", &path, io::Error::other(format!("{} bytes, more than {limit}", b.len())))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(StoreError::NotFound { op: "get", name: name.to_owned() })
            }
            Err(e) => Err(fs_err("get", &path, e)),
        }
    }

    fn get_head(&self, name: &str, len: u64, _deadline: Instant) -> Result<Vec<u8>, StoreError> {
        use std::io::Read as _;
        let path = self.path(name);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound { op: "get", name: name.to_owned() });
            }
            Err(e) => return Err(fs_err("get", &path, e)),
        };
        let mut out = Vec::new();
        file.take(len).read_to_end(&mut out).map_err(|e| fs_err("get", &path, e))?;
        Ok(out)
    }

    fn delete(&self, name: &str, _deadline: Instant) -> Result<(), StoreError> {
        let path = self.path(name);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(fs_err("delete", &path, e)),
        }
    }

    fn list(&self, prefix: &str, _deadline: Instant) -> Result<Vec<(String, u64)>, StoreError> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(|e| fs_err("list", &self.dir, e))? {
            let entry = entry.map_err(|e| fs_err("list", &self.dir, e))?;
            let Ok(name) = entry.file_name().into_string() else { continue };
            if name.starts_with(prefix) && !name.starts_with('.') {
                let len = entry.metadata().map_err(|e| fs_err("list", &entry.path(), e))?.len();
                out.push((name, len));
            }
        }
        Ok(out)
    }

    fn ensure_bucket(&self, create: bool, _deadline: Instant) -> Result<(), StoreError> {
        if create {
            std::fs::create_dir_all(&self.dir).map_err(|e| fs_err("create", &self.dir, e))?;
        }
        match std::fs::metadata(&self.dir) {
            Ok(m) if m.is_dir() => Ok(()),
            Ok(_) => Err(fs_err("open", &self.dir, io::Error::other("not a directory"))),
            Err(e) => Err(fs_err("open", &self.dir, e)),
        }
    }

    fn retries(&self) -> u64 {
        self.retry.retried.load(Ordering::Relaxed)
    }
}
