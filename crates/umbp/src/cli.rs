//! The command line of `umbp`, as clap derive types.
//!
//! Every flag is an `Option`: absent means "not set on the command line", so the layers below it (the
//! `UMBP_*` environment, then the TOML file, then the built-in default) can decide. Clap therefore
//! does not print defaults by itself; each flag's help states its default and its environment
//! variable, and `tests/cli_help.rs` checks them against the real defaults.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use umbp_master::routing::{Affinity, SelectAlgo};

use crate::units::{parse_duration, parse_size};

/// The TOML file's shape, printed at the end of `umbp --help`.
pub const CONFIG_FILE_HELP: &str = "\
CONFIGURATION
  Each setting is taken from, in increasing precedence: the built-in default, the TOML file
  (--config FILE or UMBP_CONFIG), the UMBP_* environment variables, the command-line flags.
  Sizes are written 4096, 512KiB, 64MiB, 4GiB; durations 250us, 500ms, 5s, 2m.
  Every key of the file is optional; an unknown key is an error. Each table is one component's
  settings. The whole shape, with defaults:

    master_address = \"127.0.0.1:50051\"  # the master, or masters: \"a:50051,b:50051\"
    cluster_token  = \"…\"                # guards gRPC and the data port (default: none)

    [master]
    listen = \"127.0.0.1:50051\"
    heartbeat_ttl = \"10s\"               # nodes heartbeat every heartbeat_ttl / divisor
    heartbeat_interval_divisor = 2
    max_missed_heartbeats = 3           # silent for ttl * this: the node expires
    reaper_interval = \"5s\"
    expired_retention = \"5m\"          # an expired node stays listed this long, then is removed
    route_put_algo = \"most_available\"   # or \"random\"
    route_put_affinity = \"none\"         # or \"same\", \"local\"
    index_shards = 32
    shutdown_deadline = \"3s\"
    max_message_bytes = \"64MiB\"
    metrics_addr = \"127.0.0.1:9091\"   # serve Prometheus /metrics here (default: none)
    metadata = \"redis://127.0.0.1:6379/0\"   # keep the metadata in Redis (default: this process's memory)

    [master.eviction]
    check_interval = \"5s\"
    high_watermark = 0.9
    low_watermark = 0.7
    lease_duration = \"2s\"              # the lease of a route-get
    evict_deadline = \"1s\"

    [node]
    node_id = \"n1\"                      # required for `umbp node`
    medium = \"dram\"                     # or \"ssd\", \"hbm\", \"cxl\", \"object\", \"none\"
    page_size = \"2MiB\"
    listen = \"127.0.0.1\"                # host of the peer service and the data server
    peer_port = 0                       # 0: any free port
    data_port = 0
    recache = \"16MiB\"                   # re-cache remote fetches: \"off\", \"always\" or a size cap
    read_lease = \"500ms\"
    pending_ttl = \"30s\"
    rpc_timeout = \"5s\"
    max_reroutes = 2
    bounce = \"64MiB\"                    # staging for caller memory that is not registered
    metrics_addr = \"127.0.0.1:9092\"   # serve Prometheus /metrics here (default: none)
    shared_memory = true                # same-host peers copy through mappings of the memory
    shared_memory_group = \"umbp\"        # also admit that group's processes (default: this user only)
    checksums = true                    # a CRC-32C with every value, checked on every read

    [node.dram]
    capacity_bytes = \"4GiB\"
    prefault = true                     # touch every page of the medium at start-up
    use_hugepages = false               # hugetlb pages
    transparent_hugepages = true        # advise transparent huge pages
    numa_node = 0                       # default: no binding

    [node.ssd]
    dirs = [\"/mnt/nvme0/umbp\"]        # an ssd node's directories, one per drive (required for ssd)
    capacity_bytes = \"32GiB\"          # drive bytes an ssd node lends
    io_engine = \"psync\"               # or \"io_uring\"
    staging_pages = 128                 # host staging pages (reads and writes in flight)
    max_value_pages = 1                 # largest value, in pages (at most staging_pages)
    read_lease = \"3s\"                 # the SSD read lease
    sync_interval = \"1s\"              # how often the log is fdatasynced, or \"off\" (shutdown only)
    create_dirs = false                 # create a missing directory (default: refuse to start)
    cache_committed = true              # keep a committed value's staging pages as a clean copy

    [node.hbm]
    device = 0                          # the GPU an hbm node lends
    capacity_bytes = \"1GiB\"           # device memory an hbm node lends
    runtime = \"auto\"                  # or \"cuda\", \"hip\", \"cudart\", \"fake\" (host memory, for tests)

    [node.cxl]
    path = \"/dev/dax0.0\"              # a cxl node's device-DAX device or file (required for cxl)
    capacity_bytes = \"1GiB\"           # bytes of it a cxl node lends

    [node.object]                       # credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
    url = \"s3://bucket/prefix\"        # an object node's store, or \"file:///dir\" (required for object)
    endpoint = \"http://127.0.0.1:9000\" # the S3 endpoint, path-style (default: AWS_ENDPOINT_URL_S3)
    capacity_bytes = \"32GiB\"          # bytes of the store an object node lends
    staging_pages = 128                 # host staging pages (uploads and reads in flight)
    max_value_pages = 1                 # largest value, in pages (at most staging_pages)
    read_lease = \"3s\"                 # the read lease of a staged copy
    io_threads = 16                     # requests to the store at once
    op_timeout = \"4s\"                 # how long a commit or read waits for the store
    retries = 4                         # retries of a 5xx, 429 or lost connection, with backoff
    create_bucket = false               # create a missing bucket at start
    cache_committed = true              # keep a committed value's staging pages as a clean copy

    [node.master]                       # the node's client of the master
    heartbeat_rpc_timeout = \"3s\"
    events_per_bundle = 1024
    max_bundles_per_rpc = 16
    auto_flush_event_threshold = 128
    shutdown_timeout = \"3s\"
    max_outbox_events = 1000000
    full_sync_chunk_events = 32768
    max_request_bytes = \"4MiB\"
    rpc_timeout = \"3s\"
    connect_timeout = \"3s\"
    clear_timeout = \"30s\"
    default_heartbeat_interval = \"5s\"
    max_message_bytes = \"64MiB\"

    [client]
    max_get_size = \"64MiB\"              # largest value `umbp get` accepts

  The flat keys of earlier files still read: node.capacity, node.prefault, node.hugepages,
  node.numa_node, node.ssd_max_value_pages (every node.ssd_*, node.hbm_*), master.route_get_lease,
  master.evict_deadline, master.eviction_check_interval, master.eviction_{high,low}_watermark.
  Every setting is also a flag of its command and a UMBP_* variable of the same stem.

ENVIRONMENT
  UMBP_CONFIG, UMBP_CLUSTER_TOKEN, UMBP_MASTER_ADDRESS; the node's UMBP_NODE_ID, UMBP_MEDIUM,
  UMBP_CAPACITY, UMBP_PAGE_SIZE, UMBP_NODE_ADDRESS, UMBP_PEER_SERVICE_PORT, UMBP_IO_ENGINE_PORT,
  UMBP_DRAM_PREFAULT, UMBP_DRAM_HUGEPAGES, UMBP_SSD_DIRS (comma-separated),
  UMBP_SSD_CAPACITY, UMBP_SSD_IO_ENGINE, UMBP_SSD_STAGING_PAGES, UMBP_SSD_MAX_VALUE_PAGES,
  UMBP_SSD_READ_LEASE_MS, UMBP_SSD_CREATE_DIRS, UMBP_SSD_CACHE_COMMITTED,
  UMBP_SSD_SYNC_INTERVAL (a duration or off),
  UMBP_CXL_PATH, UMBP_CXL_CAPACITY,
  UMBP_HBM_DEVICE, UMBP_HBM_CAPACITY, UMBP_HBM_RUNTIME, UMBP_GPU_RUNTIME=none (no GPU copy engine on a
  node that does not lend HBM), UMBP_CACHE_REMOTE_FETCHES, UMBP_DRAM_READ_LEASE_MS and the
  master client's UMBP_HEARTBEAT_* / UMBP_MASTER_RPC_TIMEOUT_MS; the master's UMBP_MASTER_LISTEN and
  UMBP_* timings (see `umbp master --help`). RUST_LOG filters the logs, which go to stderr
  (default: info for master and node; warn for the client commands and the demo).
  UMBP_MASTER_METRICS_ADDR and UMBP_NODE_METRICS_ADDR serve Prometheus /metrics (default: none).

EXIT STATUS
  0 success; 1 a key is missing (get, exists, rm); 2 bad usage or configuration (a bad setting, a
  port in use, a wrong token, a node id already running); 3 any other failure; 130 interrupted;
  141 stdout was closed by its reader (`umbp stat | head -1`).";

/// The master's environment, printed at the end of `umbp master --help`.
pub const MASTER_ENV_HELP: &str = "\
ENVIRONMENT (defaults in brackets; the flags above override them)
  UMBP_MASTER_LISTEN [127.0.0.1:50051]  UMBP_CLUSTER_TOKEN [none]
  UMBP_HEARTBEAT_TTL_SEC [10]  UMBP_HEARTBEAT_INTERVAL_DIVISOR [2]  UMBP_MAX_MISSED_HEARTBEATS [3]
  UMBP_REAPER_INTERVAL_SEC [5]  UMBP_EXPIRED_RETENTION_SEC [300]  UMBP_EVICTION_CHECK_INTERVAL_SEC [5]
  UMBP_EVICTION_HIGH_WATERMARK [0.9]  UMBP_EVICTION_LOW_WATERMARK [0.7]
  UMBP_LEASE_DURATION_SEC [2]  UMBP_EVICTKEY_DEADLINE_MS [1000]
  UMBP_ROUTE_PUT_SELECT_ALGO [most_available|random]  UMBP_ROUTE_PUT_NODE_AFFINITY [none|same|local]
  UMBP_MASTER_INDEX_SHARDS [32]  UMBP_GRPC_SHUTDOWN_DEADLINE_SEC [3]
  UMBP_MASTER_MAX_MESSAGE_BYTES [67108864]  UMBP_MASTER_METRICS_ADDR [none]

On start it prints one line to stdout: `master ready listen=HOST:PORT`, followed by
` metrics=HOST:PORT` when --metrics-addr is set.";

/// The node's ready line, printed at the end of `umbp node --help`.
pub const NODE_AFTER_HELP: &str = "\
On start it prints one line to stdout:
  node ID ready peer=HOST:PORT data=HOST:PORT medium=dram capacity=SIZE master=HOST:PORT
(followed by ` metrics=HOST:PORT` when --metrics-addr is set)
and runs until SIGINT or SIGTERM, then leaves the cluster (unregisters, releases its memory).";

/// What `umbp bench --help` adds after the flags.
pub const BENCH_AFTER_HELP: &str = "\
SUITE pool (the default) runs an embedded master on 127.0.0.1, a DRAM node in this process (local
rows), then a DRAM node in a child process (`umbp` re-executed) reached over the TCP data plane
(remote rows). Each PoolClient figure stands beside its same-run baseline (memcpy; a raw TCP stream
over as many connections) and their ratio.

SUITE ssd runs an embedded master and, per io engine and value size (1 MiB, 2 MiB; page size = value
size), an SSD node in this process whose log is in a fresh subdirectory of --ssd-dir: batch put and
batch get through PoolClient, beside raw O_DIRECT sequential writes and reads of the same bytes, in
value-sized requests, to a file in the same directory, in the same rounds (which side goes first
alternates). The node keeps no cached copy of a committed value, so every get reads the drive (the
bench checks the medium's counters: one drive read per key). The keys of every round stay stored,
so no eviction runs under the measurement. --ssd-dir must be on the drive to measure (O_DIRECT: not
tmpfs); the subdirectory is removed at the end. Progress goes to stderr, the table to stdout.

SUITE metadata runs an in-process master over gRPC with its index in memory, in one Redis, and
sharded over three Redis (redis-server processes started on free 127.0.0.1 ports, persistence off,
killed at the end; without redis-server only the memory row runs): heartbeat ingestion (8 nodes,
512 ADD events per heartbeat), then batch route-put and route-get (8 callers, batch 128), each for
--duration; then the Redis memory per key (--memory-keys keys of one node on one tier).

Build with --release for meaningful figures:
  cargo run --release -p umbp -- bench
  cargo run --release -p umbp -- bench ssd --ssd-dir /mnt/nvme0/umbp-bench
  cargo run --release -p umbp -- bench metadata";

/// `umbp`: the umbp-rs command line.
#[derive(Debug, Parser)]
#[command(
    name = "umbp",
    version,
    about = "umbp-rs: a distributed KV-cache buffer pool (master, nodes, client commands, demo)",
    long_about = "umbp-rs: a distributed KV-cache buffer pool.\n\nStart with `umbp demo`: a master and three \
                  DRAM nodes in one process, a verified put/get workload and a summary. For a real cluster run \
                  `umbp master`, then `umbp node` on each machine, then `umbp put`/`get`/`stat`. \
                  `umbp bench` measures batch put/get against memcpy and raw TCP.",
    after_long_help = CONFIG_FILE_HELP,
    propagate_version = true
)]
pub struct Cli {
    /// TOML configuration file (its shape: `umbp --help`) [env: UMBP_CONFIG] [default: none]
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Cluster token, required on every call and data connection when set (`ps` shows flags: prefer
    /// the environment or the file) [env: UMBP_CLUSTER_TOKEN] [default: none]
    #[arg(long, global = true, value_name = "TOKEN")]
    pub token: Option<String>,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once per process; boxing `NodeArgs` would only make every match on it clumsier.
#[expect(clippy::large_enum_variant, reason = "parsed once per process")]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the master (membership, key index, routing, eviction) until SIGINT/SIGTERM
    #[command(after_help = MASTER_ENV_HELP)]
    Master(MasterArgs),
    /// Run a node that lends one medium to the pool, until SIGINT/SIGTERM
    #[command(after_help = NODE_AFTER_HELP)]
    Node(NodeArgs),
    /// Write a value (a file, or stdin) under KEY; an existing KEY keeps its value unless --replace
    Put(PutArgs),
    /// Read the value of KEY into a file, or stdout
    Get(GetArgs),
    /// Say whether each KEY is in the pool (exit status 1 if any is missing)
    Exists(KeysArgs),
    /// Remove every replica of each KEY (a key a reader holds is retried for up to 10 s; exit status 1
    /// if a key is missing, 3 if one stayed held)
    Rm(KeysArgs),
    /// Show the cluster as the master sees it: nodes, liveness, capacity, keys
    Stat(StatArgs),
    /// Run a master and nodes in this process, put and get a verified workload, print a summary
    /// (ignores --config and --token)
    Demo(DemoArgs),
    /// Benchmark batch put/get (local, and to a node in a second process over TCP) beside memcpy and
    /// raw-socket baselines, plus single 64 KiB get latency; `bench ssd`: an SSD node beside raw
    /// O_DIRECT on the same directory. Prints a markdown table (ignores --config and --token)
    #[command(after_help = BENCH_AFTER_HELP)]
    Bench(BenchArgs),
    /// The child node of `umbp bench` (internal)
    #[command(hide = true)]
    BenchChild(BenchChildArgs),
    /// A client process of the chaos test (internal)
    #[command(hide = true)]
    ChaosClient(crate::chaos::ChaosClientArgs),
}

/// Flags of `umbp master`.
#[derive(Debug, Clone, Default, Args)]
pub struct MasterArgs {
    /// gRPC listen address; port 0 picks a free one [env: UMBP_MASTER_LISTEN] [default: 127.0.0.1:50051]
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Heartbeat TTL: nodes heartbeat every TTL / UMBP_HEARTBEAT_INTERVAL_DIVISOR (2)
    /// [env: UMBP_HEARTBEAT_TTL_SEC] [default: 10s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub heartbeat_ttl: Option<Duration>,
    /// A node silent for this many TTLs expires [env: UMBP_MAX_MISSED_HEARTBEATS] [default: 3]
    #[arg(long, value_name = "N")]
    pub max_missed_heartbeats: Option<u32>,
    /// How often silent nodes are expired [env: UMBP_REAPER_INTERVAL_SEC] [default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub reaper_interval: Option<Duration>,
    /// How long an expired node (or a client that never unregistered) stays listed in `umbp stat`
    /// before its record is removed; 0s removes it at expiry [env: UMBP_EXPIRED_RETENTION_SEC]
    /// [default: 5m]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub expired_retention: Option<Duration>,
    /// Put placement: most_available or random [env: UMBP_ROUTE_PUT_ALGO, UMBP_ROUTE_PUT_SELECT_ALGO]
    /// [default: most_available]
    #[arg(long, value_name = "ALGO")]
    pub route_put_algo: Option<SelectAlgo>,
    /// Put affinity: none, same or local. local places a node's puts on its own medium first, and lets
    /// that node write them there without asking the master (no route call; cross-node dedup is given
    /// up for those keys) [env: UMBP_ROUTE_PUT_AFFINITY, UMBP_ROUTE_PUT_NODE_AFFINITY] [default: none]
    #[arg(long, value_name = "AFFINITY")]
    pub route_put_affinity: Option<Affinity>,
    /// Nodes heartbeat every TTL / N [env: UMBP_HEARTBEAT_INTERVAL_DIVISOR] [default: 2]
    #[arg(long, value_name = "N")]
    pub heartbeat_interval_divisor: Option<u32>,
    /// How often eviction checks the watermarks [env: UMBP_EVICTION_CHECK_INTERVAL_SEC] [default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub eviction_check_interval: Option<Duration>,
    /// Eviction starts when a node's tier is this full (0..1] [env: UMBP_EVICTION_HIGH_WATERMARK] [default: 0.9]
    #[arg(long, value_name = "F")]
    pub eviction_high_watermark: Option<f64>,
    /// … and stops at this fill ratio [env: UMBP_EVICTION_LOW_WATERMARK] [default: 0.7]
    #[arg(long, value_name = "F")]
    pub eviction_low_watermark: Option<f64>,
    /// Lease a route-get grants the keys it found; eviction skips them [env: UMBP_LEASE_DURATION_SEC]
    /// [default: 2s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub lease_duration: Option<Duration>,
    /// Deadline of one EvictKey call to a node [env: UMBP_EVICT_DEADLINE, UMBP_EVICTKEY_DEADLINE_MS in ms]
    /// [default: 1s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub evict_deadline: Option<Duration>,
    /// Shards of the key index (1..=4096) [env: UMBP_MASTER_INDEX_SHARDS] [default: 32]
    #[arg(long, value_name = "N")]
    pub index_shards: Option<usize>,
    /// How long shutdown waits for in-flight calls [env: UMBP_GRPC_SHUTDOWN_DEADLINE_SEC] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub shutdown_deadline: Option<Duration>,
    /// Largest gRPC message (at least 64KiB) [env: UMBP_MASTER_MAX_MESSAGE_BYTES] [default: 64MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_message_bytes: Option<u64>,
    /// Serve Prometheus /metrics (cluster gauges and counters) on ADDR; port 0 picks a free one
    /// [env: UMBP_MASTER_METRICS_ADDR] [default: none, no endpoint]
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Keep the metadata (members and key index) in the Redis at URL, redis://HOST:PORT[/DB], instead
    /// of this process's memory; several URLs comma-separated shard the index over them by key hash
    /// (every master lists the same ones, in the same order) [env: UMBP_MASTER_METADATA] [default:
    /// none, in-process memory]
    #[arg(long, value_name = "URL[,URL…]")]
    pub metadata: Option<String>,
}

/// The medium a node lends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MediumKind {
    /// Host DRAM.
    Dram,
    /// GPU HBM of one device.
    Hbm,
    /// Local drives, staged through host DRAM.
    Ssd,
    /// CXL or persistent memory: a device-DAX device or a file, mapped.
    Cxl,
    /// An S3-compatible object store (or a local directory), staged through host DRAM.
    Object,
    /// No medium: the node only reads and writes the pool.
    None,
}

impl MediumKind {
    /// The name used on the command line and in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dram => "dram",
            Self::Hbm => "hbm",
            Self::Ssd => "ssd",
            Self::Cxl => "cxl",
            Self::Object => "object",
            Self::None => "none",
        }
    }
}

/// `--master`, shared by the node and the client commands.
#[derive(Debug, Clone, Default, Args)]
pub struct MasterAddress {
    /// The master's address, or several masters on one Redis comma-separated (a:50051,b:50051;
    /// calls fail over between them) [env: UMBP_MASTER_ADDRESS] [default: 127.0.0.1:50051]
    #[arg(long, value_name = "ADDR[,ADDR…]")]
    pub master: Option<String>,
}

/// Flags of `umbp node`.
#[derive(Debug, Clone, Default, Args)]
pub struct NodeArgs {
    /// Where the master is.
    #[command(flatten)]
    pub master: MasterAddress,
    /// This node's cluster-unique id (required: here, in UMBP_NODE_ID or as node.node_id)
    /// [env: UMBP_NODE_ID] [default: none]
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// The medium this node lends [env: UMBP_MEDIUM] [default: dram]
    #[arg(long, value_name = "MEDIUM")]
    pub medium: Option<MediumKind>,
    /// Bytes of host memory a dram node lends (ssd and hbm nodes: --ssd-capacity, --hbm-capacity)
    /// [env: UMBP_CAPACITY] [default: 4GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Page size of the medium (the pool's block size), a multiple of 4KiB [env: UMBP_PAGE_SIZE]
    /// [default: 2MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub page_size: Option<u64>,
    /// Host (IP) the peer service and the data server listen on and other nodes reach this node at
    /// [env: UMBP_NODE_LISTEN, UMBP_NODE_ADDRESS] [default: 127.0.0.1]
    #[arg(long, value_name = "HOST")]
    pub listen: Option<IpAddr>,
    /// Port of the peer service; 0 picks a free one [env: UMBP_NODE_PEER_PORT, UMBP_PEER_SERVICE_PORT]
    /// [default: 0]
    #[arg(long, value_name = "PORT")]
    pub peer_port: Option<u16>,
    /// Port of the TCP data server; 0 picks a free one [env: UMBP_NODE_DATA_PORT, UMBP_IO_ENGINE_PORT]
    /// [default: 0]
    #[arg(long, value_name = "PORT")]
    pub data_port: Option<u16>,
    /// Touch every page of the medium at start-up [env: UMBP_DRAM_PREFAULT] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub prefault: Option<bool>,
    /// Back a dram node with hugetlb pages (reserved in /proc/sys/vm/nr_hugepages)
    /// [env: UMBP_DRAM_HUGEPAGES] [default: false]
    #[arg(long, value_name = "BOOL")]
    pub hugepages: Option<bool>,
    /// Bind a dram node's memory to this NUMA node [env: UMBP_NUMA_NODE] [default: none, no binding]
    #[arg(long, value_name = "N")]
    pub numa_node: Option<u32>,
    /// Advise a dram node's memory for transparent huge pages
    /// [env: UMBP_DRAM_TRANSPARENT_HUGEPAGES] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub transparent_hugepages: Option<bool>,
    /// A directory of an ssd node, one per drive; repeat for several drives (required for ssd)
    /// [env: UMBP_SSD_DIRS, comma-separated] [default: none]
    #[arg(long = "ssd-dir", value_name = "DIR")]
    pub ssd_dir: Vec<PathBuf>,
    /// Drive bytes an ssd node lends, split evenly across its directories [env: UMBP_SSD_CAPACITY]
    /// [default: 32GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub ssd_capacity: Option<u64>,
    /// The io engine of an ssd node: psync or io_uring [env: UMBP_SSD_IO_ENGINE] [default: psync]
    #[arg(long, value_name = "ENGINE")]
    pub ssd_io_engine: Option<String>,
    /// Host staging pages of an ssd node: writes in flight plus reads being served
    /// [env: UMBP_SSD_STAGING_PAGES] [default: 128]
    #[arg(long, value_name = "N")]
    pub ssd_staging_pages: Option<u64>,
    /// The largest value an ssd node stores, in pages of --page-size (a larger one is refused); at
    /// most --ssd-staging-pages [env: UMBP_SSD_MAX_VALUE_PAGES] [default: 1]
    #[arg(long, value_name = "N")]
    pub ssd_max_value_pages: Option<u64>,
    /// How long an ssd node keeps a read's staged copy for its reader
    /// [env: UMBP_SSD_READ_LEASE_MS, in ms] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ssd_read_lease: Option<Duration>,
    /// Create a missing --ssd-dir instead of refusing to start (a missing directory is usually an
    /// unmounted drive) [env: UMBP_SSD_CREATE_DIRS] [default: false]
    #[arg(long)]
    pub ssd_create_dirs: bool,
    /// How often an ssd node fdatasyncs the log segments written since its last sync (commits do
    /// not wait for it; it bounds what a power loss can take), or off: only at shutdown
    /// [env: UMBP_SSD_SYNC_INTERVAL] [default: 1s]
    #[arg(long, value_name = "DURATION|off")]
    pub ssd_sync_interval: Option<String>,
    /// Keep a committed value's staging pages as a clean copy until they are needed, so a read of a
    /// value just written skips the drive [env: UMBP_SSD_CACHE_COMMITTED] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub ssd_cache_committed: Option<bool>,
    /// The GPU an hbm node lends [env: UMBP_HBM_DEVICE] [default: 0]
    #[arg(long, value_name = "N")]
    pub hbm_device: Option<u32>,
    /// Device memory an hbm node lends [env: UMBP_HBM_CAPACITY] [default: 1GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub hbm_capacity: Option<u64>,
    /// The GPU runtime of an hbm node: auto, cuda, hip, cudart, or fake (host memory, for tests)
    /// [env: UMBP_HBM_RUNTIME] [default: auto]
    #[arg(long, value_name = "RUNTIME")]
    pub hbm_runtime: Option<String>,
    /// The device-DAX device (/dev/daxX.Y) or file a cxl node maps; a file is created or grown to
    /// --cxl-capacity (required for cxl) [env: UMBP_CXL_PATH] [default: none]
    #[arg(long, value_name = "PATH")]
    pub cxl_path: Option<PathBuf>,
    /// Bytes of the device or file a cxl node lends [env: UMBP_CXL_CAPACITY] [default: 1GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub cxl_capacity: Option<u64>,
    /// The store an object node lends: s3://BUCKET/PREFIX or file:///DIR (required for object;
    /// credentials from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)
    /// [env: UMBP_OBJECT_URL] [default: none]
    #[arg(long, value_name = "URL")]
    pub object_url: Option<String>,
    /// The S3 endpoint, http://HOST:PORT, path-style (else AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)
    /// [env: UMBP_OBJECT_ENDPOINT] [default: none]
    #[arg(long, value_name = "URL")]
    pub object_endpoint: Option<String>,
    /// Bytes of the store an object node lends [env: UMBP_OBJECT_CAPACITY] [default: 32GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub object_capacity: Option<u64>,
    /// Host staging pages of an object node (uploads and reads in flight)
    /// [env: UMBP_OBJECT_STAGING_PAGES] [default: 128]
    #[arg(long, value_name = "N")]
    pub object_staging_pages: Option<u64>,
    /// The largest value an object node stores, in pages (at most --object-staging-pages)
    /// [env: UMBP_OBJECT_MAX_VALUE_PAGES] [default: 1]
    #[arg(long, value_name = "N")]
    pub object_max_value_pages: Option<u64>,
    /// The read lease of an object node's staged copy [env: UMBP_OBJECT_READ_LEASE] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub object_read_lease: Option<Duration>,
    /// Requests an object node sends its store at once [env: UMBP_OBJECT_IO_THREADS] [default: 16]
    #[arg(long, value_name = "N")]
    pub object_io_threads: Option<usize>,
    /// How long a commit or read of an object node waits for the store, retries included
    /// [env: UMBP_OBJECT_OP_TIMEOUT] [default: 4s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub object_op_timeout: Option<Duration>,
    /// Retries of a request the store failed transiently (5xx, 429, a lost connection)
    /// [env: UMBP_OBJECT_RETRIES] [default: 4]
    #[arg(long, value_name = "N")]
    pub object_retries: Option<u32>,
    /// Create the bucket at start when it does not exist [env: UMBP_OBJECT_CREATE_BUCKET]
    /// [default: false]
    #[arg(long, value_name = "BOOL")]
    pub object_create_bucket: Option<bool>,
    /// Keep a committed value's staging pages as a clean copy until they are needed, so a read of a
    /// value just written downloads nothing [env: UMBP_OBJECT_CACHE_COMMITTED] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub object_cache_committed: Option<bool>,
    /// Re-cache values fetched from other nodes: off, always, or a size cap
    /// [env: UMBP_RECACHE, UMBP_CACHE_REMOTE_FETCHES] [default: 16MiB]
    #[arg(long, value_name = "POLICY")]
    pub recache: Option<String>,
    /// How long a resolve protects a key from eviction for its reader
    /// [env: UMBP_DRAM_READ_LEASE_MS, in ms] [default: 500ms]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub read_lease: Option<Duration>,
    /// How long an allocated, uncommitted slot lives [env: UMBP_PENDING_TTL] [default: 30s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub pending_ttl: Option<Duration>,
    /// Deadline of each peer RPC, and the longest a data connection may stall before its transfers
    /// fail [env: UMBP_RPC_TIMEOUT] [default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub rpc_timeout: Option<Duration>,
    /// How many times a key is re-routed past the nodes that failed it [env: UMBP_MAX_REROUTES]
    /// [default: 2]
    #[arg(long, value_name = "N")]
    pub max_reroutes: Option<u32>,
    /// Bounce pool for caller memory that is not registered [env: UMBP_BOUNCE] [default: 64MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub bounce: Option<u64>,
    /// Serve Prometheus /metrics (the medium by tier=, the transfer engines) on ADDR; port 0 picks a
    /// free one [env: UMBP_NODE_METRICS_ADDR] [default: none, no endpoint]
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Same-host peers (of this user or --shared-memory-group, with the cluster token) read and
    /// write a dram node's memory through shared mappings instead of TCP, and this node theirs.
    /// Huge pages for that memory need the host's /sys/kernel/mm/transparent_hugepage/shmem_enabled
    /// at advise (often never; the node logs it) [env: UMBP_SHARED_MEMORY] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub shared_memory: Option<bool>,
    /// Also admit same-host processes whose effective group is GROUP (a name or a gid) to this
    /// node's memory through the shared path: they may then read and write every value in it, as
    /// this node's own user can. They still need the cluster token. For ranks run as different
    /// users of one group [env: UMBP_SHARED_MEMORY_GROUP] [default: none, this user only]
    #[arg(long, value_name = "GROUP")]
    pub shared_memory_group: Option<String>,
    /// Put a CRC-32C with every value and check every read against it: a value whose bytes changed
    /// in a holder's memory, on its drive or on the wire is discarded (a miss, counted in
    /// umbp_client_checksum_failures_total), never returned [env: UMBP_CHECKSUMS] [default: true]
    #[arg(long, value_name = "BOOL")]
    pub checksums: Option<bool>,
    /// The master client's settings.
    #[command(flatten)]
    pub master_client: MasterClientArgs,
}

/// The master client's flags of `umbp node` (its `[node.master]` settings).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Master client")]
pub struct MasterClientArgs {
    /// Deadline of one Heartbeat call [env: UMBP_HEARTBEAT_RPC_TIMEOUT_MS, in ms] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub heartbeat_rpc_timeout: Option<Duration>,
    /// Most events in one delta bundle [env: UMBP_HEARTBEAT_EVENTS_PER_BUNDLE] [default: 1024]
    #[arg(long, value_name = "N")]
    pub events_per_bundle: Option<usize>,
    /// Most delta bundles in one Heartbeat call [env: UMBP_HEARTBEAT_MAX_BUNDLES_PER_RPC] [default: 16]
    #[arg(long, value_name = "N")]
    pub max_bundles_per_rpc: Option<usize>,
    /// Unshipped events that wake the heartbeat at once; 0 turns it off
    /// [env: UMBP_AUTO_FLUSH_EVENT_THRESHOLD] [default: 128]
    #[arg(long, value_name = "N")]
    pub auto_flush_event_threshold: Option<usize>,
    /// Deadline of the unregister call at shutdown [env: UMBP_RPC_SHUTDOWN_TIMEOUT_MS, in ms]
    /// [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub shutdown_timeout: Option<Duration>,
    /// Most events queued for the master before a full sync replaces them
    /// [env: UMBP_HEARTBEAT_MAX_OUTBOX_EVENTS] [default: 1000000]
    #[arg(long, value_name = "N")]
    pub max_outbox_events: Option<usize>,
    /// Most events in one full-sync chunk [env: UMBP_FULL_SYNC_CHUNK_EVENTS] [default: 32768]
    #[arg(long, value_name = "N")]
    pub full_sync_chunk_events: Option<usize>,
    /// Largest Heartbeat request the client builds (at least 4KiB, at most half of
    /// --master-max-message-bytes) [env: UMBP_HEARTBEAT_MAX_REQUEST_BYTES] [default: 4MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_request_bytes: Option<u64>,
    /// Deadline of every other call to the master [env: UMBP_MASTER_RPC_TIMEOUT_MS, in ms] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub master_rpc_timeout: Option<Duration>,
    /// Deadline for connecting to the master [env: UMBP_MASTER_CONNECT_TIMEOUT_MS, in ms] [default: 3s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub master_connect_timeout: Option<Duration>,
    /// How long clearing this node's keys at the master is retried [env: UMBP_CLEAR_TIMEOUT_MS, in ms]
    /// [default: 30s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub clear_timeout: Option<Duration>,
    /// The heartbeat interval when the master's reply names none
    /// [env: UMBP_DEFAULT_HEARTBEAT_INTERVAL] [default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub default_heartbeat_interval: Option<Duration>,
    /// Largest gRPC message to and from the master [env: UMBP_NODE_MASTER_MAX_MESSAGE_BYTES]
    /// [default: 64MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub master_max_message_bytes: Option<u64>,
}

/// `umbp put`.
#[derive(Debug, Clone, Args)]
pub struct PutArgs {
    /// Where the master is.
    #[command(flatten)]
    pub master: MasterAddress,
    /// The key.
    pub key: String,
    /// The value: a file, or `-` for stdin [default: -]
    #[arg(value_name = "FILE|-")]
    pub source: Option<PathBuf>,
    /// Replace the value if KEY is already stored: remove every replica (waiting out a reader's
    /// lease), then write. Values are write-once, so without it an existing key keeps its value
    /// [default: off]
    #[arg(long)]
    pub replace: bool,
}

/// `umbp get`.
#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    /// Where the master is.
    #[command(flatten)]
    pub master: MasterAddress,
    /// The key.
    pub key: String,
    /// Where the value goes: a file, or `-` for stdout [default: -]
    #[arg(value_name = "FILE|-")]
    pub dest: Option<PathBuf>,
    /// Largest value accepted [env: UMBP_MAX_GET_SIZE] [default: 64MiB]
    #[arg(long = "max-get-size", visible_alias = "max-size", value_name = "SIZE", value_parser = parse_size)]
    pub max_size: Option<u64>,
}

/// `umbp exists` and `umbp rm`.
#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    /// Where the master is.
    #[command(flatten)]
    pub master: MasterAddress,
    /// The keys.
    #[arg(required = true, value_name = "KEY")]
    pub keys: Vec<String>,
}

/// `umbp stat`.
#[derive(Debug, Clone, Args)]
pub struct StatArgs {
    /// Where the master is.
    #[command(flatten)]
    pub master: MasterAddress,
}

/// `umbp demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Nodes to start (at least 2) [default: 3]
    #[arg(long, value_name = "N")]
    pub nodes: Option<usize>,
    /// Keys to write [default: 512]
    #[arg(long, value_name = "N")]
    pub keys: Option<usize>,
    /// Smallest value [default: 16KiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub min_value: Option<u64>,
    /// Largest value [default: 1MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_value: Option<u64>,
    /// DRAM each node lends [default: 128MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Page size of every node [default: 64KiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub page_size: Option<u64>,
    /// Keys per batch put and batch get [default: 64]
    #[arg(long, value_name = "N")]
    pub batch: Option<usize>,
    /// Seed of the value sizes and bytes [default: 1]
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
}

/// The suites of `umbp bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchSuite {
    /// Batch put/get through PoolClient, local and between two processes, and single-get latency.
    Pool,
    /// Batch put/get through an SSD node's PoolClient beside raw O_DIRECT IO on the same directory.
    Ssd,
    /// Heartbeat ingestion and route decisions over gRPC with the index in memory, in one Redis and
    /// in three Redis shards (redis-server processes the bench starts), and Redis memory per key.
    Metadata,
    /// A long mixed workload at pool pressure (a master and two small DRAM nodes as processes),
    /// every process's memory, file descriptors and threads and the master's index size sampled
    /// every minute; fails on any wrong byte read.
    Soak,
    /// What the end-to-end checksum costs: batch put and get of 64 KiB and 1 MiB values with
    /// checksums on and off, over TCP and through shared memory, to and from a node in a child
    /// process, rounds interleaved.
    Checksum,
    /// A 1 MiB value read as 8 ranges into 8 buffers against one whole-value get of the same bytes,
    /// over TCP and through shared memory, from a node in a child process, rounds interleaved.
    Ranged,
}

/// The io engines `umbp bench ssd` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SsdEngineChoice {
    /// Blocking preadv / pwritev.
    Psync,
    /// Linux io_uring.
    #[value(name = "io_uring", alias = "io-uring")]
    IoUring,
    /// Both, psync first; io_uring rows are skipped, with a note, where its node cannot start.
    Both,
}

/// `umbp bench`.
#[derive(Debug, Clone, Default, Args)]
pub struct BenchArgs {
    /// The suite to run [default: pool]
    #[arg(value_name = "SUITE")]
    pub suite: Option<BenchSuite>,
    /// Rounds per cell; each cell is the median [default: 5]
    #[arg(long, value_name = "N")]
    pub rounds: Option<usize>,
    /// Bytes per batch put and batch get (at least 1MiB; ssd: 2MiB) [default: 64MiB; ssd: 256MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub batch_bytes: Option<u64>,
    /// Single 64 KiB gets timed for p50/p99, pool suite (at least 100) [default: 1000]
    #[arg(long, value_name = "N")]
    pub latency_calls: Option<usize>,
    /// ssd suite: a directory on the drive to measure; the node's log and the raw file go in a fresh
    /// subdirectory, removed at the end (required for ssd) [default: none]
    #[arg(long, value_name = "DIR")]
    pub ssd_dir: Option<PathBuf>,
    /// ssd suite: the node's io engine [default: both]
    #[arg(long, value_name = "ENGINE")]
    pub ssd_io_engine: Option<SsdEngineChoice>,
    /// metadata suite: how long each cell is measured [default: 3s]; soak suite: how long the
    /// workload runs [default: 1h]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Option<std::time::Duration>,
    /// metadata suite: keys indexed to measure Redis memory per key (0 skips it) [default: 100000]
    #[arg(long, value_name = "N")]
    pub memory_keys: Option<usize>,
    /// Print one JSON object instead of the markdown table [default: off]
    #[arg(long)]
    pub json: bool,
    /// pool suite: also time each phase of single 64 KiB remote puts and gets (route, the keyed
    /// exchange or allocate/resolve, transfer, commit/release) with the pool's tracing spans,
    /// --latency-calls of each, and the phases of every remote and same-host batch cell (a
    /// same-host chunk's steps: the holder's answer, the copies, the settle or commit)
    /// [default: off]
    #[arg(long)]
    pub breakdown: bool,
}

/// `umbp bench-child` (hidden): the child node of `umbp bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchChildArgs {
    /// The bench's master (required) [default: none]
    #[arg(long, value_name = "ADDR")]
    pub master: String,
    /// DRAM the node lends, in bytes (required) [default: none]
    #[arg(long, value_name = "BYTES")]
    pub capacity: u64,
}
