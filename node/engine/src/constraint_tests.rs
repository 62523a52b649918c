#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The grammar rules on a byte-level vocabulary (token id = byte value),
//! so each test can walk a text byte by byte.

use std::time::{Duration, Instant};

use llguidance::toktrie::ApproximateTokEnv;

use super::*;

fn compiler() -> (GrammarCompiler, u32) {
    let env = ApproximateTokEnv::single_byte_env();
    let eos = env.tok_trie().eos_token();
    (GrammarCompiler::with_env(&env).unwrap(), eos)
}

/// Feeds `text` one byte at a time; `Err(i)` at the first byte the grammar refuses.
fn walk(g: &mut SeqGrammar, eos: u32, text: &str) -> std::result::Result<TokenMask, usize> {
    for (i, b) in text.bytes().enumerate() {
        let m = g.mask(eos).unwrap();
        if !m.allows(u32::from(b)) {
            return Err(i);
        }
        g.commit(u32::from(b)).unwrap();
    }
    Ok(g.mask(eos).unwrap())
}

const PERSON: &str = r##"{"type":"object","properties":{
    "name":{"type":"string"},
    "role":{"enum":["admin","user"]},
    "tags":{"type":"array","items":{"type":"string"}},
    "boss":{"anyOf":[{"$ref":"#/$defs/ref"},{"type":"null"}]}},
  "required":["name","role","tags","boss"],"additionalProperties":false,
  "$defs":{"ref":{"type":"object","properties":{"id":{"type":"integer"}},
    "required":["id"],"additionalProperties":false}}}"##;

#[test]
fn a_schema_admits_exactly_its_documents_in_the_engines_layout() {
    let (c, eos) = compiler();
    let g = Grammar::JsonSchema(PERSON.into());
    let ok = r#"{"name": "Ann", "role": "admin", "tags": ["a", "b"], "boss": {"id": 7}}"#;
    let m = walk(&mut c.compile(&g).unwrap(), eos, ok).expect("valid document");
    assert!(m.accepting, "a complete document may end");
    let null_boss = r#"{"name": "Ann", "role": "user", "tags": [], "boss": null}"#;
    assert!(walk(&mut c.compile(&g).unwrap(), eos, null_boss).unwrap().accepting);
    // An enum value outside the list, a missing separator space, free
    // whitespace, an unknown key: each refused at the offending byte.
    let bad_enum = r#"{"name": "Ann", "role": "root""#;
    assert_eq!(walk(&mut c.compile(&g).unwrap(), eos, bad_enum).err(), Some(25));
    assert_eq!(walk(&mut c.compile(&g).unwrap(), eos, r#"{"name":"A"#).err(), Some(8));
    assert_eq!(walk(&mut c.compile(&g).unwrap(), eos, "{ ").err(), Some(1));
    assert_eq!(walk(&mut c.compile(&g).unwrap(), eos, r#"{"x"#).err(), Some(2));
    // Not accepting half way.
    let half = walk(&mut c.compile(&g).unwrap(), eos, r#"{"name": "A"#).unwrap();
    assert!(!half.accepting);
}

#[test]
fn json_object_admits_any_object_and_nothing_else() {
    let (c, eos) = compiler();
    let doc = r#"{"a": [1, 2.5, true, null], "b": {"c": "d"}}"#;
    let mut g = c.compile(&Grammar::JsonObject).unwrap();
    assert!(walk(&mut g, eos, doc).unwrap().accepting);
    assert!(g.is_stopped(), "nothing may follow a complete object");
    assert_eq!(walk(&mut c.compile(&Grammar::JsonObject).unwrap(), eos, "[1]").err(), Some(0));
    assert_eq!(walk(&mut c.compile(&Grammar::JsonObject).unwrap(), eos, "\"s\"").err(), Some(0));
}

#[test]
fn a_fork_has_its_own_state() {
    let (c, eos) = compiler();
    let mut a = c.compile(&Grammar::JsonObject).unwrap();
    walk(&mut a, eos, r#"{"k": "#).unwrap();
    let mut b = a.fork();
    walk(&mut a, eos, "1}").unwrap();
    assert!(a.is_stopped());
    assert!(!b.is_stopped());
    assert!(walk(&mut b, eos, "\"v\"}").unwrap().accepting);
}

#[test]
fn unsupported_or_malformed_schemas_are_refused_by_name() {
    let (c, _) = compiler();
    for (schema, what) in [
        (r##"{"type":"object","properties":{"a":{"$ref":"#/$defs/missing"}}}"##, "missing"),
        (r#"{"type":"strung"}"#, "strung"),
        ("[1, 2]", "must be an object"),
        ("{not json", "json schema"),
    ] {
        let e = c.compile(&Grammar::JsonSchema(schema.into())).unwrap_err().to_string();
        assert!(e.contains(what), "{schema}: {e}");
    }
    let big = format!(r#"{{"description":"{}"}}"#, "x".repeat(MAX_GRAMMAR_BYTES));
    let e = c.compile(&Grammar::JsonSchema(big)).unwrap_err().to_string();
    assert!(e.contains("exceeds"), "{e}");
}

#[test]
fn a_hostile_schema_fails_fast_instead_of_stalling() {
    let (c, _) = compiler();
    // Nested string patterns with large counted repetitions blow up the
    // lexer's automaton; the fuel limit stops the compile.
    let props: Vec<String> = (0..40)
        .map(|i| format!(r#""p{i}":{{"type":"string","pattern":"^(a|b)*a(a|b){{20}}$"}}"#))
        .collect();
    let schema = format!(
        r#"{{"type":"object","properties":{{{}}},"additionalProperties":false}}"#,
        props.join(",")
    );
    let t = Instant::now();
    let r = c.compile(&Grammar::JsonSchema(schema));
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    if let Err(e) = r {
        assert!(e.to_string().contains("response_format"), "{e}");
    }
}

#[test]
fn a_lark_grammar_holds_a_call_to_its_inlined_schema_and_is_bounded() {
    let (c, eos) = compiler();
    // The shape gcs_gateway::tools::grammar builds: a fixed call envelope
    // around an inlined JSON Schema.
    let g = Grammar::Lark(concat!(
        r#"start: "<tool_call>\n{\"name\": \"f\", \"arguments\": " %json {"type":"object","#,
        r#""properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false,"#,
        r#""x-guidance":{"item_separator":", ","key_separator":": ","whitespace_flexible":false}}"#,
        r#" "}\n</tool_call>""#,
        "\n"
    ).into());
    let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 7}}\n</tool_call>";
    let m = walk(&mut c.compile(&g).unwrap(), eos, call).expect("the call");
    assert!(m.accepting);
    let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": \"7\"";
    assert_eq!(
        walk(&mut c.compile(&g).unwrap(), eos, bad).err(),
        bad.rfind("\"7"),
        "a string for n"
    );
    assert!(walk(&mut c.compile(&g).unwrap(), eos, "text").is_err());
    let e = c.compile(&Grammar::Lark("start: ".to_string() + &"\"a\" ".repeat(MAX_LARK_BYTES)));
    assert!(e.unwrap_err().to_string().contains("exceeds"));
    let e = c.compile(&Grammar::Lark("start: nowhere".into())).unwrap_err().to_string();
    assert!(e.starts_with("invalid request: tools") || e.contains("tools"), "{e}");
}

/// A mask's words allow what the host's rule allows: the vector's tokens,
/// except that each stop token (EOS, stop ids, one past the vocabulary)
/// is allowed exactly when the grammar may end; nothing past them.
#[test]
fn mask_words_allow_the_tokens_and_the_stops_when_the_grammar_may_end() {
    let (c, eos) = compiler();
    let g = Grammar::JsonSchema(PERSON.into());
    let done = r#"{"name": "Ann", "role": "user", "tags": [], "boss": null}"#;
    for text in [r#"{"name": "A"#, done, "{"] {
        let m = walk(&mut c.compile(&g).unwrap(), eos, text).unwrap();
        let stops = [eos, u32::from(b'}'), 300];
        let words = m.words(&stops);
        assert_eq!(words.len(), 301usize.div_ceil(32));
        let rule = |t: u32| if stops.contains(&t) { m.accepting } else { m.allows(t) };
        for t in 0..words.len() as u32 * 32 + 40 {
            assert_eq!(word_allows(&words, t), rule(t), "{text:?}: token {t}");
        }
        assert!((0..256).any(|t| word_allows(&words, t)), "{text:?}: something may follow");
    }
}
