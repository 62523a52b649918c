//! `gcs-node gpu-check`: the device check `scripts/gpu-check.sh` runs on a
//! GPU machine (which has no Rust toolchain): a model on `--gpu N` against
//! the CPU decoder (greedy and teacher-forced top-1 on the fixture's
//! prompts, max |Δ logit|) and its decode and prefill speed through the
//! batch scheduler a worker serves with (`gcs_engine::devcheck`). Prints the
//! report as JSON and writes it to `--out`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use gcs_engine::backend::ComputeDevice;
use gcs_engine::devcheck::{run_with, CheckConfig, CheckReport};

/// `gcs-node gpu-check …`.
#[derive(Args, Debug)]
pub struct GpuCheckArgs {
    /// The GGUF file to check (a llama with Q4_0/Q4_1/Q8_0 weights).
    #[arg(long)]
    model: PathBuf,
    /// The device, as a worker's `--gpu` (0: a wgpu build's default adapter).
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Compare the CPU with itself (the check's own test; no GPU needed).
    #[arg(long)]
    cpu: bool,
    /// llama.cpp fixture whose `prompts[].prompt_tokens` are compared
    /// (node/engine/tests/fixtures/smollm2_llamacpp.json).
    #[arg(long)]
    prompts: PathBuf,
    /// Prompts compared (the fixture's first N).
    #[arg(long, default_value_t = 20)]
    max_prompts: usize,
    /// Greedy tokens compared per prompt.
    #[arg(long, default_value_t = 32)]
    greedy_tokens: usize,
    /// Prompts whose full logits are compared.
    #[arg(long, default_value_t = 3)]
    logit_prompts: usize,
    /// Streams of each decode measurement.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 64, 256])]
    batches: Vec<usize>,
    /// Tokens per stream in a decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Prompt length of the prefill / TTFT figure.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Timed steps of issue 17's naive burn loop at each batch size, on
    /// the same device (0: skip it).
    #[arg(long, default_value_t = 20)]
    naive_steps: usize,
    /// A BERT embedder's folder (config.json, tokenizer.json,
    /// model.safetensors) to compare with the CPU's and time on the device.
    #[arg(long)]
    embed_dir: Option<PathBuf>,
    /// Texts per batch of the embedder's figures.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 32, 256])]
    embed_batches: Vec<usize>,
    /// Write the JSON report here too.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn fixture_prompts(path: &Path, n: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).context("the prompts fixture")?;
    let prompts = v["prompts"].as_array().context("no `prompts` array in the fixture")?;
    prompts
        .iter()
        .take(n)
        .map(|p| {
            let ids = p["prompt_tokens"].as_array().context("a prompt without prompt_tokens")?;
            ids.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).context("a bad token id"))
                .collect()
        })
        .collect()
}

pub fn gpu_check(a: GpuCheckArgs) -> anyhow::Result<()> {
    let device =
        if a.cpu { ComputeDevice::Cpu } else { ComputeDevice::from_gpu_flag(Some(a.gpu)) };
    let cfg = CheckConfig {
        model: a.model,
        device,
        prompts: fixture_prompts(&a.prompts, a.max_prompts)?,
        greedy_tokens: a.greedy_tokens,
        logit_prompts: a.logit_prompts,
        batches: a.batches,
        decode_tokens: a.decode_tokens,
        prefill_tokens: a.prefill_tokens,
        naive_steps: a.naive_steps,
        embed_dir: a.embed_dir,
        embed_batches: a.embed_batches,
    };
    // The report is written after each phase: a check stopped by its
    // timeout in a later phase keeps what the earlier ones found.
    let out = a.out;
    let mut write = |r: &CheckReport| {
        if let (Some(path), Ok(json)) = (&out, serde_json::to_string_pretty(r)) {
            if let Err(e) = std::fs::write(path, json) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the report");
            }
        }
    };
    let report = run_with(&cfg, &mut write).with_context(|| format!("the check on {device:?}"))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
