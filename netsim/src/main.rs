//! `netsim`: run fault scenarios against real gcs-node processes, generate
//! load, or simulate the job market at scale. See netsim/README.md.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use netsim::{adversary, cluster, load, report, runner, scale, scenario::Scenario, series, soak};

#[derive(Parser, Debug)]
#[command(name = "netsim", about = "Fault injection, load and scale simulation for GCS")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run scenario files against real gcs-node processes and check the history.
    Run {
        /// Scenario files (TOML).
        #[arg(required = true)]
        scenarios: Vec<PathBuf>,
        /// The gcs-node binary (default: $GCS_NODE_BIN, next to netsim, or the target dir).
        #[arg(long, env = "GCS_NODE_BIN")]
        gcs_node: Option<PathBuf>,
        /// Where the JSON report goes.
        #[arg(long, default_value = "netsim-report.json")]
        report: PathBuf,
        /// Keep node data directories and logs here (default: a temporary directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// A soak file's length in seconds instead of its `duration_s`.
        #[arg(long, env = "GCS_SOAK_SECS")]
        soak_secs: Option<u64>,
    },
    /// A scenario's `[series]`: many faulted streams in one topology, each
    /// compared with its uninterrupted reference (exact continuation).
    Series {
        /// The scenario file (TOML) with a `[series]`.
        scenario: PathBuf,
        /// Greedy streams (default: the file's).
        #[arg(long)]
        greedy: Option<u32>,
        /// Seeded T=0.8 streams (default: the file's).
        #[arg(long)]
        seeded: Option<u32>,
        /// The base of every draw (fault index, seed); default: the clock.
        #[arg(long, env = "GCS_SEED")]
        seed: Option<u64>,
        /// The gcs-node binary.
        #[arg(long, env = "GCS_NODE_BIN")]
        gcs_node: Option<PathBuf>,
        /// Keep node data directories and logs here (default: a temporary directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Where the JSON report goes.
        #[arg(long, default_value = "netsim-series.json")]
        report: PathBuf,
    },
    /// Discrete-event simulation of claims and failure detection at 10/100/1000 nodes.
    Scale {
        /// Seed; the same seed gives the same table.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Worker counts.
        #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
        nodes: Vec<usize>,
        /// Jobs per second.
        #[arg(long, default_value_t = 5.0)]
        rate: f64,
        /// Seconds of arrivals.
        #[arg(long, default_value_t = 40)]
        duration_s: u64,
        /// Concurrent jobs per worker.
        #[arg(long, default_value_t = 4)]
        slots: u32,
        /// Mean job duration in ms.
        #[arg(long, default_value_t = 3000.0)]
        service_ms: f64,
        /// Loss probability of a gossip transmission or claim exchange.
        #[arg(long, default_value_t = 0.01)]
        loss: f64,
        /// Fraction of busy workers killed halfway.
        #[arg(long, default_value_t = 0.01)]
        kill: f64,
        /// Also write the rows as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// A misbehaving peer: joins over libp2p and injects forged, replayed,
    /// duplicated and reordered messages (scenarios start it as a node with
    /// `role = "adversary"`). Runs until killed; counts go to
    /// <data-dir>/adversary.json.
    Adversary {
        /// Identity, keyspace and the report.
        #[arg(long)]
        data_dir: PathBuf,
        /// libp2p listen address.
        #[arg(long, default_value = "/ip4/127.0.0.1/tcp/0")]
        listen: String,
        /// Peers to dial.
        #[arg(long)]
        bootstrap: Vec<String>,
        /// Which attacks: forged and disorderly messages (`wire`), or
        /// catalogue poisoning and a fake gateway's flood (`trust`).
        #[arg(long, value_enum, default_value = "wire")]
        attacks: adversary::Attacks,
        /// Messages a second of `--attacks flood`.
        #[arg(long, default_value_t = 30)]
        flood_rate: u32,
    },
    /// Closed-loop streaming load through one gateway.
    Load {
        /// Concurrent clients.
        #[arg(long, default_value_t = 4)]
        clients: u32,
        /// Seconds of traffic.
        #[arg(long, default_value_t = 30)]
        duration_s: u64,
        /// Worker processes.
        #[arg(long, default_value_t = 1)]
        workers: u32,
        /// max_tokens per request.
        #[arg(long, default_value_t = 32)]
        max_tokens: u32,
        /// --max-jobs per worker.
        #[arg(long, default_value_t = 16)]
        max_jobs: u32,
        /// The gcs-node binary.
        #[arg(long, env = "GCS_NODE_BIN")]
        gcs_node: Option<PathBuf>,
    },
}

fn workdir(path: Option<PathBuf>) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    Ok(match path {
        Some(p) => {
            std::fs::create_dir_all(&p)?;
            (p, None)
        }
        None => {
            let t = tempfile::Builder::new().prefix("netsim-").tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("netsim: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<bool> {
    match cli.command {
        Command::Run { scenarios, gcs_node, report: out, workdir: wd, soak_secs } => {
            let bin = cluster::locate_gcs_node(gcs_node.as_deref())?;
            if !cluster::models_present() {
                println!("SKIP: no models in {}", cluster::model_dir().display());
                return Ok(true);
            }
            let (root, _tmp) = workdir(wd)?;
            let mut outcomes = vec![];
            for path in &scenarios {
                if soak::SoakSpec::is_soak(path) {
                    let s = soak::SoakSpec::load(path)?;
                    let secs = soak_secs.unwrap_or(s.duration_s);
                    let t = std::time::Instant::now();
                    let r = soak::run(&s, secs, &bin, &root.join(&s.name))
                        .with_context(|| format!("soak {}", s.name))?;
                    println!("{}", r.summary());
                    let o = r.outcome(&s, t.elapsed().as_secs_f64());
                    print!("{}", report::table(&o));
                    outcomes.push(o);
                    continue;
                }
                let s = Scenario::load(path)?;
                let dir = root.join(&s.name);
                let o =
                    runner::run(&s, &bin, &dir).with_context(|| format!("scenario {}", s.name))?;
                print!("{}", report::table(&o));
                outcomes.push(o);
            }
            report::write_json(&out, &outcomes)?;
            let ok = outcomes.iter().all(runner::Outcome::ok);
            let skipped = outcomes.iter().filter(|o| o.skipped.is_some()).count();
            let note = if skipped > 0 { format!(" ({skipped} SKIPPED)") } else { String::new() };
            let verdict = match (ok, skipped == outcomes.len()) {
                (true, true) => "SKIPPED",
                (true, false) => "PASS",
                (false, _) => "FAIL",
            };
            println!("{verdict}{note} — report in {}", out.display());
            Ok(ok)
        }
        Command::Series { scenario, greedy, seeded, seed, gcs_node, workdir: wd, report: out } => {
            let bin = cluster::locate_gcs_node(gcs_node.as_deref())?;
            if !cluster::models_present() {
                println!("SKIP: no models in {}", cluster::model_dir().display());
                return Ok(true);
            }
            let s = Scenario::load(&scenario)?;
            let spec = s.series.clone().context("the scenario has no [series]")?;
            let seed = seed.unwrap_or_else(|| {
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                t.map(|d| d.as_nanos() as u64).unwrap_or_default()
            });
            let plan = series::Plan {
                greedy: greedy.unwrap_or(spec.greedy),
                seeded: seeded.unwrap_or(spec.seeded),
                seed,
            };
            println!("series {}: {} greedy + {} seeded, GCS_SEED={seed}", s.name, plan.greedy, plan.seeded);
            let (root, _tmp) = workdir(wd)?;
            let o = series::run(&s, &plan, &bin, &root.join(&s.name))
                .with_context(|| format!("series {}", s.name))?;
            print!("{}", series::summary(&o));
            std::fs::write(&out, serde_json::to_string_pretty(&o)?)?;
            Ok(o.ok() && o.streams.len() == (plan.greedy + plan.seeded) as usize || o.skipped.is_some())
        }
        Command::Scale { seed, nodes, rate, duration_s, slots, service_ms, loss, kill, json } => {
            let spec = scale::ScaleSpec {
                seed,
                rate_per_s: rate,
                duration_s,
                slots,
                service_ms,
                loss,
                kill_fraction: kill,
            };
            let mut rows = vec![];
            for n in nodes {
                let t = std::time::Instant::now();
                rows.push(scale::simulate(n, &spec));
                eprintln!("{n} nodes simulated in {:.1}s", t.elapsed().as_secs_f64());
            }
            print!("{}", scale::table(&spec, &rows));
            if let Some(p) = json {
                std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
            }
            Ok(true)
        }
        Command::Adversary { data_dir, listen, bootstrap, attacks, flood_rate } => {
            adversary::run(adversary::Args { data_dir, listen, bootstrap, attacks, flood_rate })?;
            Ok(true)
        }
        Command::Load { clients, duration_s, workers, max_tokens, max_jobs, gcs_node } => {
            let bin = cluster::locate_gcs_node(gcs_node.as_deref())?;
            let (root, _tmp) = workdir(None)?;
            let spec = load::LoadSpec { clients, duration_s, workers, max_tokens, max_jobs };
            let r = load::run(&spec, &bin, &root)?;
            println!(
                "{} clients, {} workers, {:.0}s: {} requests, {} complete, TTFT p50 {} ms p99 {} ms, \
                 {:.1} tokens/s, gateway peak RSS {:.0} MiB, worker peak RSS {:.0} MiB",
                clients, workers, r.seconds, r.requests, r.completed, r.ttft_p50_ms, r.ttft_p99_ms,
                r.tokens_per_s, r.gateway_peak_rss_mib, r.worker_peak_rss_mib
            );
            for (k, n) in &r.errors {
                println!("  error {k}: {n}");
            }
            Ok(r.errors.is_empty())
        }
    }
}
