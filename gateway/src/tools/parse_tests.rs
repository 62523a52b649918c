#![allow(clippy::unwrap_used)]
use super::*;

const ONE: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"q\": \"a}\\\"b\"}}\n</tool_call>";

/// Every split of `text` into two pieces reads the same as the whole.
fn by_pieces(text: &str, max: usize) -> Vec<Answer> {
    (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .map(|i| {
            let mut r = CallReader::new(max);
            let mut ev = r.push(&text[..i]);
            ev.extend(r.push(&text[i..]));
            ev.extend(r.finish());
            collect(ev)
        })
        .collect()
}

#[test]
fn one_call_gives_its_name_and_raw_arguments() {
    let a = answer(ONE, 1);
    assert_eq!(a.content, "");
    assert_eq!(
        a.calls,
        vec![("get_weather".into(), r#"{"city": "Paris", "q": "a}\"b"}"#.to_string())]
    );
    for p in by_pieces(ONE, 1) {
        assert_eq!(p, a);
    }
}

#[test]
fn the_stream_names_the_call_before_any_argument() {
    let mut r = CallReader::new(1);
    let mut ev = vec![];
    for c in ONE.chars() {
        ev.extend(r.push(&c.to_string()));
    }
    ev.extend(r.finish());
    assert_eq!(ev[0], CallEvent::Start { index: 0, name: "get_weather".into() });
    assert!(ev[1..].iter().all(|e| matches!(e, CallEvent::Arguments { index: 0, .. })));
    assert!(ev.len() > 10, "arguments arrive in many deltas: {}", ev.len());
}

#[test]
fn parallel_calls_up_to_the_limit_the_rest_dropped() {
    let two = format!("{ONE}\n{}", ONE.replace("get_weather", "get_time"));
    let a = answer(&two, 8);
    let names: Vec<&str> = a.calls.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    for p in by_pieces(&two, 8) {
        assert_eq!(p, a);
    }
    let mut r = CallReader::new(1);
    let a = collect([r.push(&two), r.finish()].concat());
    assert_eq!(a.calls.len(), 1);
    assert!(r.dropped > 0, "the second call is dropped and counted");
}

#[test]
fn text_that_does_not_open_a_call_is_content() {
    for t in
        ["Hello there", "<b>bold</b>", "<tool", "", "<tool_call>oops, not json", "  <tool_call>"]
    {
        let a = answer(t, 1);
        assert_eq!((a.content.as_str(), a.calls.len()), (t, 0), "{t:?}");
        for p in by_pieces(t, 1) {
            assert_eq!(p, a, "{t:?}");
        }
    }
}

#[test]
fn a_hostile_header_is_bounded_and_becomes_content() {
    let t = format!("<tool_call>\n{{\"name\": \"{}", "a".repeat(100));
    assert_eq!(answer(&t, 1).content, t);
    let t = format!("<tool_call>\n{}", " ".repeat(MAX_HEADER + 1));
    assert_eq!(answer(&t, 1).content, t);
    // A name with a character OpenAI's names cannot have.
    let t = "<tool_call>\n{\"name\": \"a b\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(answer(t, 1).calls.len(), 0);
}

#[test]
fn a_truncated_call_keeps_what_was_generated() {
    let cut = &ONE[..ONE.find("Paris").unwrap()];
    let a = answer(cut, 1);
    assert_eq!(a.calls, vec![("get_weather".into(), "{\"city\": \"".to_string())]);
}

#[test]
fn junk_after_a_call_is_dropped_not_content() {
    let mut r = CallReader::new(4);
    let a = collect([r.push(&format!("{ONE}\nand some text")), r.finish()].concat());
    assert_eq!((a.calls.len(), a.content.as_str()), (1, ""));
    assert!(r.dropped >= "and some text".len());
}

#[test]
fn the_format_is_what_call_text_writes() {
    let t = super::super::call_text("f-1", "{}");
    assert_eq!(answer(&t, 1).calls, vec![("f-1".to_string(), "{}".to_string())]);
}
