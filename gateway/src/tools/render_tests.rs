#![allow(clippy::unwrap_used)]
use super::*;
use crate::payload::{ToolCall, ToolChoice};

fn tools() -> Tools {
    Tools {
        functions: vec![Tool {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: r#"{"type":"object","properties":{"city":{"type":"string"}}}"#.into(),
            loose: false,
        }],
        choice: ToolChoice::Auto,
        max_calls: 1,
    }
}

fn round_trip() -> Vec<Message> {
    vec![
        Message::text(Role::User, "Weather in Paris?"),
        Message {
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city": "Paris"}"#.into(),
            }],
            ..Message::text(Role::Assistant, "")
        },
        Message { tool_call_id: Some("call_1".into()), ..Message::text(Role::Tool, "18 C") },
        Message { tool_call_id: Some("call_2".into()), ..Message::text(Role::Tool, "sunny") },
    ]
}

#[test]
fn the_fallback_lists_the_tools_in_a_system_turn_and_shows_calls_and_results_as_blocks() {
    let t = tools();
    let r = template_input(&round_trip(), Some(&t), false);
    assert_eq!(r.tools, None);
    let roles: Vec<&str> = r.messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    let sys = r.messages[0]["content"].as_str().unwrap();
    assert!(sys.contains("<tools>\n{\"type\":\"function\""), "{sys}");
    assert!(sys.contains("\"name\":\"get_weather\"") && sys.contains("Weather in a city"));
    assert!(sys.contains("<tool_call>"), "{sys}");
    assert_eq!(
        r.messages[2]["content"],
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
    );
    // Both results of the round in one user turn, in order.
    assert_eq!(
        r.messages[3]["content"],
        "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    );
    assert!(r.messages.iter().all(|m| m.as_object().unwrap().len() == 2), "role and content only");
}

#[test]
fn the_fallback_extends_the_clients_system_prompt() {
    let mut msgs = round_trip();
    msgs.insert(0, Message::text(Role::System, "Be brief."));
    let r = template_input(&msgs, Some(&tools()), false);
    let sys = r.messages[0]["content"].as_str().unwrap();
    assert!(sys.starts_with("Be brief.\n\n# Tools"), "{sys}");
    assert_eq!(r.messages.len(), 4, "no second system turn");
}

#[test]
fn without_tools_the_history_is_still_rendered_but_no_section() {
    let r = template_input(&round_trip(), None, false);
    assert_eq!(r.messages[0]["role"], "user");
    assert!(!r.messages.iter().any(|m| m["content"].as_str().unwrap().contains("<tools>")));
    assert!(r.messages[2]["content"].as_str().unwrap().starts_with("<tool_response>"));
}

#[test]
fn a_native_template_gets_openai_shaped_messages_and_the_tools() {
    let r = template_input(&round_trip(), Some(&tools()), true);
    let t = r.tools.unwrap();
    assert_eq!(t[0]["function"]["parameters"]["properties"]["city"]["type"], "string");
    let call = &r.messages[1]["tool_calls"][0];
    assert_eq!(call["function"]["arguments"]["city"], "Paris", "arguments as an object");
    assert_eq!((call["id"].as_str(), call["type"].as_str()), (Some("call_1"), Some("function")));
    assert_eq!(
        (r.messages[2]["role"].as_str(), r.messages[2]["tool_call_id"].as_str()),
        (Some("tool"), Some("call_1"))
    );
}
