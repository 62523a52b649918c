//! sign+encode and decode+verify throughput per message type.
//! Run: `cargo bench -p gcs-protocol --bench envelopes`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{encode, open, Limits};

/// Unique labels: the final result appears twice (completed and error).
fn label(m: &gcs_protocol::Message) -> String {
    match m {
        gcs_protocol::Message::FinalResult(r) if r.error.is_some() => {
            format!("{}(error)", m.message_type())
        }
        _ => m.message_type().to_string(),
    }
}

fn bench(c: &mut Criterion) {
    let (w, g) = samples::keys();
    let tenant = samples::tenant_key();
    let p = Params::default();
    let limits = Limits { max_clock_skew_ms: u64::MAX / 4, ..Limits::default() };
    let unsigned = samples::all(&w, &g, &p);
    let signed = samples::all_signed(&w, &g, &p);
    let mut group = c.benchmark_group("sign_encode");
    group.throughput(Throughput::Elements(1));
    for m in &unsigned {
        // Membership statements are signed by the tenant's own key.
        let key = if m.signer() == &w.node_id() {
            &w
        } else if m.signer() == &tenant.node_id() {
            &tenant
        } else {
            &g
        };
        group.bench_with_input(BenchmarkId::from_parameter(label(m)), m, |b, m| {
            b.iter(|| {
                let mut m = m.clone();
                m.sign(key).unwrap();
                m.encode().unwrap()
            })
        });
    }
    group.finish();
    let mut group = c.benchmark_group("decode_verify");
    group.throughput(Throughput::Elements(1));
    for m in &signed {
        let bytes = m.encode().unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(label(m)), &bytes, |b, bytes| {
            b.iter(|| open(bytes, p.now_ms, &limits).unwrap())
        });
    }
    group.finish();
    let _ = encode::<u8>;
}

criterion_group!(benches, bench);
criterion_main!(benches);
