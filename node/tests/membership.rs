//! Tenant-signed membership on the wire (issue 14 §2, §5), over real
//! libp2p on loopback: a usage record counts at a tenant's gateway only
//! when a gateway the tenant admitted signed it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

#[path = "../../tests/support/loopback.rs"]
mod loopback;

use gcs_keyspace::keys;
use gcs_node::tenants::{Group, TenantStore, TenantTrust};
use gcs_node::{start, NodeHandle, Role};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{ids, sign, MembershipScope, NodeKey};

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn key_of(dir: &tempfile::TempDir) -> NodeKey {
    NodeKey::from_seed(gcs_node::Identity::load_or_create(dir.path()).unwrap().key.seed())
}

/// A usage record of tenant_1 for `api_key`, signed by `signer` and
/// gossiped from `from` on the tenant's usage topic; returns its job id.
async fn gossip_usage(from: &NodeHandle, signer: &NodeKey, api_key: &str) -> String {
    let (w, _) = samples::keys();
    let mut u = samples::usage(&w, signer, &Params::default());
    u.job_id = ids::new_id(ids::JOB, gcs_node::now_ms()).unwrap();
    u.tenant_id = "tenant_1".into();
    u.api_key_id = api_key.into();
    u.output_tokens_sent_to_client = 1_000_000;
    u.created_at_ms = gcs_node::now_ms();
    sign(&mut u, signer).unwrap();
    let delta = from
        .keyspace()
        .put(&keys::usage(&u.job_id), gcs_protocol::encode(&u).unwrap(), gcs_node::now_ms())
        .unwrap();
    from.network()
        .publish(&gcs_node::topics::tenant_usage("tenant_1"), delta.encode())
        .await
        .unwrap();
    u.job_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_tenant_gateways_usage_record_is_refused() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let store = TenantStore::new(dirs[0].path());
    let tenant = Group::Tenant("tenant_1".into());
    store.create(&tenant).unwrap();
    let now = gcs_node::now_ms();
    let id = |i: usize| gcs_node::Identity::load_or_create(dirs[i].path()).unwrap().node_id();
    let certs: Vec<_> =
        (0..2).map(|i| store.admit(&tenant, &id(i), true, 3_600_000, now).unwrap().0).collect();
    let trust = store.trust().unwrap();
    let gateway = |i: usize, boot: Vec<libp2p::Multiaddr>| {
        let mut c = loopback::config(Role::Gateway, &dirs[i], boot);
        c.network.served_tenants = vec!["tenant_1".into()];
        c.network.anti_entropy_interval = Duration::from_millis(300);
        c.network.tenant_trust = TenantTrust::new(trust.clone());
        c.memberships = certs.get(i).cloned().into_iter().collect();
        c
    };
    let g1 = start(gateway(0, vec![])).await.unwrap();
    let a = g1.listen_addrs().await.unwrap()[0].clone();
    let g2 = start(gateway(1, vec![a.clone()])).await.unwrap();
    // Serves the tenant and signs validly, but the tenant never admitted it.
    let fake = start(gateway(2, vec![a])).await.unwrap();
    let issuer = trust.tenants["tenant_1"].clone();
    let g2_cert = keys::membership(
        issuer.as_str(),
        MembershipScope::TenantGateway.as_str(),
        g2.node_id.as_str(),
    );
    wait_for("g2's certificate at g1", || g1.keyspace().get_bytes(&g2_cert).unwrap().is_some())
        .await;
    let fake_cert = keys::membership(
        issuer.as_str(),
        MembershipScope::TenantGateway.as_str(),
        fake.node_id.as_str(),
    );
    assert!(g1.keyspace().get_bytes(&fake_cert).unwrap().is_none());
    tokio::time::sleep(Duration::from_millis(1500)).await; // the usage topic's mesh

    // The admitted gateway's record arrives and counts.
    let honest = gossip_usage(&g2, &key_of(&dirs[1]), "key_1").await;
    let has = |n: &NodeHandle, j: &str| n.keyspace().get_bytes(&keys::usage(j)).unwrap().is_some();
    wait_for("g2's usage record at g1", || has(&g1, &honest)).await;
    assert_eq!(g1.refused_usage(), 0);
    // The fake's record for a victim key: refused, counted, never stored —
    // not by gossip, and not by the anti-entropy rounds that follow.
    let forged = gossip_usage(&fake, &key_of(&dirs[2]), "key_victim").await;
    wait_for("the forged record refused at g1", || g1.refused_usage() >= 1).await;
    // ... and shown on /metrics under its reason.
    let metrics = gcs_gateway::Backend::node_metrics(&g1.client());
    let refused = |reason: &str| -> u64 {
        let line = format!("gcs_usage_refused_total{{reason=\"{reason}\"}} ");
        let l = metrics.lines().find(|l| l.starts_with(&line)).expect("the metric line");
        l[line.len()..].trim().parse().unwrap()
    };
    assert!(refused("gateway_not_admitted") >= 1, "{metrics}");
    assert_eq!(refused("foreign_key"), 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!has(&g1, &forged) && !has(&g2, &forged), "a forged usage record was stored");
    for n in [g1, g2, fake] {
        n.shutdown().await;
    }
}
