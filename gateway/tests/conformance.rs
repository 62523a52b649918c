//! The checks a careful OpenAI client makes, over real HTTP against the real
//! router and edge (`serve_with`): every malformed or refused request gets
//! a 4xx OpenAI error envelope — never a 5xx, never a stream — and nothing
//! reaches the network. The network behind it is scripted (tests/support)
//! and would stream if asked; only the edge's answers are under test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use gcs_gateway::GatewayConfig;
use support::{exchange, gateway, post, Net, Script};

fn raw(path: &str, key: &str, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let ct = content_type.map(|c| format!("Content-Type: {c}\r\n")).unwrap_or_default();
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{ct}\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_careful_clients_checks_all_get_4xx_envelopes() {
    let net = Net::new(Script::Stream {
        first_after: Duration::from_millis(10),
        gap: Duration::from_millis(1),
        tokens: 2,
    });
    let config = GatewayConfig { max_body_bytes: 64 << 10, ..GatewayConfig::default() };
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let chat = "/v1/chat/completions";
    let user = serde_json::json!([{"role": "user", "content": "hi"}]);
    let body = |v: serde_json::Value| v.to_string();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "empty messages",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "messages": []})),
            ),
            400,
            "messages",
        ),
        (
            "empty messages, streamed",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "stream": true, "messages": []})),
            ),
            400,
            "messages",
        ),
        (
            "unknown role",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto",
                                         "messages": [{"role": "wizard", "content": "hi"}]})),
            ),
            400,
            "messages[0].role",
        ),
        (
            "temperature above 2",
            post(
                chat,
                Some(&key),
                &body(
                    serde_json::json!({"model": "gnus-auto", "temperature": 2.5, "messages": user}),
                ),
            ),
            400,
            "temperature",
        ),
        (
            "negative temperature, streamed",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "stream": true,
                                         "temperature": -0.1, "messages": user})),
            ),
            400,
            "temperature",
        ),
        (
            "unknown model",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gpt-17-ultra", "messages": user})),
            ),
            404,
            "model",
        ),
        (
            "a chat model for embeddings",
            post(
                "/v1/embeddings",
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "input": "x"})),
            ),
            400,
            "model",
        ),
        (
            "malformed JSON",
            post(chat, Some(&key), "{\"model\": \"gnus-auto\", \"messages\": ["),
            400,
            "",
        ),
        ("a JSON array", post(chat, Some(&key), "[1, 2]"), 400, "body"),
        ("missing body", raw(chat, &key, Some("application/json"), b""), 400, ""),
        (
            "missing model",
            post(chat, Some(&key), &body(serde_json::json!({"messages": user}))),
            400,
            "model",
        ),
        (
            "wrong content type (form)",
            raw(chat, &key, Some("application/x-www-form-urlencoded"), b"model=gnus-auto"),
            415,
            "",
        ),
        (
            "wrong content type (text)",
            raw(
                chat,
                &key,
                Some("text/plain"),
                body(serde_json::json!({"model": "gnus-auto", "messages": user})).as_bytes(),
            ),
            415,
            "",
        ),
        ("huge body", raw(chat, &key, Some("application/json"), &vec![b' '; 65 << 10]), 413, ""),
        (
            "no key",
            post(chat, None, &body(serde_json::json!({"model": "gnus-auto", "messages": user}))),
            401,
            "",
        ),
        (
            "GET on a POST route",
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            405,
            "",
        ),
        ("unknown path", post("/v1/chat/complete", Some(&key), "{}"), 404, ""),
        (
            "n out of range",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "n": 0, "messages": user})),
            ),
            400,
            "n",
        ),
        (
            "max_tokens as a string",
            post(
                chat,
                Some(&key),
                &body(
                    serde_json::json!({"model": "gnus-auto", "max_tokens": "10", "messages": user}),
                ),
            ),
            400,
            "max_tokens",
        ),
        (
            "tool_choice naming no tool",
            post(
                chat,
                Some(&key),
                &body(serde_json::json!({"model": "gnus-auto", "messages": user,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            ),
            400,
            "tool_choice",
        ),
    ];
    for (what, req, status, param) in cases {
        let a = exchange(addr, &req).await;
        assert!(!a.head.contains("text/event-stream"), "{what}: a stream\n{}", a.head);
        let v = a.assert_envelope(status);
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{what}: {v}");
        }
        let kind = v["error"]["type"].as_str().unwrap();
        assert!(
            ["invalid_request_error", "permission_error"].contains(&kind),
            "{what}: a client error's type: {v}"
        );
    }
    assert_eq!(net.submitted(), 0, "no refused request reached the network");
    // A declared length over the limit is refused before any byte of it.
    let head = format!(
        "POST {chat} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 999999999\r\nConnection: close\r\n\r\n"
    );
    exchange(addr, head.as_bytes()).await.assert_envelope(413);
    // And the same edge serves a well-formed request.
    let ok =
        post(chat, Some(&key), &body(serde_json::json!({"model": "gnus-auto", "messages": user})));
    let a = exchange(addr, &ok).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["object"], "chat.completion");
}
