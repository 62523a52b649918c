//! The flags of a running node (`gcs-node [--role ...]`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use gcs_node::Role;
use libp2p::Multiaddr;

/// How the node writes its log (stderr).
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

/// Settings of a running node.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// What this node does.
    #[arg(long, env = "GCS_ROLE", value_enum, default_value = "all")]
    pub role: Role,
    /// libp2p listen address (repeatable). Default: TCP and QUIC on port 4001
    /// for gateway/all, a random port for workers.
    #[arg(long, env = "GCS_LISTEN", value_delimiter = ',')]
    pub listen: Vec<Multiaddr>,
    /// Peer to dial at start (repeatable), with or without /p2p/<peer id>.
    #[arg(long, env = "GCS_BOOTSTRAP", value_delimiter = ',')]
    pub bootstrap: Vec<Multiaddr>,
    /// HTTP listen address of the OpenAI-compatible API (gateway, all).
    #[arg(long, env = "GCS_HTTP", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    /// TLS certificate chain (PEM); with --tls-key the API is served over HTTPS.
    #[arg(long, env = "GCS_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, env = "GCS_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Jobs a worker runs at once (sequences in one decode batch). Default:
    /// 16 on a CPU; on a GPU, the jobs of 2048 positions its K/V capacity
    /// holds (at most 256).
    #[arg(long, env = "GCS_MAX_JOBS")]
    pub max_jobs: Option<usize>,
    /// Jobs the gateway holds in flight before it answers 429 (a request
    /// of n choices or many embedding batches holds that many).
    #[arg(long, env = "GCS_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: usize,
    /// Jobs one request may become; larger embeddings requests get larger
    /// batches (up to 64 inputs a job), beyond that a 400.
    #[arg(long, env = "GCS_MAX_JOBS_PER_REQUEST", default_value_t = 32)]
    pub max_jobs_per_request: usize,
    /// The price of batch work (/v1/batches) in percent of the API price:
    /// a key's budget is charged that share of a batch job's tokens.
    #[arg(long, env = "GCS_BATCH_PRICE_PERCENT", default_value_t = 50,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub batch_price_percent: u8,
    /// Processing subtasks (batch work from the swarm's processing queue)
    /// a worker runs at once, beside its API jobs; 0 takes none.
    #[arg(long, env = "GCS_MAX_PROCESSING_JOBS", default_value_t = gcs_node::DEFAULT_PROCESSING_JOBS)]
    pub max_processing_jobs: usize,
    /// Lease of a processing lock in ms (renewed at half of it): how long a
    /// dead worker's subtask waits before another worker takes it.
    #[arg(long, env = "GCS_PROCESSING_LEASE_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1_000..=600_000))]
    pub processing_lease_ms: u64,
    /// A tenant whose gateways' processing tasks this worker takes:
    /// `TENANT=ISSUER`, the id of the tenant's membership key (repeatable).
    /// A task is taken only from a gateway that key admitted.
    #[arg(long, env = "GCS_TRUST_TENANT", value_delimiter = ',')]
    pub trust_tenant: Vec<String>,
    /// How long a stream's HTTP status waits for its first chunk, in ms (at
    /// most one keepalive interval): a job failing before it is answered
    /// with its own status as JSON.
    #[arg(long, env = "GCS_STREAM_HOLD_MS", default_value_t = 2_000)]
    pub stream_hold_ms: u64,
    /// Time a request body may take to arrive in full, in ms (then 408).
    #[arg(long, env = "GCS_BODY_READ_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_read_timeout_ms: u64,
    /// HTTP connections open at once from one client address (IPv6: its /64).
    #[arg(long, env = "GCS_MAX_CONNECTIONS_PER_IP", default_value_t = 256)]
    pub max_connections_per_ip: usize,
    /// Failed authentications per client address and minute before that
    /// address's unauthenticated requests are answered 429.
    #[arg(long, env = "GCS_UNAUTHENTICATED_PER_IP_PER_MINUTE", default_value_t = 60)]
    pub unauthenticated_per_ip_per_minute: u32,
    /// Bytes queued for a slow streaming client before its job is cancelled.
    #[arg(long, env = "GCS_STREAM_BUFFER_BYTES", default_value_t = 262_144)]
    pub stream_buffer_bytes: usize,
    /// Keepalive comment interval on idle streams, in ms.
    #[arg(long, env = "GCS_KEEPALIVE_MS", default_value_t = 15_000)]
    pub keepalive_ms: u64,
    /// Default first-token timeout in ms (per key and per request overridable).
    #[arg(long, env = "GCS_FIRST_TOKEN_TIMEOUT_MS", default_value_t = 10_000)]
    pub first_token_timeout_ms: u64,
    /// Gateway: the lease term granted to the worker running a job, in ms
    /// (1000..=120000). The holder renews five times a term; one silent
    /// for a whole term (paused, cut off) is replaced — before its first
    /// token by a requeue, after it by an exact continuation — so this is
    /// how long such a stream stalls.
    #[arg(long, env = "GCS_LEASE_MS", default_value_t = gcs_node::lifecycle::tracker::DEFAULT_LEASE_TERM_MS,
          value_parser = clap::value_parser!(u64).range(gcs_node::lifecycle::tracker::LEASE_TERM_RANGE_MS))]
    pub lease_ms: u64,
    /// Gateway: how long a worker that lost a job (its lease expired, it
    /// disconnected, it failed) is left out of new jobs at first, in ms;
    /// each repeat doubles it, up to 5 min. 0: never left out (a test
    /// network that fails its workers on purpose).
    #[arg(long, env = "GCS_SIT_OUT_MS", default_value_t = gcs_node::lifecycle::penalty::BASE_MS,
          value_parser = clap::value_parser!(u64).range(0..=gcs_node::lifecycle::penalty::MAX_MS))]
    pub sit_out_ms: u64,
    /// Default idle-stream timeout in ms.
    #[arg(long, env = "GCS_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    pub idle_timeout_ms: u64,
    /// Default wall-clock timeout in ms.
    #[arg(long, env = "GCS_WALL_TIMEOUT_MS", default_value_t = 120_000)]
    pub wall_timeout_ms: u64,
    /// GPU for the worker's chat models (gateways ignore it): CUDA device N
    /// on a `--features cuda` build (needs the NVIDIA driver), the default
    /// wgpu adapter (N = 0) on a `--features wgpu` build. A build or machine
    /// without one, or a model the GPU kernels do not cover (K-quants such
    /// as Gemma's Q4_K_M), stops the worker at start saying which. Without
    /// it workers run on CPU.
    #[arg(long, env = "GCS_GPU")]
    pub gpu: Option<u32>,
    /// Model to serve: a catalogue id or alias from the model cache
    /// (`smollm2-135m-instruct`/`gnus-small`, `gemma-3-270m`/`gnus-medium`,
    /// `all-minilm-l6-v2`/`gnus-embed`), or the path of any supported GGUF
    /// file (a value ending in `.gguf` or containing `/`); repeatable or
    /// comma-separated. Each chat model gets its own batch engine. Default:
    /// the catalogue's default models the cache holds.
    #[arg(long = "model", env = "GCS_MODEL", value_delimiter = ',')]
    pub models: Vec<String>,
    /// The model id of a `--model` path, paired with the paths in order
    /// (default: the file's `general.name`, lowercased, spaces as `-`).
    #[arg(long = "model-id", env = "GCS_MODEL_ID", value_delimiter = ',')]
    pub model_ids: Vec<String>,
    /// Most context positions a chat model is served with (default: the
    /// file's own, at most 8192 for gemma3).
    #[arg(long, env = "GCS_CTX", value_parser = clap::value_parser!(u32).range(16..))]
    pub ctx: Option<u32>,
    /// KV-cache memory of the worker's chat models together, in MiB,
    /// shared in equal parts between them (default: 360, 1024 blocks of
    /// SmolLM2-135M; on a GPU that reports its memory, 90% of it less the
    /// weights and 2 GiB, at most 8 GiB of f16 K/V a model).
    #[arg(long, env = "GCS_KV_CACHE_MB",
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub kv_cache_mb: Option<u64>,
    /// Swarm this node belongs to; a worker outside `public` also takes the
    /// swarm's `local_only` jobs.
    #[arg(long, env = "GCS_SWARM", default_value = "public")]
    pub swarm: String,
    /// Make this worker a private node of tenant T (26.11.3): it may win T's
    /// private and hybrid jobs with T's certificate (`--membership`). A
    /// tenant_member certificate alone implies it.
    #[arg(long, env = "GCS_PRIVATE_TENANT")]
    pub private_tenant: Option<String>,
    /// A private worker (--private-tenant or its certificate): take no
    /// public jobs.
    #[arg(long, env = "GCS_PRIVATE_ONLY")]
    pub private_only: bool,
    /// Take the `gateway_local` jobs of this gateway (its node id), with its
    /// gateway_worker certificate (`tenants admit --gateway-local` on it);
    /// the certificate alone implies it. Repeatable or comma-separated.
    #[arg(long, env = "GCS_GATEWAY_LOCAL", value_delimiter = ',')]
    pub gateway_local: Vec<gcs_protocol::NodeId>,
    /// A membership certificate this node presents (from `gcs-node tenants
    /// admit`): a tenant's private node, a swarm's node or a tenant's
    /// gateway. Without one, private, hybrid-private and local-only claims
    /// are refused. Repeatable or comma-separated.
    #[arg(long, env = "GCS_MEMBERSHIP", value_delimiter = ',')]
    pub membership: Vec<PathBuf>,
    /// Gateway: serve only these models, `id=context_tokens` (repeatable or
    /// comma-separated; aliases and tasks from the build's catalogue, or
    /// what the network agrees on). Default: the build's catalogue is
    /// trusted for its models, other models come from what registrations
    /// agree on.
    #[arg(long, env = "GCS_MODELS_ALLOW", value_delimiter = ',', value_parser = allowed_model)]
    pub models_allow: Vec<gcs_gateway::catalog::Trusted>,
    /// Worker: percent of its slots and of its backlog one gateway may take
    /// while other gateways offer jobs too (a gateway alone may use all).
    #[arg(long, env = "GCS_GATEWAY_SHARE", default_value_t = 50,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub gateway_share: u8,
    /// Worker: take jobs only from these gateway node ids (`gnusnode_...`;
    /// repeatable or comma-separated). Default: any gateway, each bounded
    /// by --gateway-share.
    #[arg(long, env = "GCS_GATEWAYS", value_delimiter = ',')]
    pub gateways: Vec<gcs_protocol::NodeId>,
    /// Disable mDNS discovery.
    #[arg(long, env = "GCS_NO_MDNS")]
    pub no_mdns: bool,
    /// Delta bytes one peer may add to the keyspace per minute (peer_quota).
    #[arg(long, env = "GCS_PEER_QUOTA_BYTES", default_value_t = 64 << 20)]
    pub peer_quota_bytes: u64,
    /// Changed keys one peer may add to the keyspace per minute (peer_quota).
    #[arg(long, env = "GCS_PEER_QUOTA_KEYS", default_value_t = 50_000)]
    pub peer_quota_keys: u64,
    /// Established libp2p connections at most (max_peer_connections).
    #[arg(long, env = "GCS_MAX_PEER_CONNECTIONS", default_value_t = 512)]
    pub max_peer_connections: u32,
    /// Registration heartbeat interval in ms.
    #[arg(long, env = "GCS_HEARTBEAT_MS", default_value_t = 10_000)]
    pub heartbeat_ms: u64,
    /// Registration lifetime in ms.
    #[arg(long, env = "GCS_REGISTRATION_TTL_MS", default_value_t = 30_000)]
    pub registration_ttl_ms: u64,
    /// Log format.
    #[arg(long, env = "GCS_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// One `--models-allow` entry: `id=context_tokens`.
pub fn allowed_model(s: &str) -> Result<gcs_gateway::catalog::Trusted, String> {
    let (id, ctx) = s.split_once('=').ok_or("use id=context_tokens")?;
    let context_tokens: u32 = ctx.parse().map_err(|e| format!("context_tokens: {e}"))?;
    if id.is_empty() || context_tokens == 0 {
        return Err("use id=context_tokens with a context above 0".into());
    }
    let known = gcs_node::models::entry(id).map(|e| e.info());
    Ok(gcs_gateway::catalog::Trusted {
        model_id: id.into(),
        context_tokens,
        aliases: known.as_ref().map(|m| m.aliases.clone()).unwrap_or_default(),
        tasks: known.map(|m| m.tasks).unwrap_or_default(),
    })
}

