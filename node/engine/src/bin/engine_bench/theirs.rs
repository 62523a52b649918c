//! One round of llama.cpp's side of `engine-bench --model --llama-bench`:
//! `llama-bench -m FILE -t T -p 64,512 -n N -r 1 -o jsonl`, its peak RSS
//! polled from /proc while it runs (it does not report one).

use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ours::status_kib;

/// What one llama-bench run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Round {
    pub pp64: f64,
    pub pp512: f64,
    /// tg at `-n` tokens (128 by default): one stream from an empty context.
    pub tg: f64,
    /// tg at `-n` tokens after `-d ctx` tokens of context (0 when not run).
    #[serde(default)]
    pub tg_ctx: f64,
    pub peak_rss_mib: f64,
    pub build_commit: String,
    pub cpu_info: String,
    pub n_threads: u64,
    pub flash_attn: String,
}

/// Runs llama-bench once, and once more with `-p 0 -d ctx` when `ctx > 0`.
pub fn measure(
    llama_bench: &str,
    file: &str,
    threads: usize,
    tokens: usize,
    ctx: usize,
) -> Result<Round, Box<dyn std::error::Error>> {
    let (out, peak) = bench(llama_bench, file, &["-t", &threads.to_string(), "-p", "64,512", "-n", &tokens.to_string()])?;
    let mut r = parse(&out, tokens)?;
    r.peak_rss_mib = peak;
    if ctx > 0 {
        let args = ["-t", &threads.to_string(), "-p", "0", "-n", &tokens.to_string(), "-d", &ctx.to_string()];
        let (out, peak) = bench(llama_bench, file, &args)?;
        r.tg_ctx = parse_tg(&out, tokens)?;
        r.peak_rss_mib = r.peak_rss_mib.max(peak);
    }
    Ok(r)
}

/// One llama-bench process: its stdout and peak RSS in MiB.
fn bench(
    llama_bench: &str,
    file: &str,
    args: &[&str],
) -> Result<(String, f64), Box<dyn std::error::Error>> {
    let mut child = Command::new(llama_bench)
        .args(["-m", file])
        .args(args)
        .args(["-r", "1", "-o", "jsonl"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {llama_bench}: {e}"))?;
    let status_path = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0.0f64;
    // The output is a few lines, far below a pipe's buffer, so it can be
    // read after the exit.
    let status = loop {
        if let Some(kib) =
            std::fs::read_to_string(&status_path).ok().and_then(|s| status_kib(&s, "VmHWM:"))
        {
            peak_kib = peak_kib.max(kib);
        }
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output()?;
    if !status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(8).collect();
        return Err(format!("llama-bench failed ({status}): {}", tail.join(" | ")).into());
    }
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), peak_kib / 1024.0))
}

/// The tg`tokens` result of a `-p 0 -d N` run (llama-bench's `n_depth`).
pub fn parse_tg(jsonl: &str, tokens: usize) -> Result<f64, String> {
    for line in jsonl.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("llama-bench output: {e}: {line}"))?;
        if v["n_prompt"].as_u64() == Some(0) && v["n_gen"].as_u64() == Some(tokens as u64) {
            return v["avg_ts"].as_f64().ok_or_else(|| format!("no avg_ts in {line}"));
        }
    }
    Err(format!("llama-bench printed no tg{tokens} result: {jsonl}"))
}

/// The pp64, pp512 and tg`tokens` results of llama-bench's jsonl output.
pub fn parse(jsonl: &str, tokens: usize) -> Result<Round, String> {
    let mut r = Round::default();
    let (mut p64, mut p512, mut tg) = (false, false, false);
    for line in jsonl.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("llama-bench output: {e}: {line}"))?;
        let int = |k: &str| v[k].as_u64().unwrap_or(0);
        let ts = v["avg_ts"].as_f64().ok_or_else(|| format!("no avg_ts in {line}"))?;
        match (int("n_prompt"), int("n_gen")) {
            (64, 0) => (r.pp64, p64) = (ts, true),
            (512, 0) => (r.pp512, p512) = (ts, true),
            (0, n) if n == tokens as u64 => (r.tg, tg) = (ts, true),
            _ => continue,
        }
        r.build_commit = v["build_commit"].as_str().unwrap_or_default().to_string();
        r.cpu_info = v["cpu_info"].as_str().unwrap_or_default().to_string();
        r.n_threads = int("n_threads");
        r.flash_attn = match &v["flash_attn"] {
            serde_json::Value::Null => String::new(),
            x => x.to_string(),
        };
    }
    if !(p64 && p512 && tg) {
        return Err(format!("llama-bench printed no pp64/pp512/tg{tokens} results: {jsonl}"));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = r#"{"build_commit": "80fb11a", "cpu_info": "AMD EPYC", "n_threads": 2, "flash_attn": -1, "n_prompt": 64, "n_gen": 0, "avg_ts": 333.5}
{"build_commit": "80fb11a", "cpu_info": "AMD EPYC", "n_threads": 2, "flash_attn": -1, "n_prompt": 512, "n_gen": 0, "avg_ts": 300.25}
{"build_commit": "80fb11a", "cpu_info": "AMD EPYC", "n_threads": 2, "flash_attn": -1, "n_prompt": 0, "n_gen": 128, "avg_ts": 120.0}
"#;

    #[test]
    fn reads_the_three_tests_of_a_run() {
        let r = parse(OUT, 128).unwrap();
        assert_eq!((r.pp64, r.pp512, r.tg), (333.5, 300.25, 120.0));
        assert_eq!(
            (r.build_commit.as_str(), r.n_threads, r.flash_attn.as_str()),
            ("80fb11a", 2, "-1")
        );
    }

    #[test]
    fn reads_a_depth_run() {
        let line = r#"{"n_prompt": 0, "n_gen": 128, "n_depth": 2000, "avg_ts": 61.5}"#;
        assert_eq!(parse_tg(line, 128), Ok(61.5));
        assert!(parse_tg(line, 64).is_err());
    }

    #[test]
    fn a_missing_test_or_other_token_count_is_an_error() {
        assert!(parse(OUT, 256).unwrap_err().contains("tg256"));
        let two: String = OUT.lines().take(2).map(|l| format!("{l}\n")).collect();
        assert!(parse(&two, 128).is_err());
        assert!(parse("{not json", 128).is_err());
        assert!(parse("", 128).is_err());
    }
}
