//! `gcs-node`: one binary for gateways and workers. The subcommands and the
//! node's run live in `cmd/`.

mod cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use cmd::args::{LogFormat, RunArgs};
use cmd::batches::BatchesCommand;
use cmd::keys::KeysCommand;
use cmd::models::ModelsCommand;

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
    /// The gateway's OpenAI batches in the data directory: list (with
    /// progress) and show.
    Batches {
        #[command(subcommand)]
        action: BatchesCommand,
    },
    /// Tenant and swarm membership keys: create, admit a node (a signed,
    /// expiring certificate), revoke, list (specs/network.md).
    Tenants {
        #[command(subcommand)]
        action: gcs_node::tenants::cli::TenantsCommand,
    },
    /// Check a model on the GPU against the CPU decoder and measure its
    /// speed (scripts/gpu-check.sh runs it on a GPU machine).
    GpuCheck(cmd::gpu_check::GpuCheckArgs),
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // pliron (CubeCL's CUDA compiler) logs every kernel's IR after
        // every pass at info: over a million lines on a GPU worker's start.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libp2p=warn,pliron=warn"));
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
    gcs_engine::par::name_global_threads();
    init_logging(cli.run.log_format);
    let result = data_dir(cli.data_dir).and_then(|dir| match cli.command {
        Some(Command::Keys { action }) => cmd::keys::keys(dir, action),
        Some(Command::Batches { action }) => cmd::batches::batches(&dir, action),
        Some(Command::Tenants { action }) => {
            Ok(gcs_node::tenants::cli::run(&dir, action, gcs_node::now_ms())?)
        }
        Some(Command::Models { action }) => cmd::models::models_cmd(action),
        Some(Command::GpuCheck(args)) => cmd::gpu_check::gpu_check(args),
        None => {
            let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            rt.block_on(cmd::run::run(dir, cli.run))
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
