//! Tool-call answers over real HTTP through the real router: a worker's
//! signed text (scripted here) is read for calls at the gateway, the same
//! way blocking and streamed. Streams carry OpenAI's deltas (the call's
//! index, id, type and name first with empty arguments, then argument
//! pieces, one finish chunk `tool_calls`); a worker's text off the format
//! is content, never a 5xx.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use gcs_gateway::GatewayConfig;
use serde_json::{json, Value};
use support::{exchange, gateway, post, Net, Script};

fn body(stream: bool, choice: Value) -> String {
    json!({"model": "gnus-auto", "stream": stream, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Paris?"}], "tool_choice": choice,
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
    .to_string()
}

/// The text of one call, in pieces that split it anywhere (mid-tag, mid-name).
fn pieces(text: &str, size: usize) -> Vec<String> {
    text.as_bytes().chunks(size).map(|c| String::from_utf8(c.to_vec()).unwrap()).collect()
}

fn events(sse: &str) -> Vec<Value> {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_answered_as_tool_calls_blocking_and_streamed_alike() {
    let net = Net::new(Script::Text(pieces(CALL, 5)));
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    let a =
        exchange(addr, &post("/v1/chat/completions", Some(&key), &body(false, json!("required"))))
            .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let v = a.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], Value::Null);
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(
        (call["type"].as_str(), call["function"]["name"].as_str()),
        (Some("function"), Some("get_weather"))
    );
    assert_eq!(call["function"]["arguments"], "{\"city\": \"Paris\"}");
    let blocking_id = call["id"].as_str().unwrap().to_string();
    assert!(blocking_id.starts_with("call_"), "{blocking_id}");

    let s =
        exchange(addr, &post("/v1/chat/completions", Some(&key), &body(true, json!("auto")))).await;
    assert_eq!(s.status, 200, "{}", s.body);
    let ev = events(&s.body);
    let deltas: Vec<&Value> = ev.iter().map(|e| &e["choices"][0]["delta"]).collect();
    let calls: Vec<&Value> =
        deltas.iter().filter_map(|d| d.get("tool_calls")).map(|t| &t[0]).collect();
    assert!(calls.len() >= 3, "the name, then argument pieces: {}", s.body);
    let first = calls[0];
    assert_eq!(first["index"], 0);
    assert!(first["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(
        (first["type"].as_str(), first["function"]["name"].as_str()),
        (Some("function"), Some("get_weather"))
    );
    assert_eq!(first["function"]["arguments"], "");
    assert_eq!(deltas[0]["role"], "assistant", "the role on the first chunk");
    let args: String =
        calls[1..].iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, "{\"city\": \"Paris\"}");
    assert!(calls[1..].iter().all(|c| c.get("id").is_none() && c["index"] == 0));
    assert!(deltas.iter().all(|d| d.get("content").is_none_or(Value::is_null)), "no content");
    let finishes: Vec<&Value> =
        ev.iter().map(|e| &e["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, [&json!("tool_calls")]);
    assert!(s.body.trim_end().ends_with("data: [DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_off_the_call_format_is_content_and_held_text_is_flushed() {
    // Plain text under auto; text that starts like a call but is not one;
    // a lone "<" that could have opened a call.
    for text in ["It is sunny.", "<tool_call> nope", "<"] {
        let net = Net::new(Script::Text(pieces(text, 3)));
        let (addr, key, _dir) = gateway(net, GatewayConfig::default(), None).await;
        let a =
            exchange(addr, &post("/v1/chat/completions", Some(&key), &body(false, json!("auto"))))
                .await;
        let c = &a.json()["choices"][0];
        assert_eq!(c["message"]["content"], text, "{}", a.body);
        assert!(c["message"].get("tool_calls").is_none());
        assert_ne!(c["finish_reason"], "tool_calls");
        let s =
            exchange(addr, &post("/v1/chat/completions", Some(&key), &body(true, json!("auto"))))
                .await;
        let streamed: String = events(&s.body)
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, text, "{}", s.body);
    }
}
