//! Shared by the node's loopback tests and benches (included with
//! `#[path]`): a node on an ephemeral 127.0.0.1 port, no mDNS, fast
//! heartbeats, serving one stand-in model.

use std::time::Duration;

use gcs_node::{NodeConfig, Role};
use gcs_protocol::{ApiType, ModelInfo};

/// A stand-in chat model (only a scripted executor serves it).
pub fn model(model_id: &str, aliases: &[&str]) -> ModelInfo {
    ModelInfo {
        model_id: model_id.into(),
        aliases: aliases.iter().map(|a| a.to_string()).collect(),
        context_tokens: 2048,
        quantization: "f32".into(),
        backend: "scripted".into(),
        tasks: vec![ApiType::ChatCompletion],
        vocab_size: 0,
        ..Default::default()
    }
}

/// `role` in `dir`, bootstrapping from `boot`: registrations every 300 ms,
/// valid 3 s; serving [`model`] `test-model` (`gnus-test`).
pub fn config(role: Role, dir: &tempfile::TempDir, boot: Vec<libp2p::Multiaddr>) -> NodeConfig {
    let mut c = NodeConfig::new(role, dir.path().to_path_buf());
    c.network.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    c.network.bootstrap = boot;
    c.network.mdns = false;
    c.heartbeat_interval = Duration::from_millis(300);
    c.registration_ttl = Duration::from_millis(3_000);
    c.models = vec![model("test-model", &["gnus-test"])];
    c
}

/// The node's first listen address (it must have one within 30 s).
#[allow(dead_code)] // not every test that includes this file dials a node
pub async fn addr(n: &gcs_node::NodeHandle) -> libp2p::Multiaddr {
    let t = std::time::Instant::now();
    loop {
        if let Some(a) = n.listen_addrs().await.unwrap().into_iter().next() {
            return a;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no listen address after 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
