use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::NodeKey;

fn reg(seed: u8, edit: impl FnOnce(&mut ModelInfo)) -> NodeRegistration {
    let k = NodeKey::from_seed([seed; 32]);
    let mut r = samples::registration(&k, &Params::default());
    edit(&mut r.models[0]);
    r
}

fn honest(seed: u8) -> NodeRegistration {
    reg(seed, |_| {})
}

/// The sample registration's model, as the build's catalogue would trust it.
fn trusted() -> ModelPolicy {
    let m = &honest(1).models[0];
    ModelPolicy { trusted: vec![Trusted::from_info(m)], only_trusted: false }
}

fn ctx(c: &Catalog, name: &str) -> Option<u32> {
    c.get(name).map(|s| s.info.context_tokens)
}

#[test]
fn agreement_a_lone_outlier_changes_nothing() {
    let liar = reg(9, |m| m.context_tokens = 1);
    let regs = [honest(1), honest(2), liar];
    let c = build(&regs, &ModelPolicy::default());
    assert_eq!(ctx(&c, "gnus-auto"), Some(8192));
    assert_eq!(ctx(&c, "smollm2-135m-instruct"), Some(8192));
    assert_eq!(c["gnus-auto"].workers, 2, "only the agreeing registrations count");
}

#[test]
fn agreement_ties_go_to_the_larger_context_whatever_the_order() {
    for (a, b) in [(1u8, 9u8), (9, 1)] {
        let regs = [reg(a, |_| {}), reg(b, |m| m.context_tokens = 1)];
        let c = build(&regs, &ModelPolicy::default());
        assert_eq!(ctx(&c, "gnus-auto"), Some(8192), "seeds {a}/{b}");
    }
}

#[test]
fn agreement_an_alias_is_not_hijacked_by_one_registration() {
    let hijack = reg(9, |m| {
        m.model_id = "aaa-evil".into();
        m.aliases = vec!["gnus-auto".into()];
    });
    let regs = [honest(1), honest(2), hijack];
    let c = build(&regs, &ModelPolicy::default());
    assert_eq!(c["gnus-auto"].info.model_id, "smollm2-135m-instruct");
    // Its own id is its own business: served, under agreement of one.
    assert_eq!(c["aaa-evil"].workers, 1);
}

#[test]
fn one_vote_per_node_and_name() {
    let k = NodeKey::from_seed([9; 32]);
    let mut r = samples::registration(&k, &Params::default());
    let bad = ModelInfo { context_tokens: 1, ..r.models[0].clone() };
    r.models = vec![bad; 5];
    let c = build(&[honest(1), honest(2), r], &ModelPolicy::default());
    assert_eq!(ctx(&c, "gnus-auto"), Some(8192));
}

#[test]
fn trusted_models_override_any_majority() {
    let regs: Vec<_> = (10..20).map(|s| reg(s, |m| m.context_tokens = 1)).collect();
    let mut all = regs.clone();
    all.push(honest(1));
    let c = build(&all, &trusted());
    assert_eq!(ctx(&c, "gnus-auto"), Some(8192), "ten sybils agree on a lie");
    assert_eq!(c["gnus-auto"].workers, 11, "they still serve the trusted id");
    let hijack: Vec<_> = (10..20)
        .map(|s| {
            reg(s, |m| {
                m.model_id = "aaa-evil".into();
                m.aliases = vec!["gnus-auto".into()];
            })
        })
        .collect();
    let mut all = hijack;
    all.push(honest(1));
    let c = build(&all, &trusted());
    assert_eq!(c["gnus-auto"].info.model_id, "smollm2-135m-instruct");
    assert_eq!(c["gnus-auto"].workers, 1, "only the trusted id's workers serve its names");
}

#[test]
fn an_allow_list_serves_only_its_models_with_its_context() {
    let p = ModelPolicy {
        trusted: vec![Trusted {
            model_id: "smollm2-135m-instruct".into(),
            context_tokens: 2048,
            aliases: vec![],
            tasks: vec![],
        }],
        only_trusted: true,
    };
    let other = reg(3, |m| {
        m.model_id = "other-model".into();
        m.aliases = vec![];
    });
    let c = build(&[honest(1), other], &p);
    assert_eq!(ctx(&c, "smollm2-135m-instruct"), Some(2048));
    assert_eq!(ctx(&c, "gnus-auto"), Some(2048), "aliases and tasks come from the network");
    assert_eq!(c["gnus-auto"].info.tasks, honest(1).models[0].tasks);
    assert!(!c.contains_key("other-model"), "not on the allow-list");
    assert!(build(&[], &p).is_empty(), "nobody serves it: not listed");
}

#[test]
fn offline_and_draining_registrations_have_no_vote() {
    let mut off = reg(9, |m| m.context_tokens = 1);
    off.status = NodeStatus::Draining;
    let c = build(&[honest(1), off], &ModelPolicy::default());
    assert_eq!(c["gnus-auto"].workers, 1);
}

#[test]
fn seen_models_are_bounded_and_expire() {
    let mut s = SeenModels::default();
    let names: Vec<String> = (0..MAX_SEEN + 10).map(|i| format!("m{i:05}")).collect();
    for (i, n) in names.iter().enumerate() {
        s.note([n], i as u64);
    }
    assert_eq!(s.len(), MAX_SEEN);
    assert!(!s.contains("m00000"), "the least recently served goes first");
    assert!(s.contains(&names[MAX_SEEN + 9]));
    let last = MAX_SEEN as u64 + 9;
    s.note([], last + SEEN_TTL_MS);
    assert!(s.contains(&names[MAX_SEEN + 9]) && !s.contains(&names[MAX_SEEN + 8]));
    s.note([], last + SEEN_TTL_MS + 1);
    assert!(s.is_empty());
}

#[test]
fn the_vocabulary_is_agreed_like_the_rest() {
    let v = |seed, n| reg(seed, move |m| m.vocab_size = n);
    let regs = [v(1, 49_152), v(2, 49_152), v(9, 10)];
    let c = build(&regs, &ModelPolicy::default());
    assert_eq!(c["gnus-auto"].info.vocab_size, 49_152, "a lone liar set the vocabulary");
    // A trusted model takes the vocabulary its id's agreeing workers state.
    let c = build(&regs, &trusted());
    assert_eq!(c["gnus-auto"].info.vocab_size, 49_152);
}

#[test]
fn decode_speed_is_the_median_of_the_counted_workers() {
    let rate = |seed: u8, r: f64| reg(seed, move |m| m.decode_tokens_per_s = r);
    // One liar among three moves nothing; unmeasured (0) workers are not
    // counted; an outlier of another model id is not this name's.
    let hijack = reg(8, |m| {
        m.model_id = "aaa-evil".into();
        m.decode_tokens_per_s = 1e6;
    });
    let regs = [rate(1, 80.0), rate(2, 90.0), rate(3, 1e8), honest(4), hijack];
    let c = build(&regs, &ModelPolicy::default());
    assert_eq!(c["gnus-auto"].decode_tokens_per_s, 90.0);
    assert_eq!(c["smollm2-135m-instruct"].decode_tokens_per_s, 90.0);
    // Two: their mean; trusted entries get it too.
    let c = build(&[rate(1, 80.0), rate(2, 90.0)], &trusted());
    assert_eq!(c["smollm2-135m-instruct"].decode_tokens_per_s, 85.0);
    // None measured: 0.
    let c = build(&[honest(1)], &ModelPolicy::default());
    assert_eq!(c["gnus-auto"].decode_tokens_per_s, 0.0);
}
