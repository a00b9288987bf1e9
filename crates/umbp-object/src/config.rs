//! What an object medium is built from: where the store is ([`ObjectUrl`], the endpoint and the
//! credentials), the staging arena, and the bounds on its IO (threads, timeouts, retries).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{Clock, SystemClock};

use crate::record::{MAX_PREFIX_LEN, Name};

/// Where the values live: a bucket and a prefix of an S3-compatible store, or a local directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectUrl {
    /// `s3://bucket/prefix`: objects named `prefix/…` in `bucket`.
    S3 {
        /// The bucket.
        bucket: String,
        /// The prefix every object name starts with: empty, or ending in `/`.
        prefix: String,
    },
    /// `file:///dir`: one file per object in `dir` (a local stand-in, and a shared file system).
    File {
        /// The directory.
        dir: PathBuf,
    },
}

impl ObjectUrl {
    /// Parses `s3://bucket[/prefix]` or `file:///absolute/dir`.
    ///
    /// ```
    /// use umbp_object::ObjectUrl;
    ///
    /// let url = ObjectUrl::parse("s3://kvc/cache/node-1")?;
    /// assert_eq!(url, ObjectUrl::S3 { bucket: "kvc".into(), prefix: "cache/node-1/".into() });
    /// assert!(ObjectUrl::parse("gs://kvc").is_err());
    /// # Ok::<(), umbp_object::ObjectConfigError>(())
    /// ```
    pub fn parse(url: &str) -> Result<Self, ObjectConfigError> {
        let bad = |why: &str| ObjectConfigError::Url { url: url.to_owned(), why: why.to_owned() };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let valid_bucket = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
            if !valid_bucket {
                return Err(bad("the bucket name must be 3 to 63 lower-case letters, digits, '-' or '.'"));
            }
            let prefix = prefix.trim_matches('/');
            if prefix.len() > MAX_PREFIX_LEN {
                return Err(bad(&format!("the prefix is longer than {MAX_PREFIX_LEN} bytes")));
            }
            let prefix = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
            return Ok(Self::S3 { bucket: bucket.to_owned(), prefix });
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(bad("a file URL names an absolute directory: file:///dir"));
            }
            return Ok(Self::File { dir: PathBuf::from(path) });
        }
        Err(bad("expected s3://bucket/prefix or file:///dir"))
    }

    /// The prefix object names carry in the store (files carry none: the directory is the prefix).
    pub(crate) fn prefix(&self) -> &str {
        match self {
            Self::S3 { prefix, .. } => prefix,
            Self::File { .. } => "",
        }
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Self::File { dir } => write!(f, "file://{}", dir.display()),
        }
    }
}

/// An access key pair (and session token) for the store.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id.
    pub key: String,
    /// The secret access key.
    pub secret: String,
    /// A session token (temporary credentials).
    pub token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("Credentials").field("key", &self.key).finish_non_exhaustive()
    }
}

impl Credentials {
    /// From the AWS convention's variables: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, if
    /// set, `AWS_SESSION_TOKEN`; `None` when either of the first two is missing or empty.
    pub fn from_env() -> Option<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Some(Self {
            key: var("AWS_ACCESS_KEY_ID")?,
            secret: var("AWS_SECRET_ACCESS_KEY")?,
            token: var("AWS_SESSION_TOKEN"),
        })
    }
}

/// The region of the AWS convention: `AWS_REGION`, else `AWS_DEFAULT_REGION`, else `us-east-1`.
pub fn region_from_env() -> String {
    ["AWS_REGION", "AWS_DEFAULT_REGION"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|r| !r.is_empty()))
        .unwrap_or_else(|| "us-east-1".to_owned())
}

/// A configuration that can never work; each message names the setting and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectConfigError {
    /// The store URL is not one this medium reads.
    #[error("object url {url:?}: {why}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// An S3 URL without an endpoint to send requests to.
    #[error(
        "object url {url}: no endpoint: give one (--object-endpoint http://HOST:PORT, node.object.endpoint, \
         AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)"
    )]
    NoEndpoint {
        /// The URL.
        url: String,
    },
    /// The endpoint is not a plain `http://host[:port]` URL.
    #[error("object endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// An S3 URL and no credentials.
    #[error("object url {url}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")]
    NoCredentials {
        /// The URL.
        url: String,
    },
    /// A size, count or duration out of its range.
    #[error("object medium: {0}")]
    Invalid(String),
}

impl ObjectConfigError {
    /// What the caller should do: fix the configuration.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        umbp_core::ErrorKind::InvalidInput
    }
}

/// The operator's settings of an object medium (the `[node.object]` table of `umbp node`'s file and
/// its flags); everything else of [`ObjectConfig`] keeps its default. Sizes read `"32GiB"` or
/// bytes, durations `"3s"`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObjectSettings {
    /// `s3://bucket/prefix` or `file:///dir`. Required.
    pub url: Option<String>,
    /// The S3 endpoint, `http://host:port` (path-style requests). Default: `AWS_ENDPOINT_URL_S3`,
    /// else `AWS_ENDPOINT_URL`.
    pub endpoint: Option<String>,
    /// Bytes of the store this node lends. Default: 32 GiB.
    #[serde(with = "umbp_core::units::serde::size")]
    pub capacity_bytes: u64,
    /// Pages of the host staging arena (uploads in flight plus reads being served). Default: 128.
    pub staging_pages: u64,
    /// The largest value, in pages; at most `staging_pages`. Default: 1.
    pub max_value_pages: u64,
    /// The read lease of a staged copy. Default: 3 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub read_lease: Duration,
    /// Requests to the store at once (the worker threads). Default: 16.
    pub io_threads: usize,
    /// How long a commit or a resolve waits for its store requests (retries included) before it
    /// answers failed or busy: below the peers' RPC deadline (5 s by default), so a slow store is a
    /// failed commit the writer hears about, not a timed-out RPC. Default: 4 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub op_timeout: Duration,
    /// Retries of a request the store failed transiently (5xx, 429, a lost connection). Default: 4.
    pub retries: u32,
    /// Create the bucket at start when it does not exist. Default: false.
    pub create_bucket: bool,
    /// Keep a committed value's staging pages as a clean copy until they are wanted, so a read of
    /// a value just written downloads nothing. Default: true.
    pub cache_committed: bool,
}

impl Default for ObjectSettings {
    fn default() -> Self {
        Self {
            url: None,
            endpoint: None,
            capacity_bytes: 32 << 30,
            staging_pages: 128,
            max_value_pages: 1,
            read_lease: Duration::from_secs(3),
            io_threads: 16,
            op_timeout: Duration::from_secs(4),
            retries: 4,
            create_bucket: false,
            cache_committed: true,
        }
    }
}

impl ObjectSettings {
    /// A builder with pages of `page_size` and these settings (credentials and region from the
    /// environment; every other setting at its default).
    pub fn builder(&self, page_size: u64) -> ObjectConfigBuilder {
        let mut b = ObjectConfig::builder(self.url.as_deref().unwrap_or_default())
            .page_size(page_size)
            .capacity_bytes(self.capacity_bytes)
            .staging_pages(self.staging_pages)
            .max_value_pages(self.max_value_pages)
            .read_lease_ttl(self.read_lease)
            .io_threads(self.io_threads)
            .op_timeout(self.op_timeout)
            .retries(self.retries)
            .create_bucket(self.create_bucket)
            .cache_committed(self.cache_committed);
        if let Some(e) = &self.endpoint {
            b = b.endpoint(e);
        }
        b
    }

    /// Checks these settings with pages of `page_size`, the environment's part included (an S3
    /// URL needs an endpoint and credentials).
    pub fn validate(&self, page_size: u64) -> Result<(), ObjectConfigError> {
        self.builder(page_size).build().map(drop)
    }

    /// Checks what these settings say themselves (the URL, the endpoint's form, sizes, counts,
    /// durations) with pages of `page_size`, leaving out what the environment supplies when the
    /// medium starts (credentials, and an endpoint from `AWS_ENDPOINT_URL*`): a command line can
    /// be checked on a machine that holds no credentials.
    pub fn check(&self, page_size: u64) -> Result<(), ObjectConfigError> {
        let placeholder = Credentials { key: "check".into(), secret: "check".into(), token: None };
        let mut b = self.builder(page_size).credentials(placeholder);
        if self.endpoint.is_none() {
            b = b.endpoint("http://endpoint.from.environment");
        }
        b.build().map(drop)
    }
}

/// An object medium's configuration; built with [`ObjectConfig::builder`].
#[derive(Debug, Clone)]
pub struct ObjectConfig {
    pub(crate) url: ObjectUrl,
    /// The S3 endpoint's base URL (S3 only).
    pub(crate) endpoint: Option<url::Url>,
    pub(crate) region: String,
    pub(crate) credentials: Option<Credentials>,
    pub(crate) page_size: u64,
    pub(crate) capacity_bytes: u64,
    pub(crate) staging_pages: u64,
    pub(crate) max_value_pages: u64,
    pub(crate) pending_ttl: Duration,
    pub(crate) read_lease_ttl: Duration,
    pub(crate) reaper_interval: Duration,
    pub(crate) io_threads: usize,
    pub(crate) op_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) retries: u32,
    pub(crate) backoff: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) create_bucket: bool,
    pub(crate) cache_committed: bool,
    pub(crate) recover: bool,
    pub(crate) recover_timeout: Duration,
    pub(crate) clock: Arc<dyn Clock>,
}

impl ObjectConfig {
    /// A builder for the store at `url` (`s3://bucket/prefix` or `file:///dir`), every other
    /// setting at its default.
    pub fn builder(url: impl Into<String>) -> ObjectConfigBuilder {
        let s = ObjectSettings::default();
        ObjectConfigBuilder {
            url: url.into(),
            endpoint: None,
            region: None,
            credentials: None,
            page_size: 2 << 20,
            capacity_bytes: s.capacity_bytes,
            staging_pages: s.staging_pages,
            max_value_pages: s.max_value_pages,
            pending_ttl: Duration::from_secs(30),
            read_lease_ttl: s.read_lease,
            reaper_interval: Duration::from_millis(100),
            io_threads: s.io_threads,
            op_timeout: s.op_timeout,
            request_timeout: Duration::from_secs(3),
            retries: s.retries,
            backoff: Duration::from_millis(20),
            backoff_max: Duration::from_secs(1),
            create_bucket: s.create_bucket,
            cache_committed: s.cache_committed,
            recover: true,
            recover_timeout: Duration::from_secs(600),
            clock: SystemClock::shared(),
        }
    }

    /// The store's URL.
    pub fn url(&self) -> &ObjectUrl {
        &self.url
    }

    /// The page size.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Bytes of the store this medium lends.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// The pending-slot TTL.
    pub fn pending_ttl(&self) -> Duration {
        self.pending_ttl
    }

    /// The read lease.
    pub fn read_lease_ttl(&self) -> Duration {
        self.read_lease_ttl
    }
}

/// Builds an [`ObjectConfig`]; [`build`](Self::build) checks it.
#[derive(Debug, Clone)]
#[must_use]
pub struct ObjectConfigBuilder {
    url: String,
    endpoint: Option<String>,
    region: Option<String>,
    credentials: Option<Credentials>,
    page_size: u64,
    capacity_bytes: u64,
    staging_pages: u64,
    max_value_pages: u64,
    pending_ttl: Duration,
    read_lease_ttl: Duration,
    reaper_interval: Duration,
    io_threads: usize,
    op_timeout: Duration,
    request_timeout: Duration,
    retries: u32,
    backoff: Duration,
    backoff_max: Duration,
    create_bucket: bool,
    cache_committed: bool,
    recover: bool,
    recover_timeout: Duration,
    clock: Arc<dyn Clock>,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty,)*) => {
        $($(#[$doc])* pub fn $name(mut self, v: $ty) -> Self { self.$name = v; self })*
    };
}

impl ObjectConfigBuilder {
    setters! {
        /// Bytes per staging page; a power of two of at least 4 KiB. Default: 2 MiB.
        page_size: u64,
        /// Bytes of the store lent (admission counts page-rounded values). Default: 32 GiB.
        capacity_bytes: u64,
        /// Pages of the staging arena. Default: 128.
        staging_pages: u64,
        /// The largest value, in pages (`1..=staging_pages`). Default: 1.
        max_value_pages: u64,
        /// How long an allocated slot waits for its commit. Default: 30 s.
        pending_ttl: Duration,
        /// How long a resolve's hit protects its staged copy. Default: 3 s.
        read_lease_ttl: Duration,
        /// How often the reaper thread expires slots and leases. Default: 100 ms.
        reaper_interval: Duration,
        /// Store requests at once (worker threads). Default: 16.
        io_threads: usize,
        /// How long a commit or resolve waits for its requests, retries included. Default: 4 s.
        op_timeout: Duration,
        /// One request's limit (connect to last byte). Default: 3 s.
        request_timeout: Duration,
        /// Retries of a transient failure. Default: 4.
        retries: u32,
        /// The first retry's wait (doubling, with jitter). Default: 20 ms.
        backoff: Duration,
        /// The longest wait between retries. Default: 1 s.
        backoff_max: Duration,
        /// Create the bucket at `init` if it does not exist. Default: false.
        create_bucket: bool,
        /// Keep committed values' pages as clean cached copies. Default: true.
        cache_committed: bool,
        /// Re-index what the prefix holds at `init`. Default: true (off: start empty, and leave
        /// what is there alone).
        recover: bool,
        /// How long `init` may take to list the prefix and check the objects' heads (each request
        /// still bounded by `request_timeout`). Default: 10 min.
        recover_timeout: Duration,
        /// Where TTLs and leases read the time. Default: the system clock.
        clock: Arc<dyn Clock>,
    }

    /// The S3 endpoint, `http://host[:port]`. Default: `AWS_ENDPOINT_URL_S3`, else
    /// `AWS_ENDPOINT_URL`.
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// The region requests are signed for. Default: [`region_from_env`].
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// The credentials. Default: [`Credentials::from_env`].
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Checks every setting and resolves the environment's defaults.
    pub fn build(self) -> Result<ObjectConfig, ObjectConfigError> {
        let invalid = |m: String| Err(ObjectConfigError::Invalid(m));
        let url = ObjectUrl::parse(&self.url)?;
        if !self.page_size.is_power_of_two() || self.page_size < 4096 {
            return invalid(format!("page_size {} must be a power of two of at least 4096", self.page_size));
        }
        if self.staging_pages == 0 || self.staging_pages > u64::from(u32::MAX) {
            return invalid(format!("staging_pages {} must be in 1..=2^32-1", self.staging_pages));
        }
        if !(1..=self.staging_pages).contains(&self.max_value_pages) {
            return invalid(format!(
                "max_value_pages {} must be in 1..=staging_pages ({}): a value is staged whole",
                self.max_value_pages, self.staging_pages
            ));
        }
        if self.capacity_bytes < self.page_size {
            return invalid(format!(
                "capacity_bytes {} is less than one page ({})",
                self.capacity_bytes, self.page_size
            ));
        }
        if self.staging_pages.checked_mul(self.page_size).is_none_or(|b| usize::try_from(b).is_err()) {
            return invalid("staging_pages * page_size overflows this address space".into());
        }
        if !(1..=1024).contains(&self.io_threads) {
            return invalid(format!("io_threads {} must be in 1..=1024", self.io_threads));
        }
        for (name, d) in [
            ("op_timeout", self.op_timeout),
            ("request_timeout", self.request_timeout),
            ("pending_ttl", self.pending_ttl),
            ("read_lease", self.read_lease_ttl),
            ("reaper_interval", self.reaper_interval),
        ] {
            if d.is_zero() {
                return invalid(format!("{name} must be more than 0"));
            }
        }
        let (endpoint, credentials) = match &url {
            ObjectUrl::File { .. } => (None, None),
            ObjectUrl::S3 { .. } => {
                let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
                let raw = self
                    .endpoint
                    .or_else(|| var("AWS_ENDPOINT_URL_S3"))
                    .or_else(|| var("AWS_ENDPOINT_URL"))
                    .ok_or_else(|| ObjectConfigError::NoEndpoint { url: url.to_string() })?;
                let bad = |why: &str| ObjectConfigError::Endpoint { endpoint: raw.clone(), why: why.to_owned() };
                let parsed = url::Url::parse(&raw).map_err(|e| bad(&e.to_string()))?;
                if parsed.scheme() != "http" {
                    return Err(bad(
                        "only http:// endpoints are supported (no TLS in this build: put the store on a trusted \
                         network or behind a local TLS-terminating proxy)",
                    ));
                }
                if parsed.host_str().is_none() {
                    return Err(bad("no host"));
                }
                let credentials = self
                    .credentials
                    .or_else(Credentials::from_env)
                    .ok_or_else(|| ObjectConfigError::NoCredentials { url: url.to_string() })?;
                (Some(parsed), Some(credentials))
            }
        };
        // A name the medium writes must parse back (guards the prefix rules above).
        debug_assert!(Name::parse(url.prefix(), &Name::render(url.prefix(), "k", 1)).is_some());
        Ok(ObjectConfig {
            url,
            endpoint,
            region: self.region.unwrap_or_else(region_from_env),
            credentials,
            page_size: self.page_size,
            capacity_bytes: self.capacity_bytes,
            staging_pages: self.staging_pages,
            max_value_pages: self.max_value_pages,
            pending_ttl: self.pending_ttl,
            read_lease_ttl: self.read_lease_ttl,
            reaper_interval: self.reaper_interval,
            io_threads: self.io_threads,
            op_timeout: self.op_timeout,
            request_timeout: self.request_timeout,
            retries: self.retries,
            backoff: self.backoff,
            backoff_max: self.backoff_max.max(self.backoff),
            create_bucket: self.create_bucket,
            cache_committed: self.cache_committed,
            recover: self.recover,
            recover_timeout: self.recover_timeout,
            clock: self.clock,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> Credentials {
        Credentials { key: "k".into(), secret: "s".into(), token: None }
    }

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        assert_eq!(
            ObjectUrl::parse("s3://bkt").ok(),
            Some(ObjectUrl::S3 { bucket: "bkt".into(), prefix: String::new() })
        );
        assert_eq!(
            ObjectUrl::parse("s3://bkt/a/b/").ok(),
            Some(ObjectUrl::S3 { bucket: "bkt".into(), prefix: "a/b/".into() })
        );
        assert_eq!(ObjectUrl::parse("file:///tmp/x").ok(), Some(ObjectUrl::File { dir: "/tmp/x".into() }));
        for bad in ["s3://B", "s3://ab", "file://rel", "http://x", ""] {
            let e = ObjectUrl::parse(bad).expect_err(bad);
            assert!(matches!(e, ObjectConfigError::Url { .. }), "{bad}: {e}");
        }
        assert!(ObjectUrl::parse(&format!("s3://bkt/{}", "p".repeat(MAX_PREFIX_LEN + 1))).is_err());
    }

    #[test]
    fn build_checks_every_setting_and_names_it() {
        let ok =
            || ObjectConfig::builder("s3://bkt/p").endpoint("http://127.0.0.1:9").credentials(creds()).page_size(4096);
        let c = ok().build().expect("valid");
        assert_eq!(c.endpoint.as_ref().map(url::Url::as_str), Some("http://127.0.0.1:9/"));
        let cases: Vec<(ObjectConfigBuilder, &str)> = vec![
            (ok().page_size(1000), "page_size"),
            (ok().staging_pages(0), "staging_pages"),
            (ok().max_value_pages(200), "max_value_pages"),
            (ok().capacity_bytes(1), "capacity_bytes"),
            (ok().io_threads(0), "io_threads"),
            (ok().op_timeout(Duration::ZERO), "op_timeout"),
            (ok().endpoint("https://s3.example.com"), "only http://"),
            (ok().endpoint("not a url"), "endpoint"),
        ];
        for (b, want) in cases {
            let e = b.build().expect_err(want);
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        // A file store needs neither endpoint nor credentials.
        ObjectConfig::builder("file:///tmp/x").page_size(4096).build().expect("file store");
    }

    #[test]
    fn settings_read_their_file_form() {
        let s: ObjectSettings =
            serde_json::from_str(r#"{"url": "s3://bkt/p", "capacity_bytes": "1MiB", "op_timeout": "2s"}"#)
                .expect("settings");
        assert_eq!(s.url.as_deref(), Some("s3://bkt/p"));
        assert_eq!((s.capacity_bytes, s.op_timeout, s.staging_pages), (1 << 20, Duration::from_secs(2), 128));
        assert!(serde_json::from_str::<ObjectSettings>(r#"{"bogus": 1}"#).is_err(), "unknown fields are refused");
        // `check` needs no credentials and no endpoint, and still refuses what is wrong in itself.
        s.check(4096).expect("a valid s3 url");
        let bad = ObjectSettings { staging_pages: 0, ..s.clone() };
        assert!(bad.check(4096).is_err_and(|e| e.to_string().contains("staging_pages")));
        let https = ObjectSettings { endpoint: Some("https://x".into()), ..s };
        assert!(https.check(4096).is_err_and(|e| e.to_string().contains("only http://")));
    }
}
