//! `gcs-node`: one binary for gateways and workers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use gcs_node::{NodeConfig, Role};
use gcs_protocol::{ApiType, ModelInfo};
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
    /// Data directory (identity key, keyspace). Default: the OS data dir.
    #[arg(long, env = "GCS_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// HTTP listen address of the OpenAI-compatible API (gateway, all).
    #[arg(long, env = "GCS_HTTP", default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// CUDA device for the worker; without it the worker runs on CPU.
    #[arg(long, env = "GCS_GPU")]
    gpu: Option<u32>,
    /// Model to serve: a name in the model cache or a path (repeatable).
    #[arg(long = "model", env = "GCS_MODEL", value_delimiter = ',')]
    models: Vec<String>,
    /// Disable mDNS discovery.
    #[arg(long, env = "GCS_NO_MDNS")]
    no_mdns: bool,
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
    let dir = model_dir();
    let chat = ModelInfo {
        model_id: "smollm2-135m-instruct".into(),
        aliases: vec!["gnus-auto".into(), "gnus-small".into()],
        context_tokens: 8192,
        quantization: "q4_1".into(),
        backend: "burn-cpu".into(),
        tasks: vec![ApiType::ChatCompletion, ApiType::Completion],
    };
    let embed = ModelInfo {
        model_id: "all-minilm-l6-v2".into(),
        aliases: vec!["gnus-embed".into()],
        context_tokens: 256,
        quantization: "f32".into(),
        backend: "burn-cpu".into(),
        tasks: vec![ApiType::Embedding],
    };
    let has_chat =
        dir.join("smollm2-135m-instruct").join(gcs_node::engine_exec::CHAT_GGUF).is_file();
    let has_embed = dir.join("all-minilm-l6-v2/model.safetensors").is_file();
    if names.is_empty() {
        let mut out = vec![];
        if has_chat {
            out.push(chat);
        }
        if has_embed {
            out.push(embed);
        }
        return Ok(out);
    }
    names
        .iter()
        .map(|n| match n.as_str() {
            "smollm2-135m-instruct" | "gnus-auto" | "gnus-small" if has_chat => Ok(chat.clone()),
            "all-minilm-l6-v2" | "gnus-embed" if has_embed => Ok(embed.clone()),
            other => bail!(
                "model {other:?} is not in the model cache {} (run scripts/fetch-models.sh)",
                dir.display()
            ),
        })
        .collect()
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

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(gpu) = cli.gpu {
        if cli.role.is_worker() {
            bail!("--gpu {gpu}: this build has no CUDA support (rebuild with --features cuda)");
        }
    }
    let data_dir = match cli.data_dir {
        Some(d) => d,
        None => dirs::data_dir().context("no OS data directory; pass --data-dir")?.join("gcs"),
    };
    let mut config = NodeConfig::new(cli.role, data_dir);
    config.network.listen = if cli.listen.is_empty() {
        let port = if cli.role == Role::Worker { 0 } else { 4001 };
        vec![
            format!("/ip4/0.0.0.0/tcp/{port}").parse()?,
            format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?,
        ]
    } else {
        cli.listen
    };
    config.network.bootstrap = cli.bootstrap;
    config.network.mdns = !cli.no_mdns;
    config.heartbeat_interval = Duration::from_millis(cli.heartbeat_ms.max(100));
    config.registration_ttl =
        Duration::from_millis(cli.registration_ttl_ms.max(cli.heartbeat_ms + 100));
    if cli.role.is_worker() {
        config.models = models(&cli.models)?;
        if config.models.is_empty() {
            tracing::warn!(dir = %model_dir().display(), "no models in the cache (run scripts/fetch-models.sh); this worker will claim nothing");
        } else {
            let dir = model_dir();
            let models = config.models.clone();
            let exec = tokio::task::spawn_blocking(move || {
                gcs_node::engine_exec::EngineExecutor::load(&dir, &models)
            })
            .await?
            .map_err(|e| anyhow::anyhow!("cannot load model: {e}"))?;
            tracing::info!(models = ?config.models.iter().map(|m| &m.model_id).collect::<Vec<_>>(), "worker models loaded");
            config.executor = Some(std::sync::Arc::new(exec));
        }
    }
    if cli.role != Role::Worker {
        tracing::warn!(http = %cli.http, "the OpenAI-compatible HTTP API is not part of this build yet (issue 7)");
    }
    let node = gcs_node::start(config).await?;
    for a in node.listen_addrs().await? {
        tracing::info!(addr = %a, "dial this node with --bootstrap");
    }
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")?;
    tracing::info!("shutting down");
    node.shutdown().await;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
