//! Keyspace merges per second and prefix-scan latency at 100k keys.
//! Run: `cargo bench -p gcs-keyspace --bench keyspace`
//! (under `cargo test --benches` it runs once on 2k keys as a smoke test).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use gcs_keyspace::{Keyspace, KeyspaceOptions};

fn bench(c: &mut Criterion) {
    let full = std::env::args().any(|a| a == "--bench");
    let n: u64 = if full { 100_000 } else { 2_000 };
    let dir = tempfile::tempdir().unwrap();
    let ks = Keyspace::open(dir.path(), "bench", KeyspaceOptions::default()).unwrap();
    // 100k keys spread over 1,000 jobs' stream chunks of 100 sequences each.
    for i in 0..n {
        ks.put(
            &format!("/gcs/api/streams/gcsapi_{:05}/{:06}", i / 100, i % 100),
            vec![0u8; 200],
            1_000 + i,
        )
        .unwrap();
    }
    let src_dir = tempfile::tempdir().unwrap();
    let src = Keyspace::open(src_dir.path(), "peer", KeyspaceOptions::default()).unwrap();
    let mut deltas = Vec::new();
    for i in 0..10_000u64 {
        deltas.push(
            src.put(&format!("/gcs/api/leases/gcsapi_{i:06}"), vec![1u8; 150], 2_000_000 + i)
                .unwrap(),
        );
        deltas.push(
            src.set_add(
                &format!("/gcs/api/claims/gcsapi_{:06}", i / 4),
                &i.to_be_bytes(),
                2_000_000 + i,
            )
            .unwrap(),
        );
    }
    let mut group = c.benchmark_group("keyspace");
    group.throughput(Throughput::Elements(1));
    let mut k = 0usize;
    group.bench_function("merge_duplicate_remote_delta", |b| {
        b.iter(|| {
            k = (k + 1) % deltas.len();
            ks.merge(deltas[k].clone(), 3_000_000).unwrap()
        })
    });
    let mut fresh = 0u64;
    group.bench_function("merge_new_remote_delta", |b| {
        b.iter_batched(
            || {
                fresh += 1;
                src.put(
                    &format!("/gcs/api/states/gcsapi_{fresh:08}"),
                    vec![3u8; 150],
                    2_500_000 + fresh,
                )
                .unwrap()
            },
            |d| ks.merge(d, 3_000_000).unwrap(),
            BatchSize::SmallInput,
        )
    });
    let mut i = 0u64;
    group.bench_function("local_put", |b| {
        b.iter_batched(
            || {
                i += 1;
                (format!("/gcs/api/jobs/gcsapi_{i:08}"), 3_000_000 + i)
            },
            |(key, now)| ks.put(&key, vec![2u8; 300], now).unwrap(),
            BatchSize::SmallInput,
        )
    });
    // A usage record's write: synced (one fsync of the WAL per call).
    let mut u = 0u64;
    group.bench_function("durable_put", |b| {
        b.iter_batched(
            || {
                u += 1;
                (format!("/gcs/api/usage/gcsapi_{u:08}"), 4_000_000 + u)
            },
            |(key, now)| ks.put_durable(&key, vec![2u8; 300], now).unwrap(),
            BatchSize::SmallInput,
        )
    });
    let mut j = 0u64;
    group.bench_function(format!("prefix_scan_100_of_{n}"), |b| {
        b.iter(|| {
            j = (j + 7) % (n / 100);
            let r = ks.scan_prefix(&format!("/gcs/api/streams/gcsapi_{j:05}/")).unwrap();
            assert_eq!(r.len(), 100);
        })
    });
    group.bench_function("digest", |b| {
        b.iter(|| ks.digest(gcs_keyspace::Namespace::ApiStreams).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
