//! Property tests: round trips, signatures, bit flips, arbitrary bytes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_protocol::samples::{self, Params};
use gcs_protocol::*;
use proptest::prelude::*;

const NOW: u64 = 1_783_468_800_000;

fn limits() -> Limits {
    Limits { max_clock_skew_ms: 3_600_000, ..Limits::default() }
}

fn params() -> impl Strategy<Value = Params> {
    ("\\PC{0,64}", 0u64..1_000_000).prop_map(|(text, n)| Params { text, n, now_ms: NOW })
}

fn keys() -> impl Strategy<Value = (NodeKey, NodeKey)> {
    (any::<[u8; 32]>(), any::<[u8; 32]>())
        .prop_map(|(a, b)| (NodeKey::from_seed(a), NodeKey::from_seed(b)))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_message_roundtrips_through_cbor_and_json((w, g) in keys(), p in params()) {
        for m in samples::all_signed(&w, &g, &p) {
            let bytes = m.encode().unwrap();
            // Canonical: encoding is a function of the value.
            prop_assert_eq!(&bytes, &m.encode().unwrap());
            let back = open(&bytes, NOW, &limits()).unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(back.encode().unwrap(), bytes);
            let json = match &m {
                Message::ApiRequestJob(j) => serde_json::to_string(j).unwrap(),
                Message::StreamChunk(c) => serde_json::to_string(c).unwrap(),
                Message::NodeRegistration(r) => serde_json::to_string(r).unwrap(),
                _ => continue,
            };
            prop_assert!(json.contains("\"message_type\":\"GCS_"));
            prop_assert!(json.contains("\"signature\":\"0x"));
        }
    }

    #[test]
    fn signatures_verify_and_wrong_keys_fail((w, g) in keys(), p in params()) {
        let other = NodeKey::from_seed([99; 32]);
        for mut m in samples::all(&w, &g, &p) {
            prop_assert_eq!(m.verify(), Err(ProtocolError::MissingSignature));
            prop_assert!(m.sign(&other).is_err(), "a key may only sign for its own node id");
            let t = samples::tenant_key();
            let key = if m.signer() == &w.node_id() {
                &w
            } else if m.signer() == &t.node_id() {
                &t
            } else {
                &g
            };
            m.sign(key).unwrap();
            m.verify().unwrap();
        }
    }

    #[test]
    fn any_single_bit_flip_fails(p in params(), which in 0usize..16, bit in any::<prop::sample::Index>()) {
        let (w, g) = samples::keys();
        let m = &samples::all_signed(&w, &g, &p)[which];
        let mut bytes = m.encode().unwrap();
        let i = bit.index(bytes.len() * 8);
        bytes[i / 8] ^= 1 << (i % 8);
        prop_assert!(open(&bytes, NOW, &limits()).is_err(), "flip of bit {} in {:?} accepted", i, m.message_type());
    }

    #[test]
    fn any_changed_field_fails_verification(p in params(), which in 0usize..16, field in 0usize..64) {
        let (w, g) = samples::keys();
        let m = &samples::all_signed(&w, &g, &p)[which];
        // Change one top-level field of the value tree (keeping it well-typed
        // where possible) and re-encode: the signature must no longer verify.
        let mut v = codec::decode_value(&m.encode().unwrap()).unwrap();
        let name = {
            let ciborium::value::Value::Map(entries) = &mut v else { unreachable!() };
            let candidates: Vec<usize> = (0..entries.len())
                .filter(|i| !matches!(&entries[*i].0, ciborium::value::Value::Text(t) if t == "signature" || t == "message_type" || t == "version"))
                .collect();
            let idx = candidates[field % candidates.len()];
            mutate(&mut entries[idx].1);
            format!("{:?}", entries[idx].0)
        };
        let bytes = codec::encode_value(&v);
        let r = open(&bytes, NOW, &limits());
        prop_assert!(r.is_err(), "changed field {} of {:?} accepted", name, m.message_type());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = open(&bytes, NOW, &limits());
        let _ = decode(&bytes, &limits());
    }

    #[test]
    fn truncations_never_panic_and_never_verify(p in params(), which in 0usize..16, cut in any::<prop::sample::Index>()) {
        let (w, g) = samples::keys();
        let bytes = samples::all_signed(&w, &g, &p)[which].encode().unwrap();
        let n = cut.index(bytes.len());
        prop_assert!(open(&bytes[..n], NOW, &limits()).is_err());
    }
}

fn mutate(v: &mut ciborium::value::Value) {
    use ciborium::value::Value;
    match v {
        Value::Integer(i) => {
            let n: i128 = (*i).into();
            *i = ciborium::value::Integer::try_from(if n > 0 { n - 1 } else { n + 1 }).unwrap();
        }
        Value::Text(t) => t.push('x'),
        Value::Bytes(b) => match b.first_mut() {
            Some(x) => *x ^= 1,
            None => b.push(0),
        },
        Value::Bool(b) => *b = !*b,
        Value::Float(f) => *f += 1.0,
        Value::Null => *v = Value::Bool(true),
        Value::Array(a) => match a.first_mut() {
            Some(x) => mutate(x),
            None => a.push(Value::Null),
        },
        Value::Map(m) => match m.first_mut() {
            Some((_, x)) => mutate(x),
            None => m.push((Value::Text("x".into()), Value::Null)),
        },
        Value::Tag(_, inner) => mutate(inner),
        _ => *v = Value::Null,
    }
}
