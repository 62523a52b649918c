//! Batches in a scenario (issue 20 §4): each `[[batches]]` uploads a JSONL
//! file of chat requests through `/v1/files`, creates a batch on
//! `/v1/batches` and polls it until it ends, through whatever the faults do
//! (a gateway restarted mid-batch answers nothing for a while; the poller
//! keeps asking). After the traffic every batch is judged: it completed,
//! every `custom_id` is answered exactly once (none lost, none run twice
//! into the output), each answer equals the same request sent alone before
//! the faults (greedy), every answer has exactly one usage record naming
//! the batch, and a subtask whose lock holder was killed was taken over by
//! another worker.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{request_json, request_text};
use crate::cluster::{endpoint, Cluster};
use crate::history::Check;
use crate::scenario::{BatchSpec, Role, Scenario};
use crate::Error;

/// What a batch's poller has seen so far.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// The batch id, once created.
    pub id: Option<String>,
    /// Requests answered (`completed + failed`).
    pub done: u64,
    /// The last status read.
    pub status: String,
    /// The poller has stopped.
    pub ended: bool,
}

/// A batch's poller, running.
#[derive(Debug)]
pub struct Running {
    /// The batch's name in the scenario.
    pub name: String,
    /// What it has seen.
    pub shared: Arc<Mutex<Progress>>,
    handle: JoinHandle<Record>,
}

impl Running {
    /// A copy of what the poller has seen.
    pub fn progress(&self) -> Progress {
        self.shared.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One answer line of the output or error file.
#[derive(Clone, Debug, Serialize)]
struct Answer {
    status: u64,
    content: String,
    request_id: String,
}

/// What a batch ended as.
#[derive(Clone, Debug, Default, Serialize)]
struct Record {
    id: String,
    status: String,
    counts: Value,
    /// Per `custom_id`, every line that answers it.
    answers: BTreeMap<String, Vec<Answer>>,
    error: Option<String>,
    seconds: f64,
}

/// The answer of every line sent alone (non-streamed, the reference key's
/// tenant), per batch that asks for references.
pub fn references(s: &Scenario, cluster: &Cluster) -> Result<BTreeMap<String, Vec<String>>, Error> {
    let mut out = BTreeMap::new();
    for b in s.batches.iter().filter(|b| b.reference) {
        let (gw, key) = endpoint(cluster, &cluster.reference_keys, &b.gateway)?;
        let mut texts = vec![];
        for i in 0..b.lines {
            let body = b.body(i).to_string();
            let (status, v) = request_json(gw, "POST", "/v1/chat/completions", &key, body.as_bytes())?;
            let text = v["choices"][0]["message"]["content"].as_str();
            let Some(text) = text.filter(|_| status == 200) else {
                return Err(Error::Setup(format!("reference of {} line {i}: {status} {v}", b.name)));
            };
            texts.push(text.to_string());
        }
        tracing::info!(batch = %b.name, lines = b.lines, "batch references taken");
        out.insert(b.name.clone(), texts);
    }
    Ok(out)
}

/// Starts a poller per batch, each at its offset from now.
pub fn start(s: &Scenario, cluster: &Cluster) -> Result<Vec<Running>, Error> {
    let mut out = vec![];
    for b in &s.batches {
        let (gw, key) = endpoint(cluster, &cluster.keys, &b.gateway)?;
        let (poll, _) = endpoint(cluster, &cluster.keys, b.poll.as_ref().unwrap_or(&b.gateway))?;
        let shared = Arc::new(Mutex::new(Progress::default()));
        let (spec, sh) = (b.clone(), shared.clone());
        let handle = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(spec.start_ms));
            let rec = run_one(&spec, (gw, poll), &key, &sh);
            sh.lock().unwrap_or_else(|p| p.into_inner()).ended = true;
            rec
        });
        out.push(Running { name: b.name.clone(), shared, handle });
    }
    Ok(out)
}

/// The longest a batch may run, counted from the start of traffic.
pub fn longest_s(s: &Scenario) -> u64 {
    s.batches.iter().map(|b| b.start_ms / 1000 + b.timeout_s).max().unwrap_or(0)
}

/// `gw` creates the batch, `poll` answers for it afterwards.
fn run_one(
    spec: &BatchSpec,
    (gw, poll): (SocketAddr, SocketAddr),
    key: &str,
    shared: &Mutex<Progress>,
) -> Record {
    let t0 = Instant::now();
    let mut rec = Record::default();
    let fail = |mut rec: Record, why: String| {
        rec.error = Some(why);
        rec.seconds = t0.elapsed().as_secs_f64();
        rec
    };
    let id = match create(spec, gw, key) {
        Ok(id) => id,
        Err(e) => return fail(rec, format!("could not create the batch: {e}")),
    };
    rec.id = id.clone();
    shared.lock().unwrap_or_else(|p| p.into_inner()).id = Some(id.clone());
    let deadline = t0 + Duration::from_secs(spec.timeout_s);
    let last = loop {
        if Instant::now() > deadline {
            return fail(rec, format!("not ended after {} s", spec.timeout_s));
        }
        // A gateway down (restarting) answers nothing: ask again.
        if let Ok((200, v)) = request_json(poll, "GET", &format!("/v1/batches/{id}"), key, b"") {
            let status = v["status"].as_str().unwrap_or("").to_string();
            let c = &v["request_counts"];
            let done = c["completed"].as_u64().unwrap_or(0) + c["failed"].as_u64().unwrap_or(0);
            {
                let mut p = shared.lock().unwrap_or_else(|p| p.into_inner());
                (p.done, p.status) = (done, status.clone());
            }
            if matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled") {
                break v;
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    rec.status = last["status"].as_str().unwrap_or("").to_string();
    rec.counts = last["request_counts"].clone();
    for field in ["output_file_id", "error_file_id"] {
        let Some(file) = last[field].as_str() else { continue };
        let path = format!("/v1/files/{file}/content");
        match request_text(poll, "GET", &path, key, "application/json", b"") {
            Ok((200, text)) => read_answers(&text, &mut rec.answers),
            Ok((status, text)) => return fail(rec, format!("{path}: {status} {text}")),
            Err(e) => return fail(rec, format!("{path}: {e}")),
        }
    }
    rec.seconds = t0.elapsed().as_secs_f64();
    rec
}

/// Uploads the file and creates the batch; returns its id.
fn create(spec: &BatchSpec, gw: SocketAddr, key: &str) -> Result<String, Error> {
    let b = "netsimbatchboundary";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\n\
         Content-Disposition: form-data; name=\"file\"; filename=\"{}.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{}\r\n--{b}--\r\n",
        spec.name,
        spec.file()
    );
    let kind = format!("multipart/form-data; boundary={b}");
    let (status, text) = request_text(gw, "POST", "/v1/files", key, &kind, body.as_bytes())?;
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let file = v["id"].as_str().filter(|_| status == 200);
    let file = file.ok_or_else(|| Error::Http(format!("upload: {status} {text}")))?;
    let req = json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                     "completion_window": "24h", "metadata": {"scenario": spec.name}});
    let (status, v) = request_json(gw, "POST", "/v1/batches", key, req.to_string().as_bytes())?;
    let id = v["id"].as_str().filter(|_| status == 200);
    id.map(str::to_string).ok_or_else(|| Error::Http(format!("create: {status} {v}")))
}

/// Adds every line of an output or error file to `answers`.
fn read_answers(text: &str, answers: &mut BTreeMap<String, Vec<Answer>>) {
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
        let r = &v["response"];
        let content = r["body"]["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{}", if r.is_null() { &v["error"] } else { &r["body"] }));
        let a = Answer {
            status: r["status_code"].as_u64().unwrap_or(0),
            content,
            request_id: r["request_id"].as_str().unwrap_or("").to_string(),
        };
        let id = v["custom_id"].as_str().unwrap_or("?").to_string();
        answers.entry(id).or_default().push(a);
    }
}

/// Markers of a worker's processing log lines: a lock taken, then one of
/// the three that end it.
const LOCKED: &str = "processing subtask locked";
const ENDED: [&str; 3] =
    ["processing subtask done", "processing lock released", "processing step abandoned"];

/// A worker holding a processing subtask's lock now, by its log (one
/// processing slot: its last processing line took a lock), and the subtask.
pub fn lock_holder(cluster: &Cluster) -> Option<(String, String)> {
    cluster.nodes.values().filter(|n| matches!(n.role, Role::Worker | Role::All)).find_map(|n| {
        let logs = n.logs();
        let last = logs
            .lines()
            .rev()
            .find(|l| l.contains(LOCKED) || ENDED.iter().any(|m| l.contains(m)))?;
        let subtask = subtask_of(last).filter(|_| last.contains(LOCKED))?;
        Some((n.name.clone(), subtask))
    })
}

fn subtask_of(line: &str) -> Option<String> {
    let v = line.split_whitespace().find_map(|w| w.strip_prefix("subtask="))?;
    Some(v.trim_matches('"').to_string())
}

/// Judges every batch once its poller has ended; `killed_holders` are the
/// (node, subtask) of every `lock_holder` fault.
pub fn judge(
    s: &Scenario,
    cluster: &Cluster,
    running: Vec<Running>,
    references: &BTreeMap<String, Vec<String>>,
    killed_holders: &[(String, String)],
) -> Vec<Check> {
    let mut out = vec![];
    for r in running {
        let Some(spec) = s.batches.iter().find(|b| b.name == r.name) else { continue };
        let rec = r.handle.join().unwrap_or_else(|_| Record {
            error: Some("poller panicked".into()),
            ..Record::default()
        });
        out.push(status_check(spec, &rec));
        out.push(once_check(spec, &rec));
        if let Some(refs) = references.get(&spec.name) {
            out.push(reference_check(spec, &rec, refs));
        }
        out.push(metered_check(s, spec, cluster, &rec));
    }
    for (node, sub) in killed_holders {
        out.push(taken_over(cluster, node, sub));
    }
    out
}

fn status_check(spec: &BatchSpec, rec: &Record) -> Check {
    let c = &rec.counts;
    let ok = rec.error.is_none()
        && rec.status == "completed"
        && c["completed"].as_u64() == Some(u64::from(spec.lines))
        && c["failed"].as_u64() == Some(0);
    let detail = match &rec.error {
        Some(e) => format!("{} {}: {e}", spec.name, rec.id),
        None => format!("{} {} {} in {:.1} s, counts {c}", spec.name, rec.id, rec.status, rec.seconds),
    };
    Check { name: "batch_completed", ok, detail }
}

fn once_check(spec: &BatchSpec, rec: &Record) -> Check {
    let want: BTreeSet<String> = (0..spec.lines).map(|i| format!("b{i}")).collect();
    let missing: Vec<&String> = want.iter().filter(|id| !rec.answers.contains_key(*id)).collect();
    let twice: Vec<&String> = rec.answers.iter().filter(|(_, a)| a.len() > 1).map(|(k, _)| k).collect();
    let stray: Vec<&String> = rec.answers.keys().filter(|k| !want.contains(*k)).collect();
    let ok = missing.is_empty() && twice.is_empty() && stray.is_empty();
    let detail = format!(
        "{}: {} of {} answered; missing {missing:?}, twice {twice:?}, unknown {stray:?}",
        spec.name,
        rec.answers.len(),
        spec.lines
    );
    Check { name: "batch_each_once", ok, detail }
}

fn reference_check(spec: &BatchSpec, rec: &Record, refs: &[String]) -> Check {
    let mut differ = vec![];
    for (i, want) in refs.iter().enumerate() {
        let got = rec.answers.get(&format!("b{i}")).and_then(|a| a.first());
        if got.is_none_or(|a| a.status != 200 || &a.content != want) {
            let got = got.map_or("(none)".to_string(), |a| format!("{} {:?}", a.status, a.content));
            differ.push(format!("b{i}: {got} vs {want:?}"));
        }
    }
    let detail = match differ.first() {
        None => format!("{}: {} answers equal the requests sent alone", spec.name, refs.len()),
        Some(first) => format!("{}: {} differ, first {first}", spec.name, differ.len()),
    };
    Check { name: "batch_reference", ok: differ.is_empty(), detail }
}

/// One usage record per answer, naming the batch (a request metered twice,
/// or an answer with no record, fails), polled for the scenario's usage
/// wait.
fn metered_check(s: &Scenario, spec: &BatchSpec, cluster: &Cluster, rec: &Record) -> Check {
    let deadline = Instant::now() + Duration::from_secs(s.limits.usage_wait_s);
    let answered: BTreeSet<&str> =
        rec.answers.values().flatten().map(|a| a.request_id.as_str()).collect();
    let mut detail = String::new();
    while !rec.id.is_empty() {
        let ep = endpoint(cluster, &cluster.keys, &spec.gateway).and_then(|(_, key)| {
            let (poll, _) = endpoint(cluster, &cluster.keys, spec.poll.as_ref().unwrap_or(&spec.gateway))?;
            Ok((poll, key))
        });
        let path = format!("/v1/usage?limit=1000&batch_id={}", rec.id);
        let got = ep.ok().and_then(|(gw, key)| request_json(gw, "GET", &path, &key, b"").ok());
        let recs = got.as_ref().and_then(|(_, v)| v["data"].as_array().cloned()).unwrap_or_default();
        let jobs: BTreeSet<&str> = recs.iter().filter_map(|r| r["job_id"].as_str()).collect();
        let unmetered = answered.iter().filter(|j| !jobs.contains(**j)).count();
        let ok = recs.len() == rec.answers.len() && jobs.len() == recs.len() && unmetered == 0;
        detail = format!(
            "{}: {} usage records for {} answers, {unmetered} answers without one",
            spec.name,
            recs.len(),
            rec.answers.len()
        );
        if ok {
            return Check { name: "batch_metered", ok, detail };
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Check { name: "batch_metered", ok: false, detail }
}

/// The subtask the killed worker held was locked again by another worker
/// (after its lock expired).
fn taken_over(cluster: &Cluster, victim: &str, subtask: &str) -> Check {
    let by: Vec<&str> = cluster
        .nodes
        .values()
        .filter(|n| n.name != victim && matches!(n.role, Role::Worker | Role::All))
        .filter(|n| {
            n.logs()
                .lines()
                .any(|l| l.contains(LOCKED) && subtask_of(l).as_deref() == Some(subtask))
        })
        .map(|n| n.name.as_str())
        .collect();
    let detail = if by.is_empty() {
        format!("{subtask}, held by {victim} when it was killed, was locked by no other worker")
    } else {
        format!("{subtask}, held by {victim} when it was killed, was taken over by {}", by.join(","))
    };
    Check { name: "subtask_taken_over", ok: !by.is_empty(), detail }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_line_names_its_subtask() {
        let l = "2026-12-04T00:00:00Z  INFO gcs_node::processing::worker: processing subtask \
                 locked subtask=0123abcd/s3 lock_id=lk_1 lease_ms=4000";
        assert_eq!(subtask_of(l).as_deref(), Some("0123abcd/s3"));
        assert_eq!(subtask_of("processing subtask done lines=4"), None);
    }

    #[test]
    fn an_answer_given_twice_or_missing_fails_the_once_check() {
        let spec: BatchSpec = toml::from_str("name = \"b\"\ngateway = \"gw\"\nlines = 2").unwrap();
        let mut rec = Record::default();
        let line = |id: &str| {
            format!(
                "{{\"custom_id\":\"{id}\",\"response\":{{\"status_code\":200,\"request_id\":\"j\",\
                 \"body\":{{\"choices\":[{{\"message\":{{\"content\":\"x\"}}}}]}}}},\"error\":null}}"
            )
        };
        read_answers(&format!("{}\n{}\n", line("b0"), line("b1")), &mut rec.answers);
        assert!(once_check(&spec, &rec).ok);
        read_answers(&line("b1"), &mut rec.answers);
        assert!(!once_check(&spec, &rec).ok, "b1 twice");
        rec.answers.remove("b0");
        rec.answers.get_mut("b1").map(Vec::pop);
        assert!(!once_check(&spec, &rec).ok, "b0 missing");
        assert_eq!(rec.answers["b1"][0].content, "x");
    }
}
