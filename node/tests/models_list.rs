//! `gcs-node models list --model PATH` (issue 18): files served by path are
//! listed with what the engine reads from them (id, architecture,
//! quantization, served context, size, hash), catalogue names as before,
//! and a file that cannot be served with its error and exit status 1.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::process::Command;

use procs::{model_dir, BIN};

/// The field `key=value` of a listing line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let pre = format!("{key}=");
    line.split("  ").find_map(|f| f.strip_prefix(&pre)).unwrap_or_else(|| panic!("{key} in {line}"))
}

#[test]
fn list_describes_files_served_by_path_and_their_errors() {
    let dir = model_dir();
    let smol = dir.join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let gemma = dir.join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    for (file, name) in [(&smol, "smollm2"), (&gemma, "gemma3-270m")] {
        if !file.is_file() {
            prereq::missing(
                &file.display().to_string(),
                &format!("run scripts/fetch-models.sh {name}"),
            );
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let list = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["models", "list"])
            .args(args)
            .env("GCS_MODEL_DIR", &dir)
            .env_remove("GCS_MODEL")
            .env_remove("GCS_MODEL_ID")
            .env_remove("GCS_CTX")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };

    // Two files by path, one with its own id, the context capped.
    let (smol_s, gemma_s) = (smol.display().to_string(), gemma.display().to_string());
    let (code, out, err) =
        list(&["--model", &gemma_s, "--model", &smol_s, "--model-id", "my-gemma", "--ctx", "4096"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let (g, s) = (lines[0], lines[1]);
    assert!(g.starts_with("my-gemma  "), "{g}");
    assert_eq!(field(g, "arch"), "gemma3");
    assert_eq!(field(g, "quantization"), "q4_k_m");
    assert_eq!(field(g, "context"), "4096");
    assert_eq!(field(g, "size"), "253113024");
    assert_eq!(field(g, "chat"), "true");
    assert_eq!(field(g, "path"), gemma_s);
    assert!(s.starts_with("smollm2-135m-8k-lc100k-mix1-ep2  "), "the id from general.name: {s}");
    assert_eq!(field(s, "arch"), "llama");
    assert_eq!(field(s, "quantization"), "q4_1");
    assert_eq!(field(s, "context"), "4096");
    assert_eq!(field(s, "size"), std::fs::metadata(&smol).unwrap().len().to_string());
    let hash = field(s, "hash").strip_prefix("blake3:").unwrap();
    assert_eq!(hash.len(), 64);
    assert!(hash.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(field(g, "hash"), field(s, "hash"));

    // GCS_MODEL works like --model; a catalogue name is listed as before.
    let out = Command::new(BIN)
        .args(["models", "list", "--model", "gnus-embed"])
        .env("GCS_MODEL_DIR", &dir)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success() && text.starts_with("all-minilm-l6-v2  aliases="), "{text}");
    let out = Command::new(BIN)
        .args(["models", "list"])
        .env("GCS_MODEL_DIR", &dir)
        .env("GCS_MODEL", &smol_s)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("smollm2-135m-8k-lc100k-mix1-ep2  arch=llama  "), "{text}");

    // Unservable files: each with its error, the others still listed, exit 1.
    let junk = tmp.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &std::fs::read(&smol).unwrap()[..100_000]).unwrap();
    let missing = tmp.path().join("missing.gguf");
    let (junk_s, cut_s, missing_s) =
        (junk.display().to_string(), cut.display().to_string(), missing.display().to_string());
    let (code, out, err) =
        list(&["--model", &junk_s, "--model", &smol_s, "--model", &cut_s, "--model", &missing_s]);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(err.contains("3 model file(s) cannot be served"), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(
        lines[0].starts_with(&format!("{junk_s}  error: ")) && lines[0].contains("magic"),
        "{}",
        lines[0]
    );
    assert!(lines[1].starts_with("smollm2-135m-8k-lc100k-mix1-ep2  arch=llama"), "{}", lines[1]);
    assert!(
        lines[2].starts_with(&format!("{cut_s}  error: ")) && lines[2].contains("truncated"),
        "{}",
        lines[2]
    );
    assert!(lines[3].starts_with(&format!("{missing_s}  error: ")), "{}", lines[3]);
}
