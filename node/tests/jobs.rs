//! Jobs end to end over real libp2p on loopback: a gateway, workers running a
//! scripted executor (a stand-in for the engine, only inside these tests).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_node::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
use gcs_node::jobs::{JobEvent, JobSpec};
#[path = "../../tests/support/loopback.rs"]
mod loopback;
use loopback::addr;

use gcs_keyspace::keys;
use gcs_node::tenants::{Group, TenantStore, TenantTrust};
use gcs_node::{start, NodeConfig, NodeHandle, Role};
use gcs_protocol::{ApiType, CancellationReason, FinishReason, JobLimits, UsageRecord};

/// Emits `words` numbered words, `first_ms` before the first and `step_ms`
/// between the rest, checking the cancel flag every step.
#[derive(Debug)]
struct Scripted {
    words: u64,
    first_ms: u64,
    step_ms: u64,
    emitted: AtomicU64,
}

impl Scripted {
    fn new(words: u64, first_ms: u64, step_ms: u64) -> Arc<Self> {
        Arc::new(Self { words, first_ms, step_ms, emitted: AtomicU64::new(0) })
    }
}

impl Executor for Scripted {
    fn run(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<gcs_protocol::TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError> {
        let prompt: serde_json::Value =
            serde_json::from_slice(&req.body).map_err(|e| ExecError::Invalid(e.to_string()))?;
        std::thread::sleep(Duration::from_millis(self.first_ms));
        let mut n = 0;
        while n < self.words {
            if cancel.load(Ordering::SeqCst) {
                break;
            }
            if !emit(&format!("w{n} "), 1, vec![]) {
                break;
            }
            self.emitted.fetch_add(1, Ordering::SeqCst);
            n += 1;
            std::thread::sleep(Duration::from_millis(self.step_ms));
        }
        Ok(ExecOutcome {
            finish_reason: FinishReason::Length,
            input_tokens: prompt.to_string().len() as u64,
            output_tokens: n,
            cached_tokens: 0,
            body: serde_json::json!({"object": "chat.completion", "n": n}),
        })
    }
}

fn config(
    role: Role,
    dir: &tempfile::TempDir,
    boot: Vec<libp2p::Multiaddr>,
    exec: Option<Arc<Scripted>>,
) -> NodeConfig {
    let mut c = loopback::config(role, dir, boot);
    c.executor = exec.map(|e| e as Arc<dyn Executor>);
    c
}

fn spec() -> JobSpec {
    JobSpec {
        api_type: ApiType::ChatCompletion,
        model: "gnus-test".into(),
        stream: true,
        body: br#"{"messages":[{"role":"user","content":"hello"}]}"#.to_vec(),
        tenant_id: "tenant_1".into(),
        project_id: "proj_1".into(),
        api_key_id: "key_1".into(),
        idempotency_key: "idem_1".into(),
        limits: JobLimits { claim_timeout_ms: 3_000, ..JobLimits::default() },
        max_output_tokens: 64,
        routing: gcs_protocol::Routing::public(),
        batch_id: None,
        parent: None,
        price_percent: None,
    }
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

struct Net {
    _dirs: Vec<tempfile::TempDir>,
    gw: NodeHandle,
    workers: Vec<Option<NodeHandle>>,
}

async fn network(execs: Vec<Arc<Scripted>>) -> Net {
    let dirs: Vec<_> = (0..=execs.len()).map(|_| tempfile::tempdir().unwrap()).collect();
    let gw = start(config(Role::Gateway, &dirs[0], vec![], None)).await.unwrap();
    let a = addr(&gw).await;
    let mut workers = vec![];
    for (i, e) in execs.into_iter().enumerate() {
        workers.push(Some(
            start(config(Role::Worker, &dirs[i + 1], vec![a.clone()], Some(e))).await.unwrap(),
        ));
    }
    let ids: Vec<_> = workers.iter().map(|w| w.as_ref().unwrap().node_id.clone()).collect();
    wait_for("worker registrations at the gateway", || {
        let regs = gw.fresh_registrations();
        ids.iter().all(|id| regs.iter().any(|r| &r.node_id == id))
    })
    .await;
    Net { _dirs: dirs, gw, workers }
}

async fn next(rx: &mut tokio::sync::mpsc::Receiver<JobEvent>) -> JobEvent {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("event in time")
        .expect("stream open")
}

fn usage(gw: &NodeHandle, job: &str) -> UsageRecord {
    gw.keyspace().get_cbor(&keys::usage(job)).unwrap().expect("usage record")
}

fn lease_holder(gw: &NodeHandle, job: &str) -> Option<gcs_protocol::NodeId> {
    let l: gcs_protocol::LeaseGrant = gw.keyspace().get_cbor(&keys::lease(job)).unwrap()?;
    Some(l.node_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_race_exactly_one_wins_and_the_stream_is_fenced_in_order() {
    // 12 words 40 ms apart: the job stays live long enough for the losing
    // claim to reach the gateway's record (claims for finished jobs are not kept).
    let execs = vec![Scripted::new(12, 0, 40), Scripted::new(12, 0, 40)];
    let net = network(execs.clone()).await;
    let (job, mut rx) = net.gw.submit(spec()).await.unwrap();
    let mut seqs = vec![];
    let mut nodes = std::collections::HashSet::new();
    loop {
        match next(&mut rx).await {
            JobEvent::Chunk(c) => {
                seqs.push(c.sequence);
                nodes.insert(c.node_id.clone());
            }
            JobEvent::Leased { .. } => {}
            JobEvent::Completed(r) => {
                assert_eq!(r.status, gcs_protocol::ResultStatus::Completed);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seqs, (0..13).collect::<Vec<u64>>(), "12 words + the finish chunk, gap-free");
    assert_eq!(nodes.len(), 1, "one worker executed");
    let ran: u64 = execs.iter().map(|e| e.emitted.load(Ordering::SeqCst)).sum();
    assert_eq!(ran, 12, "the loser never ran the engine");
    let u = usage(&net.gw, &job);
    assert_eq!((u.output_tokens_generated, u.output_tokens_sent_to_client), (12, 12));
    let recorded = net.gw.keyspace().scan_prefix(&keys::stream(&job)).unwrap();
    assert_eq!(recorded.len(), 13, "every forwarded chunk is recorded in the keyspace");
    assert_eq!(u.node_id.as_ref(), nodes.iter().next());
    // Both signed claims are on record, the winner's among them.
    let claims = net.gw.keyspace().get(&keys::claims(&job)).unwrap().unwrap();
    let claims: Vec<gcs_protocol::JobClaim> = claims
        .as_set()
        .unwrap()
        .elements()
        .map(|b| gcs_protocol::codec::from_cbor_bytes(b).unwrap())
        .collect();
    let claimants: std::collections::HashSet<_> = claims.iter().map(|c| &c.node_id).collect();
    assert_eq!((claims.len(), claimants.len()), (2, 2), "one claim from each worker: {claims:?}");
    assert!(claims.iter().any(|c| Some(&c.node_id) == u.node_id.as_ref()));
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
    net.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cancel_stops_the_worker_within_a_second() {
    let exec = Scripted::new(500, 0, 20);
    let net = network(vec![exec.clone()]).await;
    let (job, mut rx) = net.gw.submit(spec()).await.unwrap();
    let mut chunks = 0;
    while chunks < 3 {
        match next(&mut rx).await {
            JobEvent::Chunk(_) => chunks += 1,
            JobEvent::Leased { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    net.gw.cancel(&job, CancellationReason::ClientDisconnected).await.unwrap();
    let t = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let at_1s = exec.emitted.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        exec.emitted.load(Ordering::SeqCst),
        at_1s,
        "the worker kept generating after {:?}",
        t.elapsed()
    );
    assert!(at_1s < 100);
    let u = usage(&net.gw, &job);
    assert_eq!(u.cancellation_reason, Some(CancellationReason::ClientDisconnected));
    assert!(u.output_tokens_sent_to_client >= 3);
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
    net.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_winner_killed_before_its_first_token_is_replaced_and_the_job_completes() {
    let execs = vec![Scripted::new(5, 2_000, 5), Scripted::new(5, 2_000, 5)];
    let mut net = network(execs).await;
    let (job, mut rx) = net.gw.submit(spec()).await.unwrap();
    wait_for("a lease", || lease_holder(&net.gw, &job).is_some()).await;
    let winner = lease_holder(&net.gw, &job).unwrap();
    let i = net.workers.iter().position(|w| w.as_ref().unwrap().node_id == winner).unwrap();
    net.workers[i].take().unwrap().shutdown().await;
    let mut nodes = std::collections::HashSet::new();
    loop {
        match next(&mut rx).await {
            JobEvent::Chunk(c) => {
                nodes.insert(c.node_id.clone());
            }
            JobEvent::Leased { .. } => {}
            JobEvent::Completed(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(!nodes.contains(&winner) && nodes.len() == 1, "completed on the other worker only");
    assert_eq!(usage(&net.gw, &job).requeue_count, 1);
    // The worker that lost the job sits out of the gateway's next one.
    let mut again = spec();
    again.idempotency_key = "idem_after_loss".into();
    let (job2, mut rx2) = net.gw.submit(again).await.unwrap();
    let b = net.gw.keyspace().get_bytes(&keys::job(&job2)).unwrap().unwrap();
    let announced: gcs_protocol::ApiRequestJob = gcs_protocol::codec::from_cbor_bytes(&b).unwrap();
    assert!(announced.routing.excluded_nodes.contains(&winner), "{:?}", announced.routing);
    while !matches!(next(&mut rx2).await, JobEvent::Completed(_)) {}
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
    net.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_winner_killed_after_its_first_token_ends_the_stream_with_an_error() {
    let execs = vec![Scripted::new(400, 0, 20), Scripted::new(400, 0, 20)];
    let mut net = network(execs).await;
    let (job, mut rx) = net.gw.submit(spec()).await.unwrap();
    let mut got = 0u64;
    let mut winner = None;
    while got < 3 {
        if let JobEvent::Chunk(c) = next(&mut rx).await {
            got += 1;
            winner = Some(c.node_id.clone());
        }
    }
    let winner = winner.unwrap();
    let i = net.workers.iter().position(|w| w.as_ref().unwrap().node_id == winner).unwrap();
    net.workers[i].take().unwrap().shutdown().await;
    loop {
        match next(&mut rx).await {
            JobEvent::Chunk(_) => got += 1,
            JobEvent::Leased { .. } => {}
            JobEvent::Failed { after_partial_output, .. } => {
                assert!(after_partial_output);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let u = usage(&net.gw, &job);
    assert_eq!(
        u.output_tokens_sent_to_client, got,
        "the usage record counts what the client received"
    );
    assert!(u.failed_after_partial_output);
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
    net.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_role_all_node_serves_its_own_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let exec = Scripted::new(4, 0, 1);
    let node = start(config(Role::All, &dir, vec![], Some(exec))).await.unwrap();
    wait_for("its own registration", || {
        node.fresh_registrations().iter().any(|r| r.node_id == node.node_id)
    })
    .await;
    let (job, mut rx) = node.submit(spec()).await.unwrap();
    let mut chunks = 0;
    loop {
        match next(&mut rx).await {
            JobEvent::Chunk(_) => chunks += 1,
            JobEvent::Leased { node_id } => assert_eq!(node_id, node.node_id),
            JobEvent::Completed(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(chunks, 5);
    assert_eq!(usage(&node, &job).output_tokens_sent_to_client, 4);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restart_leaves_no_job_hanging() {
    let exec = Scripted::new(10_000, 0, 20);
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut gc = config(Role::Gateway, &dirs[0], vec![], None);
    gc.network.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    let gw = start(gc.clone()).await.unwrap();
    let a = addr(&gw).await;
    let worker =
        start(config(Role::Worker, &dirs[1], vec![a.clone()], Some(exec.clone()))).await.unwrap();
    wait_for("registration", || {
        gw.fresh_registrations().iter().any(|r| r.node_id == worker.node_id)
    })
    .await;
    let (job, mut rx) = gw.submit(spec()).await.unwrap();
    let mut chunks = 0;
    while chunks < 3 {
        if let JobEvent::Chunk(_) = next(&mut rx).await {
            chunks += 1;
        }
    }
    gw.shutdown().await;
    // Same data directory and port, so the worker can reconnect.
    gc.network.listen =
        vec![a.iter().filter(|p| !matches!(p, libp2p::multiaddr::Protocol::P2p(_))).collect()];
    let gw = start(gc).await.unwrap();
    wait_for("the job to be ended", || {
        gw.keyspace().get_bytes(&keys::usage(&job)).unwrap().is_some()
    })
    .await;
    let res: gcs_protocol::FinalResult = gcs_protocol::codec::from_cbor_bytes(
        &gw.keyspace().get_bytes(&keys::result(&job)).unwrap().unwrap(),
    )
    .unwrap();
    assert_eq!(res.error.unwrap().code, "gnus_gateway_restarted");
    // The recovered job bills what its client had received before the restart.
    let u = usage(&gw, &job);
    assert!(u.output_tokens_sent_to_client >= 3, "{u:?}");
    // Billed from the gateway's local record: the announcement, a global
    // record, names neither project nor key (26.20.4).
    assert_eq!((u.project_id.as_str(), u.api_key_id.as_str()), ("proj_1", "key_1"), "{u:?}");
    let announced: gcs_protocol::ApiRequestJob = gcs_protocol::codec::from_cbor_bytes(
        &gw.keyspace().get_bytes(&keys::job(&job)).unwrap().unwrap(),
    )
    .unwrap();
    assert!(announced.tenant.api_key_id.is_empty() && announced.tenant.project_id.is_empty());
    assert_ne!(announced.idempotency_key, "idem_1", "the client's key stays at the gateway");
    assert!(u.output_tokens_generated >= u.output_tokens_sent_to_client, "{u:?}");
    // The worker was told to stop (or stopped when its gateway vanished).
    let t = Instant::now();
    loop {
        let before = exec.emitted.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if exec.emitted.load(Ordering::SeqCst) == before {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the worker kept generating");
    }
    worker.shutdown().await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_returns_the_same_job_and_refuses_another_body() {
    let exec = Scripted::new(3, 0, 1);
    let net = network(vec![exec.clone()]).await;
    let (job, mut rx) = net.gw.submit(spec()).await.unwrap();
    // A repeat while the job runs hears its end.
    let (again, mut rx2) = net.gw.submit(spec()).await.unwrap();
    assert_eq!(again, job);
    loop {
        if let JobEvent::Completed(_) = next(&mut rx).await {
            break;
        }
    }
    assert!(matches!(next(&mut rx2).await, JobEvent::Completed(_)));
    // A repeat after it finished gets the stored result, without running again.
    let (third, mut rx3) = net.gw.submit(spec()).await.unwrap();
    assert_eq!(third, job);
    assert!(matches!(next(&mut rx3).await, JobEvent::Completed(_)));
    assert_eq!(exec.emitted.load(Ordering::SeqCst), 3, "the engine ran once");
    let mut other = spec();
    other.body = br#"{"messages":[{"role":"user","content":"something else"}]}"#.to_vec();
    match net.gw.submit(other).await {
        Err(gcs_node::NodeError::IdempotencyConflict { job_id }) => assert_eq!(job_id, job),
        other => panic!("expected a conflict, got {:?}", other.map(|x| x.0)),
    }
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
    net.gw.shutdown().await;
}

fn routed(network: gcs_protocol::RoutingMode, swarm: &str, idem: &str) -> JobSpec {
    let mut s = spec();
    s.routing.network = network;
    s.routing.swarm_id = swarm.into();
    s.idempotency_key = idem.into();
    s
}

/// Runs a job to its end and returns its id and who held its lease.
async fn served_by(gw: &NodeHandle, s: JobSpec) -> (String, gcs_protocol::NodeId) {
    let (job, mut rx) = gw.submit(s).await.unwrap();
    loop {
        match next(&mut rx).await {
            JobEvent::Completed(_) => break,
            JobEvent::Failed { error, .. } => panic!("job {job} failed: {error:?}"),
            _ => {}
        }
    }
    let holder = lease_holder(gw, &job).expect("a lease");
    (job, holder)
}

/// `node_dir`'s node admitted to `group` (as a tenant gateway with
/// `gateway`) by the tenant store of `gw_dir`, whose key is made if needed.
fn admit(
    gw_dir: &tempfile::TempDir,
    group: &Group,
    node_dir: &tempfile::TempDir,
    gateway: bool,
) -> gcs_protocol::MembershipCertificate {
    let store = TenantStore::new(gw_dir.path());
    let _ = store.create(group);
    let id = gcs_node::Identity::load_or_create(node_dir.path()).unwrap().node_id();
    store.admit(group, &id, gateway, 3_600_000, gcs_node::now_ms()).unwrap().0
}

/// What a gateway with the tenant store of `gw_dir` trusts.
fn trust_of(gw_dir: &tempfile::TempDir) -> gcs_node::tenants::TrustHandle {
    TenantTrust::new(TenantStore::new(gw_dir.path()).trust().unwrap())
}

/// Private, hybrid and local-only jobs are announced only on their own
/// topics (26.9.2): a public worker never hears them, and the tenant's
/// admitted node or the swarm's admitted node wins them. A node that only
/// says it is the tenant's (`--private-tenant`) or the swarm's (`--swarm`)
/// hears the jobs and claims them, and never gets a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_and_local_jobs_travel_only_on_their_topics() {
    use gcs_protocol::RoutingMode as R;
    let dirs: Vec<_> = (0..6).map(|_| tempfile::tempdir().unwrap()).collect();
    let (tenant, lab_swarm) = (Group::Tenant("tenant_1".into()), Group::Swarm("lab".into()));
    let private_cert = admit(&dirs[0], &tenant, &dirs[2], false);
    let lab_cert = admit(&dirs[0], &lab_swarm, &dirs[3], false);
    let mut gc = config(Role::Gateway, &dirs[0], vec![], None);
    gc.network.anti_entropy_interval = Duration::from_millis(300);
    gc.network.tenant_trust = trust_of(&dirs[0]);
    let gw = start(gc).await.unwrap();
    let a = addr(&gw).await;
    let worker = |i: usize, tenant: Option<&str>, swarm: &str| {
        let mut c = config(Role::Worker, &dirs[i], vec![a.clone()], Some(Scripted::new(3, 0, 5)));
        c.private_tenant = tenant.map(String::from);
        c.private_only = tenant.is_some();
        c.swarm_id = swarm.into();
        c.network.anti_entropy_interval = Duration::from_millis(300);
        c
    };
    let public = start(worker(1, None, "public")).await.unwrap();
    let mut pc = worker(2, Some("tenant_1"), "public");
    pc.memberships = vec![private_cert];
    let private = start(pc).await.unwrap();
    let mut lc = worker(3, None, "lab");
    lc.memberships = vec![lab_cert];
    let lab = start(lc).await.unwrap();
    // Self-declared members: no certificate.
    let fake_private = start(worker(4, Some("tenant_1"), "public")).await.unwrap();
    let fake_lab = start(worker(5, None, "lab")).await.unwrap();
    let ids = [&public.node_id, &private.node_id, &lab.node_id, &fake_private.node_id, &fake_lab.node_id];
    wait_for("five registrations", || {
        let regs = gw.fresh_registrations();
        ids.iter().all(|id| regs.iter().any(|r| &&r.node_id == id))
    })
    .await;
    // Let the private and local topic meshes form.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let mut confined = vec![];
    for (mode, swarm, idem, want) in [
        (R::Private, "public", "p1", &private.node_id),
        (R::Hybrid, "public", "h1", &private.node_id),
        (R::LocalOnly, "lab", "l1", &lab.node_id),
        (R::Private, "public", "p2", &private.node_id),
        (R::LocalOnly, "lab", "l2", &lab.node_id),
    ] {
        let (job, holder) = served_by(&gw, routed(mode, swarm, idem)).await;
        assert_eq!(&holder, want, "{mode:?} job won by the wrong node");
        confined.push(job);
    }
    assert_eq!(public.jobs_heard(), 0, "the public worker heard a private or local job");
    assert_eq!(lab.jobs_heard(), 2, "the lab worker hears only its swarm's jobs");
    assert!(private.jobs_heard() >= 3, "the private worker hears its tenant's jobs");
    assert!(
        fake_private.jobs_heard() >= 3 && fake_lab.jobs_heard() >= 2,
        "the self-declared members heard the jobs (they were in the race)"
    );
    // A public job: the private-only node takes none of it.
    let (public_job, holder) = served_by(&gw, routed(R::Public, "public", "pub1")).await;
    assert!(holder != private.node_id && holder != fake_private.node_id, "public job won by {holder}");
    wait_for("the public announcement at the public worker", || public.jobs_heard() == 1).await;
    // Nor does anti-entropy hand the confined jobs' records to anyone: the
    // public job's record arrives, theirs never do.
    let record = |n: &NodeHandle, j: &str| n.keyspace().get_bytes(&keys::job(j)).unwrap().is_some();
    wait_for("the public job's record at the public worker", || record(&public, &public_job)).await;
    for j in &confined {
        assert!(!record(&public, j) && !record(&lab, j), "confined job {j} replicated");
    }
    // A revocation stored at the gateway stops the private node at once.
    let store = TenantStore::new(dirs[0].path());
    let r = store.revoke(&tenant, &private.node_id, false, gcs_node::now_ms()).unwrap();
    let m = gcs_protocol::Message::MembershipRevocation(r);
    gcs_node::tenants::publish_statement(gw.keyspace(), gw.network(), &m).await.unwrap();
    let (job, _rx) = gw.submit(routed(R::Private, "public", "p3")).await.unwrap();
    // Claims arrive within a few hundred ms (the jobs above were leased
    // that fast); none may win.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(lease_holder(&gw, &job), None, "a lease after the revocation");
    gw.cancel(&job, CancellationReason::ClientDisconnected).await.unwrap();
    for n in [gw, public, private, lab, fake_private, fake_lab] {
        n.shutdown().await;
    }
}

/// `gateway_local` jobs (26.11.3) go only to the workers their gateway
/// attached: they travel on the gateway's own topic, and a worker that
/// joins it by saying so (`--gateway-local`, no certificate) hears them,
/// claims, and never gets a lease. A tenant that pins nodes (`tenants admit
/// --pin`) gets private jobs naming exactly its pinned nodes in
/// `allowed_nodes`: an admitted but unpinned member never wins one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_local_and_pinned_jobs_reach_only_their_nodes() {
    use gcs_protocol::RoutingMode as R;
    let dirs: Vec<_> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    let store = TenantStore::new(dirs[0].path());
    let me = store.gateway().unwrap();
    let attach = admit(&dirs[0], &me, &dirs[1], false);
    let tenant = Group::Tenant("tenant_1".into());
    let pinned = admit(&dirs[0], &tenant, &dirs[3], false);
    let unpinned = admit(&dirs[0], &tenant, &dirs[4], false);
    store.pin(&tenant, &pinned.node_id, true).unwrap();
    let mut gc = config(Role::Gateway, &dirs[0], vec![], None);
    let trust = trust_of(&dirs[0]);
    gc.network.tenant_trust = trust.clone();
    let gw = start(gc).await.unwrap();
    let a = addr(&gw).await;
    let worker = |i: usize| {
        let mut c = config(Role::Worker, &dirs[i], vec![a.clone()], Some(Scripted::new(3, 0, 5)));
        c.gateway_local = [gw.node_id.clone()].into_iter().collect();
        c
    };
    let mut ac = worker(1);
    ac.memberships = vec![attach];
    let attached = start(ac).await.unwrap();
    // Says it is attached, with no certificate.
    let fake = start(worker(2)).await.unwrap();
    let private = |i: usize, cert| {
        let mut c = config(Role::Worker, &dirs[i], vec![a.clone()], Some(Scripted::new(3, 0, 5)));
        c.private_tenant = Some("tenant_1".into());
        c.private_only = true;
        c.memberships = vec![cert];
        c
    };
    let pinned = start(private(3, pinned)).await.unwrap();
    let unpinned = start(private(4, unpinned)).await.unwrap();
    let ids = [&attached.node_id, &fake.node_id, &pinned.node_id, &unpinned.node_id];
    wait_for("four registrations", || {
        let regs = gw.fresh_registrations();
        ids.iter().all(|id| regs.iter().any(|r| &&r.node_id == id))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for idem in ["gl1", "gl2", "gl3"] {
        let (_, holder) = served_by(&gw, routed(R::GatewayLocal, "public", idem)).await;
        assert_eq!(holder, attached.node_id, "a gateway-local job won by {holder}");
    }
    assert!(fake.jobs_heard() >= 1, "the unattached worker heard a job (it was in the race)");
    assert_eq!(pinned.jobs_heard() + unpinned.jobs_heard(), 0, "heard off the gateway's topic");
    for idem in ["pin1", "pin2"] {
        let (job, holder) = served_by(&gw, routed(R::Private, "public", idem)).await;
        assert_eq!(holder, pinned.node_id, "a pinned tenant's job won by {holder}");
        let record: gcs_protocol::ApiRequestJob =
            gw.keyspace().get_cbor(&keys::confined_job(&job)).unwrap().unwrap();
        assert_eq!(record.routing.allowed_nodes, vec![pinned.node_id.clone()]);
    }
    assert!(unpinned.jobs_heard() >= 2, "the unpinned member heard the private jobs");
    // No pinned node can win a private job (its admission revoked; then
    // admitted and pinned but not running): refused at once, not after
    // the queue timeout. A hybrid job still falls back to public nodes.
    store.revoke(&tenant, &pinned.node_id, false, gcs_node::now_ms()).unwrap();
    trust.set(store.trust().unwrap());
    let ghost = tempfile::tempdir().unwrap();
    for (idem, pin_ghost) in [("pin3", false), ("pin4", true)] {
        if pin_ghost {
            let _ = admit(&dirs[0], &tenant, &ghost, false);
            let id = gcs_node::Identity::load_or_create(ghost.path()).unwrap().node_id();
            store.pin(&tenant, &id, true).unwrap();
            trust.set(store.trust().unwrap());
            assert_eq!(trust.get().pinned["tenant_1"], vec![id], "the ghost is the live pin");
        }
        let t0 = Instant::now();
        let r = gw.submit(routed(R::Private, "public", idem)).await;
        assert!(matches!(r, Err(gcs_node::NodeError::NoCapableNodes(_))), "{idem}: {r:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{idem}: {:?}", t0.elapsed());
    }
    let (_, holder) = served_by(&gw, routed(R::Hybrid, "public", "pin5")).await;
    assert!(holder == attached.node_id || holder == fake.node_id, "hybrid won by {holder}");
    for n in [gw, attached, fake, pinned, unpinned] {
        n.shutdown().await;
    }
}

/// Usage records replicate among the gateways of their tenant only — by
/// gossip on the tenant's topic, and by anti-entropy to a gateway that
/// joins later — never to workers or to other tenants' gateways; a job's
/// stream and result stay on its gateway and worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_records_reach_their_scope_and_no_one_else() {
    let dirs: Vec<_> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    // tenant_1's key (in dirs[0]) admits its gateways g1, g2 and g4; every
    // gateway trusts that key (g3 serves tenant_1 later).
    let tenant = Group::Tenant("tenant_1".into());
    let certs: Vec<_> = [0, 1, 4].iter().map(|i| (*i, admit(&dirs[0], &tenant, &dirs[*i], true))).collect();
    let trust = TenantStore::new(dirs[0].path()).trust().unwrap();
    let gateway = |i: usize, tenant: &str, boot: Vec<libp2p::Multiaddr>| {
        let mut c = config(Role::Gateway, &dirs[i], boot, None);
        c.network.served_tenants = vec![tenant.to_string()];
        c.network.anti_entropy_interval = Duration::from_millis(300);
        c.network.tenant_trust = TenantTrust::new(trust.clone());
        c.memberships = certs.iter().filter(|(j, _)| *j == i).map(|(_, m)| m.clone()).collect();
        c
    };
    let g1 = start(gateway(0, "tenant_1", vec![])).await.unwrap();
    let a = addr(&g1).await;
    let g2 = start(gateway(1, "tenant_1", vec![a.clone()])).await.unwrap();
    let g3 = start(gateway(2, "tenant_2", vec![a.clone()])).await.unwrap();
    let w = start(config(Role::Worker, &dirs[3], vec![a.clone()], Some(Scripted::new(4, 0, 5))))
        .await
        .unwrap();
    wait_for("the worker at g1", || {
        g1.fresh_registrations().iter().any(|r| r.node_id == w.node_id)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut s = spec();
    s.idempotency_key = "usage-1".into();
    let (job, mut rx) = g1.submit(s).await.unwrap();
    while !matches!(next(&mut rx).await, JobEvent::Completed(_)) {}
    let key = keys::usage(&job);
    let has = |n: &NodeHandle| n.keyspace().get_bytes(&key).unwrap().is_some();
    wait_for("the usage record at g2", || has(&g2)).await;
    assert_eq!(usage(&g2, &job), usage(&g1, &job), "the same signed record");
    assert!(
        g2.keyspace().get_bytes(&keys::job_of_tenant("tenant_1", &job)).unwrap().is_some(),
        "indexed under its tenant"
    );
    // A gateway of the tenant that joins afterwards catches up.
    let g4 = start(gateway(4, "tenant_1", vec![a])).await.unwrap();
    wait_for("the usage record at the late gateway", || has(&g4)).await;
    // Several anti-entropy rounds later, still nowhere else.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!has(&g3), "another tenant's gateway got the record");
    assert!(!has(&w), "a worker got the record");
    // Job-participant scope: the stream and the result live on the job's
    // gateway and worker, identical, and nowhere else.
    let first = keys::stream_chunk(&job, 0);
    let result = keys::result(&job);
    for k in [&first, &result] {
        let at = |n: &NodeHandle| n.keyspace().get_bytes(k).unwrap();
        assert!(at(&g1).is_some() && at(&w).is_some(), "{k} at both participants");
        assert!(at(&g2).is_none() && at(&g3).is_none() && at(&g4).is_none(), "{k} elsewhere");
    }
    assert_eq!(g1.keyspace().get_bytes(&first).unwrap(), w.keyspace().get_bytes(&first).unwrap());
    // g3 gets a key of tenant_1 (its api_keys.json changed): it catches up.
    g3.network().serve_tenants(vec!["tenant_1".into(), "tenant_2".into()]).await.unwrap();
    wait_for("the usage record at g3 once it serves the tenant", || has(&g3)).await;
    for n in [g1, g2, g3, g4, w] {
        n.shutdown().await;
    }
}

/// A peer floods the gateway with direct requests and signed gossip while a
/// stream runs: the stream completes whole, and the gateway's network loop
/// keeps answering its own runtime throughout (the loop never waits for
/// the runtime, so a full event queue costs dropped gossip or "busy"
/// answers, never a deadlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_requests_and_gossip_does_not_stall_a_running_stream() {
    use gcs_node::jobs::wire::{JobRequest, JobResponse};
    let net = network(vec![Scripted::new(40, 0, 50)]).await;
    let dir = tempfile::tempdir().unwrap();
    let identity = gcs_node::Identity::load_or_create(dir.path()).unwrap();
    let ks = Arc::new(
        gcs_keyspace::Keyspace::open(
            &dir.path().join("ks"),
            identity.node_id().as_str(),
            Default::default(),
        )
        .unwrap(),
    );
    let mut cfg = gcs_node::NetworkConfig { mdns: false, ..Default::default() };
    cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    cfg.bootstrap = vec![addr(&net.gw).await];
    let (flooder, _events) = gcs_node::Network::start(&identity, cfg, ks).await.unwrap();
    flooder.subscribe(gcs_node::topics::CAPABILITIES_ALL).await.unwrap();
    let key = gcs_protocol::NodeKey::from_seed(identity.key.seed());
    let gw_peer = net.gw.peer_id;
    // Connected and subscribed: its gossip reaches the gateway.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (_job, mut rx) = net.gw.submit(spec()).await.unwrap();
    let flood = {
        let flooder = flooder.clone();
        tokio::spawn(async move {
            let (mut answered, mut busy) = (0u32, 0u32);
            for round in 0..40u64 {
                let mut reqs = vec![];
                for _ in 0..50 {
                    let f = flooder.clone();
                    reqs.push(tokio::spawn(async move {
                        f.request(gw_peer, JobRequest::Envelope(vec![0xa5; 256])).await
                    }));
                }
                for i in 0..25u64 {
                    let p = gcs_protocol::samples::Params {
                        now_ms: gcs_node::now_ms(),
                        n: round * 100 + i,
                        ..Default::default()
                    };
                    let mut reg = gcs_protocol::samples::registration(&key, &p);
                    reg.signature = None;
                    gcs_protocol::sign(&mut reg, &key).unwrap();
                    let bytes = gcs_protocol::encode(&reg).unwrap();
                    let _ = flooder.publish(gcs_node::topics::CAPABILITIES_ALL, bytes).await;
                }
                for r in reqs {
                    match r.await.unwrap() {
                        Ok(JobResponse::Refused(why)) if why == "busy" => busy += 1,
                        Ok(_) => answered += 1,
                        Err(_) => {}
                    }
                }
            }
            (answered, busy)
        })
    };
    // The gateway's own network loop answers within a second throughout.
    let mut words = 0;
    loop {
        let t = Instant::now();
        net.gw.listen_addrs().await.unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "the gateway's loop stalled: {:?}",
            t.elapsed()
        );
        match next(&mut rx).await {
            JobEvent::Chunk(c) if c.finish_reason.is_none() => words += 1,
            JobEvent::Chunk(_) | JobEvent::Leased { .. } => {}
            JobEvent::Completed(r) => {
                assert_eq!(r.status, gcs_protocol::ResultStatus::Completed);
                break;
            }
            other => panic!("the stream did not survive the flood: {other:?}"),
        }
    }
    assert_eq!(words, 40, "every word arrived");
    let (answered, busy) =
        tokio::time::timeout(Duration::from_secs(60), flood).await.unwrap().unwrap();
    eprintln!("flood: {answered} requests answered, {busy} busy");
    assert!(answered + busy > 1000, "the flood was answered, not dropped: {answered} + {busy}");
    flooder.shutdown().await;
    net.gw.shutdown().await;
    for w in net.workers.into_iter().flatten() {
        w.shutdown().await;
    }
}

/// One peer floods the gateway with anti-entropy requests of its own
/// making (thousands of repeated tenants) and with signed job deltas while
/// a stream runs: the stream completes, the gateway's loop answers
/// throughout, the requests beyond the per-peer rate are answered "busy",
/// and what the delta flood adds to the gateway's store is bounded by the
/// peer's quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anti_entropy_and_delta_flood_neither_stalls_the_node_nor_fills_its_disk() {
    use gcs_keyspace::Namespace;
    const QUOTA_BYTES: u64 = 64 << 10;
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut gc = config(Role::Gateway, &dirs[0], vec![], None);
    gc.network.quota =
        gcs_node::quota::QuotaConfig { window_ms: 600_000, max_bytes: QUOTA_BYTES, max_keys: 10_000 };
    let gw = start(gc).await.unwrap();
    let a = addr(&gw).await;
    let w = start(config(Role::Worker, &dirs[1], vec![a.clone()], Some(Scripted::new(40, 0, 50))))
        .await
        .unwrap();
    wait_for("the worker's registration", || {
        gw.fresh_registrations().iter().any(|r| r.node_id == w.node_id)
    })
    .await;
    let identity = gcs_node::Identity::load_or_create(dirs[2].path()).unwrap();
    let fks = Arc::new(
        gcs_keyspace::Keyspace::open(
            &dirs[2].path().join("ks"),
            identity.node_id().as_str(),
            Default::default(),
        )
        .unwrap(),
    );
    let mut cfg = gcs_node::NetworkConfig { mdns: false, ..Default::default() };
    cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    cfg.bootstrap = vec![a];
    let (flooder, _events) = gcs_node::Network::start(&identity, cfg, fks.clone()).await.unwrap();
    flooder.subscribe(gcs_node::topics::KEYSPACE_DELTAS).await.unwrap();
    let key = gcs_protocol::NodeKey::from_seed(identity.key.seed());
    let gw_peer = gw.peer_id;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let jobs_before = gw.keyspace().digest(Namespace::ApiJobs).unwrap().count;

    let (job, mut rx) = gw.submit(spec()).await.unwrap();
    assert!(gw.keyspace().get_bytes(&keys::open_job(&job)).unwrap().is_some(), "open until metered");
    let flood = {
        let (flooder, fks) = (flooder.clone(), fks.clone());
        tokio::spawn(async move {
            let mut req = gcs_node::network::AntiEntropyRequest {
                version: 1,
                digests: vec![],
                // Under the request's wire bound (256 KiB): what reaches
                // the answer is bounded by deduplication and the tenant cap.
                tenants: vec![("tenant_1".into(), vec![0; 32], 1); 2000],
                since: None,
                after: vec![],
            };
            req.tenants.extend((0..1000).map(|i| (format!("t{i}"), vec![0; 32], 1)));
            let (mut answered, mut busy, mut sent_bytes) = (0u32, 0u32, 0u64);
            let mut failed = None;
            for round in 0..10u64 {
                let mut reqs = vec![];
                for _ in 0..20 {
                    let (f, r) = (flooder.clone(), req.clone());
                    reqs.push(tokio::spawn(async move { f.anti_entropy_request(gw_peer, r).await }));
                }
                for i in 0..40u64 {
                    let p = gcs_protocol::samples::Params {
                        now_ms: gcs_node::now_ms(),
                        n: round * 100 + i,
                        ..Default::default()
                    };
                    let mut job = gcs_protocol::samples::api_job(&key, &p);
                    job.job_id = format!("gcsapi_flood{:06}", round * 100 + i);
                    job.signature = None;
                    gcs_protocol::sign(&mut job, &key).unwrap();
                    let d = fks
                        .put(&keys::job(&job.job_id), gcs_protocol::encode(&job).unwrap(), gcs_node::now_ms())
                        .unwrap()
                        .encode();
                    sent_bytes += d.len() as u64;
                    let _ = flooder.publish(gcs_node::topics::KEYSPACE_DELTAS, d).await;
                }
                for r in reqs {
                    match r.await.unwrap() {
                        Ok(a) if a.busy => busy += 1,
                        Ok(_) => answered += 1,
                        Err(e) => failed = Some(e.to_string()),
                    }
                }
            }
            if let Some(e) = failed {
                eprintln!("some flood requests failed: {e}");
            }
            (answered, busy, sent_bytes)
        })
    };
    let mut words = 0;
    loop {
        let t = Instant::now();
        gw.listen_addrs().await.unwrap();
        assert!(t.elapsed() < Duration::from_secs(1), "the gateway's loop stalled: {:?}", t.elapsed());
        match next(&mut rx).await {
            JobEvent::Chunk(c) if c.finish_reason.is_none() => words += 1,
            JobEvent::Chunk(_) | JobEvent::Leased { .. } => {}
            JobEvent::Completed(r) => {
                assert_eq!(r.status, gcs_protocol::ResultStatus::Completed);
                break;
            }
            other => panic!("the stream did not survive the flood: {other:?}"),
        }
    }
    assert_eq!(words, 40, "every word arrived");
    let (answered, busy, sent_bytes) =
        tokio::time::timeout(Duration::from_secs(60), flood).await.unwrap().unwrap();
    let st = gw.network().stats();
    let refused = st.quota_refused.load(Ordering::Relaxed);
    let added = gw.keyspace().digest(Namespace::ApiJobs).unwrap().count - jobs_before - 1;
    eprintln!(
        "flood: {answered} answered, {busy} busy; {sent_bytes} delta bytes sent, {added} jobs added, \
         {refused} refused by quota"
    );
    assert!(busy > 0, "requests beyond the per-peer rate are answered busy");
    assert!(
        u64::from(answered) <= 2 * u64::from(gcs_node::network::REQUESTS_PER_INTERVAL),
        "{answered} answers: more than the rate allows"
    );
    assert!(sent_bytes > 4 * QUOTA_BYTES, "the flood exceeds the quota: {sent_bytes}");
    let one = sent_bytes / 400;
    assert!(added * one <= QUOTA_BYTES + one, "{added} flood jobs stored: beyond the quota");
    assert!(refused > 0, "refusals are counted");
    // /v1/usage reads the key's index: this job's record, nobody else's.
    use gcs_gateway::Backend as _;
    let mine = gw.client().usage("key_1", 0, u64::MAX).unwrap();
    assert_eq!(mine.iter().map(|u| u.job_id.as_str()).collect::<Vec<_>>(), [job.as_str()]);
    assert!(gw.client().usage("key_2", 0, u64::MAX).unwrap().is_empty());
    assert!(gw.keyspace().get_bytes(&keys::open_job(&job)).unwrap().is_none(), "metered: closed");
    flooder.shutdown().await;
    gw.shutdown().await;
    w.shutdown().await;
}
