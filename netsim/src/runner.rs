//! Runs a scenario: bring the topology up, take reference answers, start
//! the clients, fire the faults on their triggers, collect usage records,
//! and judge the history.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::client::{self, progress, ChatRequest, Record, Shared, Terminal};
use crate::cluster::Cluster;
use crate::history::Entry;
use crate::scenario::{Action, FaultSpec, RequestSpec, Role, Scenario};
use crate::Error;

/// A fault as it happened.
#[derive(Clone, Debug, Serialize)]
pub struct FaultEvent {
    /// Milliseconds after traffic start.
    pub at_ms: u64,
    /// What.
    pub action: String,
    /// Resolved node.
    pub node: String,
    /// Content frames the triggering request had received when the node
    /// was frozen (for `after_tokens` triggers).
    pub frames_at_fault: Option<u64>,
}

/// The outcome of a scenario.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Scenario name.
    pub scenario: String,
    /// Every request.
    pub entries: Vec<Entry>,
    /// Faults fired.
    pub faults: Vec<FaultEvent>,
    /// Faults that never fired (their trigger never came).
    pub unfired: Vec<String>,
    /// Peak RSS growth over the run's start, per HTTP node, in MiB.
    pub rss_growth_mib: BTreeMap<String, f64>,
    /// Run-level checks (faults fired, RSS bounded).
    pub run_checks: Vec<crate::history::Check>,
    /// Seconds the run took.
    pub seconds: f64,
}

impl Outcome {
    /// Every check passed.
    pub fn ok(&self) -> bool {
        self.entries.iter().all(Entry::ok) && self.run_checks.iter().all(|c| c.ok)
    }
}

fn chat_request(s: &RequestSpec) -> ChatRequest {
    let filler = "word ".repeat(s.filler_words as usize);
    ChatRequest {
        prompt: format!("{filler}{}", s.prompt),
        max_tokens: s.max_tokens,
        stream: s.stream,
        ban_eos: s.ban_eos,
        include_usage: s.include_usage,
        read_bytes_per_s: s.read_bytes_per_s,
        rcvbuf: s.rcvbuf,
        timeout: Duration::from_secs(s.timeout_s),
    }
}

/// The usage record of one job on a gateway, if written yet.
pub fn usage_of(addr: SocketAddr, key: &str, job: &str) -> Option<Value> {
    let (status, v) = client::request_json(addr, "GET", "/v1/usage?limit=1000", key, b"").ok()?;
    if status != 200 {
        return None;
    }
    v["data"].as_array()?.iter().find(|u| u["job_id"].as_str() == Some(job)).cloned()
}

struct Running {
    group: usize,
    index: u32,
    shared: Shared,
    handle: JoinHandle<Record>,
}

struct PendingFault {
    spec: FaultSpec,
    fired: bool,
    resume_at: Option<(Instant, String)>,
}

/// Runs one scenario in `workdir` with the given binary.
pub fn run(s: &Scenario, bin: &Path, workdir: &Path) -> Result<Outcome, Error> {
    let started = Instant::now();
    tracing::info!(scenario = %s.name, "starting the topology");
    let mut cluster = Cluster::start(bin, workdir, &s.nodes)?;
    let addr = |c: &Cluster, n: &str| c.nodes.get(n).map(|x| x.http);
    let mut references = BTreeMap::new();
    for r in s.requests.iter().filter(|r| r.reference) {
        let gw = addr(&cluster, &r.gateway).ok_or_else(|| Error::Setup(r.gateway.clone()))?;
        let key = cluster.keys.get(&r.gateway).cloned().unwrap_or_default();
        let mut req = chat_request(r);
        req.read_bytes_per_s = None;
        let rec = client::chat(gw, &key, &req, &Shared::default(), &|| false);
        if rec.terminal != Terminal::Complete {
            let why = rec.error.map(|e| e.to_string()).unwrap_or_default();
            return Err(Error::Setup(format!(
                "reference run of {} ended {:?} {why}; logs in {}",
                r.name,
                rec.terminal,
                workdir.display()
            )));
        }
        tracing::info!(group = %r.name, chars = rec.content.len(), "reference answer taken");
        references.insert(r.name.clone(), rec.content);
    }
    // Let the reference jobs' slots free before the traffic: a worker still
    // busy when a job is announced backlogs it, and its late claim can race
    // the requeue the scenario means to test (see README, known issues).
    let settle = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settle
        && cluster.nodes.values().any(|n| n.role == Role::All && n.active_jobs().unwrap_or(0) > 0)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    if !references.is_empty() {
        std::thread::sleep(Duration::from_millis(1000));
    }
    let http_nodes: Vec<String> =
        cluster.nodes.values().filter(|n| n.role != Role::Worker).map(|n| n.name.clone()).collect();
    let base_rss: BTreeMap<String, u64> = http_nodes
        .iter()
        .filter_map(|n| Some((n.clone(), cluster.nodes.get(n)?.rss_kib()?)))
        .collect();
    let mut peak_rss = base_rss.clone();

    // Clients.
    let t0 = Instant::now();
    let mut running = vec![];
    for (gi, r) in s.requests.iter().enumerate() {
        let gw = addr(&cluster, &r.gateway).ok_or_else(|| Error::Setup(r.gateway.clone()))?;
        let key = cluster.keys.get(&r.gateway).cloned().unwrap_or_default();
        for i in 0..r.count {
            let shared = Shared::default();
            let (req, key2, sh) = (chat_request(r), key.clone(), shared.clone());
            let delay = Duration::from_millis(r.start_ms + u64::from(i) * r.spacing_ms);
            let handle = std::thread::spawn(move || {
                std::thread::sleep(delay);
                // A slow client stops reading once its job has a usage
                // record: the gateway has given up on it by then.
                let give_up = || {
                    let job = progress(&sh).job_id.clone();
                    job.is_some_and(|j| usage_of(gw, &key2, &j).is_some())
                };
                client::chat(gw, &key2, &req, &sh, &give_up)
            });
            running.push(Running { group: gi, index: i, shared, handle });
        }
    }

    // Faults.
    let mut faults: Vec<PendingFault> = s
        .faults
        .iter()
        .map(|f| PendingFault { spec: f.clone(), fired: false, resume_at: None })
        .collect();
    let mut events = vec![];
    let mut died: Vec<(String, Instant)> = vec![];
    let hard_stop =
        t0 + Duration::from_secs(s.requests.iter().map(|r| r.timeout_s).max().unwrap_or(60) + 60);
    loop {
        let all_done = running.iter().all(|r| progress(&r.shared).ended);
        let resumes_left = faults.iter().any(|f| f.resume_at.is_some());
        if (all_done && !resumes_left) || Instant::now() > hard_stop {
            break;
        }
        for f in faults.iter_mut() {
            if let Some((when, node)) = f.resume_at.clone() {
                if Instant::now() >= when {
                    resume(&mut cluster, f.spec.action, &node)?;
                    f.resume_at = None;
                }
            }
            if f.fired {
                continue;
            }
            let Some(ev) = try_fire(&mut cluster, &f.spec, s, &running, t0)? else { continue };
            f.fired = true;
            if f.spec.action != Action::Kill || f.spec.hold_ms > 0 {
                let when = Instant::now() + Duration::from_millis(f.spec.hold_ms);
                f.resume_at = (f.spec.action != Action::Kill).then(|| (when, ev.node.clone()));
            }
            if matches!(f.spec.action, Action::Kill | Action::Restart) {
                died.push((ev.node.clone(), Instant::now()));
            }
            tracing::info!(action = %ev.action, node = %ev.node, at_ms = ev.at_ms, "fault");
            events.push(ev);
        }
        for n in &http_nodes {
            if let Some(kib) = cluster.nodes.get(n).and_then(|x| x.rss_kib()) {
                let p = peak_rss.entry(n.clone()).or_insert(kib);
                *p = (*p).max(kib);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for f in faults.iter_mut() {
        if let Some((_, node)) = f.resume_at.take() {
            resume(&mut cluster, f.spec.action, &node)?;
        }
    }

    // History.
    let mut entries = vec![];
    for r in running {
        let spec = &s.requests[r.group];
        let record = r.handle.join().unwrap_or_else(|_| Record::lost("client thread panicked"));
        let gateway_died = died.iter().any(|(n, _)| n == &spec.gateway);
        entries.push(Entry {
            group: spec.name.clone(),
            index: r.index,
            record,
            usage: None,
            gateway_died,
            checks: vec![],
            notes: vec![],
        });
    }
    let deadline = Instant::now() + Duration::from_secs(s.limits.usage_wait_s);
    loop {
        let mut missing = 0;
        for e in entries.iter_mut().filter(|e| e.usage.is_none() && e.record.status == 200) {
            let spec = s.requests.iter().find(|r| r.name == e.group);
            let (Some(spec), Some(job)) = (spec, e.record.job_id.clone()) else { continue };
            let gw =
                addr(&cluster, &spec.gateway).ok_or_else(|| Error::Setup(spec.gateway.clone()))?;
            let key = cluster.keys.get(&spec.gateway).cloned().unwrap_or_default();
            e.usage = usage_of(gw, &key, &job);
            missing += usize::from(e.usage.is_none());
        }
        if missing == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for e in &mut entries {
        if let Some(spec) = s.requests.iter().find(|r| r.name == e.group) {
            e.judge(spec, references.get(&e.group).map(String::as_str));
        }
    }

    let mut run_checks = vec![];
    let unfired: Vec<String> = faults
        .iter()
        .filter(|f| !f.fired)
        .map(|f| format!("{:?} {}", f.spec.action, f.spec.target))
        .collect();
    run_checks.push(crate::history::Check {
        name: "faults_fired",
        ok: unfired.is_empty(),
        detail: format!("{} fired, {} never triggered", events.len(), unfired.len()),
    });
    let rss_growth_mib: BTreeMap<String, f64> = peak_rss
        .iter()
        .map(|(n, p)| {
            (n.clone(), p.saturating_sub(base_rss.get(n).copied().unwrap_or(*p)) as f64 / 1024.0)
        })
        .collect();
    let worst = rss_growth_mib.values().copied().fold(0.0, f64::max);
    run_checks.push(crate::history::Check {
        name: "gateway_rss",
        ok: worst <= s.limits.max_gateway_rss_growth_mib as f64,
        detail: format!(
            "peak growth {worst:.1} MiB (limit {})",
            s.limits.max_gateway_rss_growth_mib
        ),
    });
    drop(cluster);
    Ok(Outcome {
        scenario: s.name.clone(),
        entries,
        faults: events,
        unfired,
        rss_growth_mib,
        run_checks,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Fires a fault if its trigger has come; returns what happened.
fn try_fire(
    cluster: &mut Cluster,
    f: &FaultSpec,
    s: &Scenario,
    running: &[Running],
    t0: Instant,
) -> Result<Option<FaultEvent>, Error> {
    let at_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    let t = &f.trigger;
    let watched = t.request.as_ref().and_then(|name| {
        let gi = s.requests.iter().position(|r| &r.name == name)?;
        running.iter().find(|r| r.group == gi).map(|r| r.shared.clone())
    });
    if let Some(at) = t.at_ms {
        if at_ms < at {
            return Ok(None);
        }
    } else {
        let (Some(w), Some(k)) = (&watched, t.after_tokens) else { return Ok(None) };
        let p = progress(w).clone();
        if !p.accepted || p.content_frames < k || p.ended {
            return Ok(None);
        }
    }
    let node = if f.target == "busy_worker" {
        match cluster.busy_workers().into_iter().next() {
            Some(n) => n,
            None => return Ok(None),
        }
    } else {
        f.target.clone()
    };
    // Freeze first, then read the client's progress: what it had when the
    // node stopped is what the fault "landed after".
    let n = cluster.node(&node)?;
    n.signal("STOP")?;
    std::thread::sleep(Duration::from_millis(50));
    let frames_at_fault = watched.map(|w| progress(&w).content_frames);
    match f.action {
        Action::Pause => {}
        Action::Kill | Action::Restart => n.kill(),
    }
    let action = format!("{:?}", f.action).to_lowercase();
    Ok(Some(FaultEvent { at_ms, action, node, frames_at_fault }))
}

/// Ends a pause (SIGCONT) or a restart's down time (start again).
fn resume(cluster: &mut Cluster, action: Action, node: &str) -> Result<(), Error> {
    let bin = cluster.bin.clone();
    let n = cluster.node(node)?;
    match action {
        Action::Pause => n.signal("CONT")?,
        Action::Restart => {
            n.spawn(&bin)?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !n.http_up() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Action::Kill => {}
    }
    tracing::info!(node, ?action, "resumed");
    Ok(())
}

/// Shared handle type re-exported for the load generator.
pub type SharedRecords = Arc<Mutex<Vec<Record>>>;
