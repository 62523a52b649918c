//! `gcs-node --role worker --gpu 0` on a build or machine that cannot serve
//! on a GPU exits at start, non-zero, with the reason (issue 17): without
//! the `cuda` feature "no CUDA support"; with it and no driver "no CUDA
//! driver found"; never burn-cuda's panic, and before any model loads.
//! (A `wgpu` build serves on the default adapter: tests/gpu_serve.rs.)

#![cfg(not(feature = "wgpu"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gcs-node");

#[test]
fn worker_with_gpu_exits_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["--role", "worker", "--gpu", "0", "--no-mdns"])
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", dir.path().to_str().unwrap()])
        .env("GCS_MODEL_DIR", models.path())
        .env_remove("GCS_GPU")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("gcs-node --gpu 0 was still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "exit status {status}; stderr: {err}");
    assert_eq!(status.code(), Some(1), "an error exit, not a panic or a signal; stderr: {err}");
    assert!(err.contains("error: --gpu 0: "), "{err}");
    let expected = if cfg!(feature = "cuda") {
        ["no CUDA driver found", "no CUDA device 0", "is not a usable CUDA driver"]
            .iter()
            .any(|m| err.contains(m))
    } else {
        err.contains("this build has no CUDA support") && err.contains("--features cuda")
    };
    assert!(expected, "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
