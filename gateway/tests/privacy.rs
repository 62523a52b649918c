//! `gnus.privacy_mode` over real HTTP against the real router: an
//! `encrypted_payload` request reaches the network as such (its job then
//! travels sealed, node/tests/sealed_payload.rs), with any routing mode;
//! a stacked or unknown mode is a 400 naming `gnus.privacy_mode` and
//! reaches no network. The network behind the edge is scripted
//! (tests/support).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use gcs_gateway::GatewayConfig;
use gcs_protocol::{PrivacyLevel, RoutingMode};
use serde_json::{json, Value};
use support::{exchange, gateway, post, Net, Script};

const CHAT: &str = "/v1/chat/completions";

fn body(gnus: Value) -> String {
    json!({"model": "gnus-auto", "messages": [{"role": "user", "content": "hi"}], "gnus": gnus})
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_payload_reaches_the_network_and_stacked_modes_are_a_400() {
    let net = Net::new(Script::Stream {
        first_after: Duration::from_millis(5),
        gap: Duration::from_millis(1),
        tokens: 2,
    });
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    for bad in [json!(["encrypted_payload", "private_pool"]), json!("sealed"), json!(7)] {
        let a = exchange(addr, &post(CHAT, Some(&key), &body(json!({"privacy_mode": bad})))).await;
        let v = a.assert_envelope(400);
        assert_eq!(v["error"]["param"], "gnus.privacy_mode", "{bad}: {v}");
    }
    assert_eq!(net.submitted(), 0, "a refused mode reached the network");
    let a = exchange(
        addr,
        &post(CHAT, Some(&key), &body(json!({"privacy_mode": "encrypted_payload"}))),
    )
    .await;
    assert_eq!(a.status, 200, "{} {}", a.head, a.body);
    let jobs = net.jobs.lock().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].routing.privacy_mode, PrivacyLevel::EncryptedPayload);
    assert_eq!(jobs[0].routing.network, RoutingMode::Public);
}
