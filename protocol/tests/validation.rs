//! One test per validation rule.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ciborium::value::Value;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::*;

const NOW: u64 = 1_783_468_800_000;

fn lim() -> Limits {
    Limits::default()
}

fn signed<T: SignedMessage>(mut m: T, key: &NodeKey) -> T {
    sign(&mut m, key).unwrap();
    m
}

#[test]
fn node_id_is_the_public_key_and_cannot_be_forged() {
    let (w, g) = samples::keys();
    let id = w.node_id();
    assert!(id.as_str().starts_with("gnusnode_") && id.as_str().len() == 9 + 64);
    assert_eq!(id.public_key(), w.public_key());
    assert!("gnusnode_xyz".parse::<NodeId>().is_err());
    assert!(
        format!("gnusnode_{}", "A".repeat(64)).parse::<NodeId>().is_err(),
        "uppercase hex is not canonical"
    );
    // The gateway cannot sign a chunk that names the worker.
    let mut c = samples::chunk(&w, &Params::default());
    assert!(sign(&mut c, &g).is_err());
    // Nor can a signature be transplanted.
    let good = signed(samples::chunk(&w, &Params::default()), &w);
    let mut forged = samples::chunk(&g, &Params::default());
    forged.signature = good.signature;
    assert_eq!(verify(&forged), Err(ProtocolError::BadSignature));
}

#[test]
fn registration_public_key_must_match_node_id() {
    let (w, g) = samples::keys();
    let mut r = samples::registration(&w, &Params::default());
    r.public_key = g.public_key();
    let r = signed(r, &w);
    let err = open(&encode(&r).unwrap(), NOW, &lim()).unwrap_err();
    assert!(matches!(err, ProtocolError::Field { field: "public_key", .. }), "{err}");
}

#[test]
fn registration_freshness_and_ttl_bounds() {
    let (w, _) = samples::keys();
    let p = Params::default();
    let r = samples::registration(&w, &p);
    assert!(r.is_fresh(NOW + 29_999, &lim()));
    assert!(!r.is_fresh(NOW + 30_000, &lim()));
    let mut offline = r.clone();
    offline.status = NodeStatus::Offline;
    assert!(!offline.is_fresh(NOW, &lim()), "an offline registration is never fresh");
    let mut long = r.clone();
    long.heartbeat.expires_at_ms = NOW + 3_600_000;
    long.heartbeat.ttl_ms = 3_600_000;
    assert!(matches!(
        long.check_fields(&lim()),
        Err(ProtocolError::Field { field: "heartbeat", .. })
    ));
    let mut inconsistent = r;
    inconsistent.heartbeat.ttl_ms = 1;
    assert!(inconsistent.check_fields(&lim()).is_err());
}

#[test]
fn expired_and_future_messages_are_refused_but_not_penalised() {
    let (w, _) = samples::keys();
    let c = signed(samples::claim(&w, &Params::default()), &w);
    let bytes = encode(&c).unwrap();
    assert!(open(&bytes, NOW + 1_100, &lim()).is_ok(), "still within expiry");
    let e = open(&bytes, NOW + 1_100 + 5_001, &lim()).unwrap_err();
    assert!(matches!(e, ProtocolError::Expired { .. }) && !e.is_penalisable());
    let e = open(&bytes, NOW - 10_000, &lim()).unwrap_err();
    assert!(matches!(e, ProtocolError::FromFuture { .. }) && !e.is_penalisable());
}

#[test]
fn oversized_messages_are_refused_before_decoding() {
    let (w, _) = samples::keys();
    let p = Params { text: "x".repeat(10_000), ..Params::default() };
    let c = signed(samples::chunk(&w, &p), &w);
    let bytes = encode(&c).unwrap();
    let small = Limits { max_message_bytes: 1024, ..lim() };
    assert!(matches!(open(&bytes, NOW + 2000, &small), Err(ProtocolError::TooLarge { .. })));
    assert!(open(&bytes, NOW + 2000, &lim()).is_ok());
    let huge = Params { text: "x".repeat(20_000), ..Params::default() };
    let c = signed(samples::chunk(&w, &huge), &w);
    assert!(matches!(
        c.check_fields(&lim()),
        Err(ProtocolError::Field { field: "delta.content", .. })
    ));
}

fn with_field(m: &impl serde::Serialize, key: &str, value: Value) -> Value {
    let mut v = codec::to_canonical_value(m).unwrap();
    codec::map_remove(&mut v, key);
    if let Value::Map(e) = &mut v {
        e.push((Value::Text(key.into()), value));
    }
    v
}

fn resign(mut v: Value, ty: MessageType, key: &NodeKey) -> Vec<u8> {
    codec::map_remove(&mut v, "signature");
    codec::canonicalize(&mut v);
    let digest = signing_digest(ty.domain_tag(), &codec::encode_value(&v));
    // Sign the digest the way `sign` does, via a throwaway message.
    let sig = sign_digest_for_test(key, &digest);
    if let Value::Map(e) = &mut v {
        e.push((Value::Text("signature".into()), Value::Bytes(sig.to_vec())));
    }
    codec::canonicalize(&mut v);
    codec::encode_value(&v)
}

fn sign_digest_for_test(key: &NodeKey, digest: &[u8; 32]) -> [u8; 64] {
    use ed25519_dalek::Signer;
    ed25519_dalek::SigningKey::from_bytes(&key.seed()).sign(digest).to_bytes()
}

#[test]
fn newer_versions_are_refused_with_a_typed_error() {
    let (w, g) = samples::keys();
    let job = samples::api_job(&g, &Params::default());
    let next = gcs_protocol::API_JOB_VERSION + 1;
    let v = with_field(&job, "version", Value::Integer(next.into()));
    let bytes = resign(v, MessageType::ApiRequestJob, &g);
    let e = open(&bytes, NOW, &lim()).unwrap_err();
    assert!(
        matches!(e, ProtocolError::UnsupportedVersion { version, .. } if version == u64::from(next)),
        "{e}"
    );
    assert!(!e.is_penalisable());
    // Versions are per message type: a claim of the job's version is newer
    // than any claim this build knows.
    let c = samples::claim(&w, &Params::default());
    let v = with_field(&c, "version", Value::Integer(gcs_protocol::API_JOB_VERSION.into()));
    let e = open(&resign(v, MessageType::JobClaim, &w), NOW, &lim()).unwrap_err();
    assert!(matches!(e, ProtocolError::UnsupportedVersion { .. }), "{e}");
}

#[test]
fn a_version_2_job_carries_no_project_or_key_and_a_version_1_job_still_opens() {
    let (_, g) = samples::keys();
    let job = samples::api_job(&g, &Params::default());
    let mut leaky = job.clone();
    leaky.tenant.api_key_id = "key_789".into();
    let e = gcs_protocol::encode(&{
        let mut j = leaky;
        gcs_protocol::sign(&mut j, &g).unwrap();
        j
    })
    .and_then(|b| open(&b, NOW, &lim()))
    .unwrap_err();
    assert!(e.to_string().contains("tenant.api_key_id"), "{e}");
    let mut v1 = job;
    v1.version = 1;
    v1.tenant.project_id = "proj_456".into();
    v1.tenant.api_key_id = "key_789".into();
    v1.signature = None;
    gcs_protocol::sign(&mut v1, &g).unwrap();
    let b = gcs_protocol::encode(&v1).unwrap();
    assert!(open(&b, NOW, &lim()).is_ok(), "a version 1 job still decodes");
}

#[test]
fn unknown_fields_are_ignored_but_covered_by_the_signature() {
    let (w, _) = samples::keys();
    let c = samples::claim(&w, &Params::default());
    let v = with_field(&c, "future_field", Value::Text("hello".into()));
    let bytes = resign(v.clone(), MessageType::JobClaim, &w);
    let opened = open(&bytes, NOW + 200, &lim()).unwrap();
    assert!(matches!(opened, Message::JobClaim(ref x) if x.claim_id == c.claim_id));
    // Dropping the unknown field after signing breaks the signature.
    let mut stripped = codec::decode_value(&bytes).unwrap();
    codec::map_remove(&mut stripped, "future_field");
    let e = open(&codec::encode_value(&stripped), NOW + 200, &lim()).unwrap_err();
    assert_eq!(e, ProtocolError::BadSignature);
}

#[test]
fn unknown_and_missing_message_types_are_typed_errors() {
    let bad = codec::encode_value(&Value::Map(vec![
        (Value::Text("message_type".into()), Value::Text("GCS_NOPE".into())),
        (Value::Text("version".into()), Value::Integer(1.into())),
    ]));
    assert!(matches!(open(&bad, NOW, &lim()), Err(ProtocolError::UnknownMessageType(_))));
    let none = codec::encode_value(&Value::Map(vec![]));
    assert!(matches!(open(&none, NOW, &lim()), Err(ProtocolError::Malformed(_))));
    assert!(matches!(open(&[0xff], NOW, &lim()), Err(ProtocolError::Malformed(_))));
    let (w, _) = samples::keys();
    let c = signed(samples::claim(&w, &Params::default()), &w);
    assert!(matches!(
        open_as::<LeaseGrant>(&encode(&c).unwrap(), NOW, &lim()),
        Err(ProtocolError::WrongMessageType { .. })
    ));
}

#[test]
fn field_bounds_are_enforced() {
    let (w, g) = samples::keys();
    let p = Params::default();
    let mut j = samples::api_job(&g, &p);
    j.job_id = "job_1".into();
    assert!(matches!(j.check_fields(&lim()), Err(ProtocolError::Field { field: "job_id", .. })));
    let mut j = samples::api_job(&g, &p);
    j.request.payload_ref.content_hash = Hash32::of(b"other");
    assert!(matches!(
        j.check_fields(&lim()),
        Err(ProtocolError::Field { field: "request.payload_ref.content_hash", .. })
    ));
    let mut j = samples::api_job(&g, &p);
    j.request.payload_ref.mode = PayloadMode::GatewayRef;
    assert!(j.check_fields(&lim()).is_err(), "a reference mode must not carry the payload");
    j.request.payload_ref.inline = None;
    assert!(j.check_fields(&lim()).is_err(), "a reference mode needs a location");
    j.request.payload_ref.location = Some(g.node_id().to_string());
    j.check_fields(&lim()).unwrap();
    let mut j = samples::api_job(&g, &p);
    j.expires_at_ms = j.created_at_ms;
    assert!(j.check_fields(&lim()).is_err());
    let mut u = samples::usage(&w, &g, &p);
    u.output_tokens_sent_to_client = u.output_tokens_generated + 1;
    assert!(u.check_fields(&lim()).is_err(), "cannot deliver more than generated");
    let mut r = samples::final_result(&w, &p);
    r.error = samples::error_result(&g, &p).error;
    assert!(r.check_fields(&lim()).is_err(), "completed with an error is inconsistent");
    let mut reg = samples::registration(&w, &p);
    reg.trust.reputation_score = f64::NAN;
    assert!(reg.check_fields(&lim()).is_err());
    let mut reg = samples::registration(&w, &p);
    reg.models[0].aliases = vec!["a".into(); 65];
    assert!(reg.check_fields(&lim()).is_err());
}

#[test]
fn chunk_signature_covers_the_26_16_11_fields() {
    let (w, _) = samples::keys();
    let p = Params::default();
    let c = signed(samples::chunk(&w, &p), &w);
    verify(&c).unwrap();
    let tamper: [fn(&mut StreamChunk); 6] = [
        |c| c.sequence += 1,
        |c| c.job_id = ids::id_from_parts(ids::JOB, 1, 1),
        |c| c.lease_id = ids::id_from_parts(ids::LEASE, 1, 1),
        |c| c.created_at_ms += 1,
        |c| c.delta.content = Some("other".into()),
        |c| c.finish_reason = Some(FinishReason::Stop),
    ];
    for t in tamper {
        let mut x = c.clone();
        t(&mut x);
        assert_eq!(verify(&x), Err(ProtocolError::BadSignature));
    }
    assert_ne!(c.delta_hash().unwrap(), Hash32::of(b""));
}

#[test]
fn domain_tags_stop_cross_type_replay() {
    let tags: std::collections::HashSet<_> =
        MessageType::ALL.iter().map(|t| t.domain_tag()).collect();
    assert_eq!(tags.len(), MessageType::ALL.len());
}

#[test]
fn job_state_machine_has_terminal_states() {
    for s in JobState::ALL {
        if s.is_terminal() {
            assert!(JobState::ALL.iter().all(|n| !s.can_transition_to(*n)), "{s} must be terminal");
        } else {
            assert!(s.can_transition_to(JobState::Failed));
            assert!(s.can_transition_to(JobState::Cancelled));
        }
    }
    assert!(JobState::Streaming.can_transition_to(JobState::Requeued));
    assert!(JobState::Requeued.can_transition_to(JobState::Claimed));
    assert!(!JobState::Created.can_transition_to(JobState::Streaming));
    assert_eq!(JobKind::ApiRequest.number(), 2);
    assert_eq!(JobKind::Retraining.number(), 9);
}

#[test]
fn queue_wrapper_roundtrips_and_checks_kind() {
    let (_, g) = samples::keys();
    let job = signed(samples::api_job(&g, &Params::default()), &g);
    let q = QueueJob::wrap(QueueJobBody::ApiRequestJob(Box::new(job.clone())));
    q.check().unwrap();
    let bytes = encode(&q).unwrap();
    let back: QueueJob = codec::from_cbor_bytes(&bytes).unwrap();
    assert_eq!(back, q);
    let QueueJobBody::ApiRequestJob(inner) = &back.body else { panic!() };
    verify(inner.as_ref()).unwrap();
    let mut wrong = q;
    wrong.kind = JobKind::Maintenance;
    assert!(wrong.check().is_err());
}

#[test]
fn ids_are_prefixed_sortable_and_checked() {
    let a = ids::new_id(ids::JOB, 1000).unwrap();
    let b = ids::new_id(ids::JOB, 2000).unwrap();
    assert!(a < b);
    ids::check_id("job_id", &a, ids::JOB).unwrap();
    assert_eq!(ids::id_time_ms(&b, ids::JOB), Some(2000));
    assert!(ids::check_id("job_id", "gcsapi_short", ids::JOB).is_err());
    assert_ne!(ids::new_id(ids::CLAIM, 5).unwrap(), ids::new_id(ids::CLAIM, 5).unwrap());
}

#[test]
fn chunk_logprobs_are_signed_and_bounded() {
    let (w, _) = samples::keys();
    let p = Params::default();
    let lp = |logprob: f32| TokenLogprob {
        token: "Hi".into(),
        logprob,
        bytes: b"Hi".to_vec(),
        top: vec![TopLogprob { token: "Hi".into(), logprob, bytes: b"Hi".to_vec() }],
    };
    let mut c = samples::chunk(&w, &p);
    c.delta.logprobs = vec![lp(-0.25)];
    let c = signed(c, &w);
    let bytes = encode(&c).unwrap();
    let back = open(&bytes, c.created_at_ms, &lim()).unwrap();
    assert_eq!(back, Message::StreamChunk(c.clone()), "logprobs survive the wire");
    // Tampering with a logprob breaks the signature (it is in the delta hash).
    let mut t = c.clone();
    t.delta.logprobs[0].logprob = -0.5;
    assert!(open(&encode(&t).unwrap(), c.created_at_ms, &lim()).is_err());
    // Positive or NaN log-probabilities, and too many tokens, are refused.
    for bad in [vec![lp(0.5)], vec![lp(f32::NAN)], vec![lp(-1.0); MAX_CHUNK_LOGPROBS + 1]] {
        let mut b = samples::chunk(&w, &p);
        b.delta.logprobs = bad;
        let b = signed(b, &w);
        assert!(open(&encode(&b).unwrap(), b.created_at_ms, &lim()).is_err());
    }
    // Without logprobs a chunk encodes exactly as before the field existed.
    let plain = signed(samples::chunk(&w, &p), &w);
    let v: Value = ciborium::from_reader(&encode(&plain).unwrap()[..]).unwrap();
    let delta = v.as_map().unwrap().iter().find(|(k, _)| k.as_text() == Some("delta")).unwrap();
    assert!(delta.1.as_map().unwrap().iter().all(|(k, _)| k.as_text() != Some("logprobs")));
}

#[test]
fn chunk_token_ids_are_signed_and_match_the_usage() {
    let (w, _) = samples::keys();
    let p = Params::default();
    let mut c = samples::chunk(&w, &p);
    c.delta.token_ids = vec![4093];
    let c = signed(c, &w);
    let back = open(&encode(&c).unwrap(), c.created_at_ms, &lim()).unwrap();
    assert_eq!(back, Message::StreamChunk(c.clone()), "token ids survive the wire");
    // Tampering with an id breaks the signature (it is in the delta hash).
    let mut t = c.clone();
    t.delta.token_ids[0] = 7;
    assert!(open(&encode(&t).unwrap(), c.created_at_ms, &lim()).is_err());
    // One id per counted token, and a bound on the count.
    for (ids, n) in [(vec![1, 2], 1), (vec![1; MAX_CHUNK_TOKENS + 1], MAX_CHUNK_TOKENS as u32 + 1)]
    {
        let mut b = samples::chunk(&w, &p);
        b.delta.token_ids = ids;
        b.usage_delta.output_tokens = n;
        let b = signed(b, &w);
        assert!(open(&encode(&b).unwrap(), b.created_at_ms, &lim()).is_err());
    }
    // Without them a chunk encodes exactly as before the field existed.
    let plain = signed(samples::chunk(&w, &p), &w);
    let v: Value = ciborium::from_reader(&encode(&plain).unwrap()[..]).unwrap();
    let delta = v.as_map().unwrap().iter().find(|(k, _)| k.as_text() == Some("delta")).unwrap();
    assert!(delta.1.as_map().unwrap().iter().all(|(k, _)| k.as_text() != Some("token_ids")));
}

#[test]
fn registration_engine_build_and_model_hash_are_optional_signed_and_checked() {
    let (w, _) = samples::keys();
    let plain = signed(samples::registration(&w, &Params::default()), &w);
    // Unset, they are absent from the bytes: an older registration (and its
    // signature, specs/vectors/messages.json) is unchanged and still opens.
    let bytes = encode(&plain).unwrap();
    let v = codec::decode_value(&bytes).unwrap();
    let models = match &v {
        Value::Map(m) => m.iter().find(|(k, _)| k.as_text() == Some("models")).unwrap().1.clone(),
        _ => panic!("a map"),
    };
    let text = format!("{models:?}");
    assert!(!text.contains("engine_build") && !text.contains("model_hash"), "{text}");
    let back: NodeRegistration = open_as(&bytes, NOW, &lim()).unwrap();
    assert_eq!((back.models[0].engine_build.as_str(), back.models[0].model_hash.as_str()), ("", ""));
    // Set, they are signed (a changed hash breaks the signature) and round-trip.
    let mut r = samples::registration(&w, &Params::default());
    r.models[0].engine_build = "gcs-engine 0.1.0".into();
    r.models[0].model_hash = "ab".repeat(32);
    let r = signed(r, &w);
    let back: NodeRegistration = open_as(&encode(&r).unwrap(), NOW, &lim()).unwrap();
    assert_eq!(back.models, r.models);
    let mut forged = r.clone();
    forged.models[0].model_hash = "cd".repeat(32);
    assert!(open_as::<NodeRegistration>(&encode(&forged).unwrap(), NOW, &lim()).is_err());
    // A hash that is not 64 hex digits, or an overlong build, is refused.
    for (build, hash, field) in [
        ("b", "ab".repeat(31), "models.model_hash"),
        ("b", "zz".repeat(32), "models.model_hash"),
        (&*"b".repeat(4096), String::new(), "models.engine_build"),
    ] {
        let mut bad = samples::registration(&w, &Params::default());
        bad.models[0].engine_build = build.into();
        bad.models[0].model_hash = hash;
        let err = open_as::<NodeRegistration>(&encode(&signed(bad, &w)).unwrap(), NOW, &lim())
            .unwrap_err();
        assert!(matches!(err, ProtocolError::Field { field: f, .. } if f == field), "{err}");
    }
}

#[test]
fn registration_model_decode_rate_is_optional_signed_and_bounded() {
    let (w, _) = samples::keys();
    // Unset (0), it is absent from the bytes: older registrations and their
    // signatures are unchanged, and they decode with 0 (not measured).
    let plain = signed(samples::registration(&w, &Params::default()), &w);
    let bytes = encode(&plain).unwrap();
    let Value::Map(top) = codec::decode_value(&bytes).unwrap() else { panic!("a map") };
    let models = &top.iter().find(|(k, _)| k.as_text() == Some("models")).unwrap().1;
    assert!(!format!("{models:?}").contains("decode_tokens_per_s"), "{models:?}");
    let back: NodeRegistration = open_as(&bytes, NOW, &lim()).unwrap();
    assert_eq!(back.models[0].decode_tokens_per_s, 0.0);
    // Two models, two figures: signed (a changed one breaks the signature)
    // and round-tripped per model.
    let mut r = samples::registration(&w, &Params::default());
    let mut second = r.models[0].clone();
    second.model_id = "gemma-3-270m".into();
    second.aliases = vec![];
    second.decode_tokens_per_s = 31.25;
    r.models[0].decode_tokens_per_s = 88.5;
    r.models.push(second);
    let r = signed(r, &w);
    let back: NodeRegistration = open_as(&encode(&r).unwrap(), NOW, &lim()).unwrap();
    let rates: Vec<f64> = back.models.iter().map(|m| m.decode_tokens_per_s).collect();
    assert_eq!(rates, [88.5, 31.25]);
    let mut forged = r.clone();
    forged.models[1].decode_tokens_per_s = 3125.0;
    assert!(open_as::<NodeRegistration>(&encode(&forged).unwrap(), NOW, &lim()).is_err());
    // Negative, infinite or absurd figures are refused by the field check.
    for bad_rate in [-1.0, f64::INFINITY, f64::NAN, 2e9] {
        let mut bad = samples::registration(&w, &Params::default());
        bad.models[0].decode_tokens_per_s = bad_rate;
        let err = open_as::<NodeRegistration>(&encode(&signed(bad, &w)).unwrap(), NOW, &lim())
            .unwrap_err();
        assert!(
            matches!(&err, ProtocolError::Field { field: f, .. } if *f == "models.decode_tokens_per_s"),
            "{bad_rate}: {err}"
        );
    }
}

#[test]
fn a_usage_record_names_its_batch_only_when_it_has_one() {
    let (w, g) = samples::keys();
    let p = Params::default();
    // Without a batch the field is not written: the signed bytes are the
    // ones a record had before the field existed, so old records verify.
    let u = signed(samples::usage(&w, &g, &p), &g);
    let bytes = encode(&u).unwrap();
    let v: Value = ciborium::de::from_reader(bytes.as_slice()).unwrap();
    let has = |v: &Value, k: &str| {
        format!("{v:?}").contains(&format!("Text(\"{k}\")"))
    };
    assert!(!has(&v, "batch_id"), "no batch_id key without a batch");
    verify(&u).unwrap();
    // With one it is signed: a changed batch id does not verify.
    let mut b = samples::usage(&w, &g, &p);
    b.batch_id = Some("batch_0123456789abcdef01234567".into());
    let mut b = signed(b, &g);
    verify(&b).unwrap();
    let back: UsageRecord = codec::from_cbor_bytes(&encode(&b).unwrap()).unwrap();
    assert_eq!(back.batch_id, b.batch_id);
    b.batch_id = Some("batch_ffffffffffffffffffffffff".into());
    assert!(verify(&b).is_err(), "the batch id is covered by the signature");
    b.batch_id = Some("b".repeat(10_000));
    assert!(b.check_fields(&lim()).is_err(), "an oversized batch id is refused");
}

#[test]
fn registration_accelerator_is_optional_and_bounded() {
    let (w, _) = samples::keys();
    let r = samples::registration(&w, &Params::default());
    // A CPU worker's registration carries no accelerator field, so its
    // bytes (and older signatures) are what they were.
    let plain = encode(&signed(r.clone(), &w)).unwrap();
    assert!(!plain.windows(11).any(|b| b == b"accelerator"));
    let mut gpu = r;
    gpu.queue.accelerator = Some(Accelerator {
        backend: "cubecl-cuda".into(),
        name: "NVIDIA H200".into(),
        memory_bytes: 150_000_000_000,
        kv_tokens: 700_000,
    });
    let bytes = encode(&signed(gpu.clone(), &w)).unwrap();
    let Message::NodeRegistration(back) = open(&bytes, NOW, &lim()).unwrap() else {
        panic!("not a registration")
    };
    assert_eq!(back.queue.accelerator, gpu.queue.accelerator);
    let mut long = gpu;
    long.queue.accelerator.as_mut().unwrap().name = "x".repeat(129);
    assert!(matches!(
        long.check_fields(&lim()),
        Err(ProtocolError::Field { field: "queue.accelerator.name", .. })
    ));
}
