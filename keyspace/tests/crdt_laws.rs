//! CRDT laws and convergence, property-tested. Seeds are printed by
//! proptest on failure (and persisted under proptest-regressions/).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_keyspace::*;
use proptest::prelude::*;

const ACTORS: [&str; 3] = ["a", "b", "c"];
const KEYS: [&str; 4] = [
    "/gcs/api/claims/j1",
    "/gcs/api/claims/j2",
    "/gcs/api/leases/j1",
    "/gcs/nodes/registrations/n1",
];

/// One local operation by one replica.
#[derive(Clone, Debug)]
enum Op {
    Put { key: usize, val: u8 },
    Delete { key: usize },
    Add { key: usize, elem: u8 },
    Remove { key: usize, elem: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (2usize..4, any::<u8>()).prop_map(|(key, val)| Op::Put { key, val }),
        (2usize..4).prop_map(|key| Op::Delete { key }),
        (0usize..2, 0u8..6).prop_map(|(key, elem)| Op::Add { key, elem }),
        (0usize..2, 0u8..6).prop_map(|(key, elem)| Op::Remove { key, elem }),
    ]
}

fn value() -> impl Strategy<Value = CrdtValue> {
    // Build set states by running random ops on a fresh set as random actors.
    prop::collection::vec((0usize..3, any::<bool>(), 0u8..5, 0u64..50), 0..12).prop_map(|ops| {
        let mut s = AwSet::default();
        for (a, add, e, t) in ops {
            let hlc = Hlc { wall_ms: t, logical: 0 };
            if add {
                s.add(ACTORS[a], vec![e], hlc)
            } else {
                s.remove(&[e], hlc)
            }
        }
        CrdtValue::Set(s)
    })
}

fn reg() -> impl Strategy<Value = CrdtValue> {
    (0usize..3, prop::option::of(0u8..4), 0u64..5, 0u32..3).prop_map(|(a, v, w, l)| {
        CrdtValue::Register(Register::new(
            v.map(|v| vec![v]),
            Hlc { wall_ms: w, logical: l },
            ACTORS[a],
        ))
    })
}

fn join(mut a: CrdtValue, b: CrdtValue) -> CrdtValue {
    a.join(b).unwrap();
    a
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn set_join_is_commutative_associative_idempotent(a in value(), b in value(), c in value()) {
        prop_assert_eq!(join(a.clone(), b.clone()), join(b.clone(), a.clone()));
        prop_assert_eq!(join(join(a.clone(), b.clone()), c.clone()), join(a.clone(), join(b.clone(), c.clone())));
        prop_assert_eq!(join(a.clone(), a.clone()), a);
    }

    #[test]
    fn register_join_is_commutative_associative_idempotent(a in reg(), b in reg(), c in reg()) {
        prop_assert_eq!(join(a.clone(), b.clone()), join(b.clone(), a.clone()));
        prop_assert_eq!(join(join(a.clone(), b.clone()), c.clone()), join(a.clone(), join(b.clone(), c.clone())));
        prop_assert_eq!(join(a.clone(), a.clone()), a);
    }
}

#[test]
fn concurrent_add_wins_over_remove() {
    let mut base = AwSet::default();
    base.add("a", b"x".to_vec(), Hlc::default());
    let mut r1 = base.clone();
    let mut r2 = base.clone();
    r1.remove(b"x", Hlc::default());
    r2.add("b", b"x".to_vec(), Hlc::default());
    let merged = join(CrdtValue::Set(r1), CrdtValue::Set(r2));
    assert!(merged.as_set().unwrap().contains(b"x"));
    // But a remove that observed the add does remove it.
    let mut seen = base.clone();
    seen.remove(b"x", Hlc::default());
    assert!(!join(CrdtValue::Set(base), CrdtValue::Set(seen)).as_set().unwrap().contains(b"x"));
}

/// Three RocksDB replicas run random local operations; every resulting delta
/// is delivered to every other replica in a random order, with duplicates.
/// All replicas must end in identical states, bytes and digests.
fn converge(ops: Vec<(usize, Op)>, order_seed: u64, dups: usize) {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let reps: Vec<Keyspace> = dirs
        .iter()
        .zip(ACTORS)
        .map(|(d, a)| Keyspace::open(d.path(), a, KeyspaceOptions::default()).unwrap())
        .collect();
    let mut outbox: Vec<(usize, Delta)> = Vec::new();
    for (i, (r, op)) in ops.into_iter().enumerate() {
        let now = 1_000 + i as u64;
        let ks = &reps[r];
        let d = match op {
            Op::Put { key, val } => ks.put(KEYS[key], vec![val], now),
            Op::Delete { key } => ks.delete(KEYS[key], now),
            Op::Add { key, elem } => ks.set_add(KEYS[key], &[elem], now),
            Op::Remove { key, elem } => ks.set_remove(KEYS[key], &[elem], now),
        }
        .unwrap();
        outbox.push((r, d));
    }
    // Deliver in a seeded shuffled order with duplicates.
    let mut deliveries: Vec<(usize, usize)> = Vec::new();
    for (i, (from, _)) in outbox.iter().enumerate() {
        for to in 0..3 {
            if to != *from {
                deliveries.push((to, i));
            }
        }
    }
    for k in 0..dups.min(deliveries.len()) {
        deliveries.push(deliveries[k * 7 % deliveries.len()]);
    }
    let mut rng = order_seed;
    for i in (1..deliveries.len()).rev() {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        deliveries.swap(i, (rng >> 33) as usize % (i + 1));
    }
    for (to, i) in deliveries {
        reps[to].merge(outbox[i].1.clone(), 10_000).unwrap();
    }
    for ns in [Namespace::ApiClaims, Namespace::ApiLeases, Namespace::NodeRegistrations] {
        let states: Vec<_> = reps.iter().map(|r| r.scan_prefix(ns.prefix()).unwrap()).collect();
        assert_eq!(
            states[0], states[1],
            "replicas a and b differ in {ns:?} (order seed {order_seed})"
        );
        assert_eq!(
            states[1], states[2],
            "replicas b and c differ in {ns:?} (order seed {order_seed})"
        );
        let digests: Vec<_> = reps.iter().map(|r| r.digest(ns).unwrap()).collect();
        assert_eq!(digests[0], digests[1]);
        assert_eq!(digests[1], digests[2]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn three_replicas_converge_under_any_delivery_order(
        ops in prop::collection::vec((0usize..3, op()), 1..40),
        order_seed in any::<u64>(),
        dups in 0usize..20,
    ) {
        converge(ops, order_seed, dups);
    }
}
