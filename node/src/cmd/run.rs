//! `gcs-node` with no subcommand: start the node (worker engine, gateway
//! HTTP edge, tenant trust) and run until a signal.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use gcs_node::{NodeConfig, Role};

use super::args::RunArgs;
use super::keys::{first_local_key, tenants_of};
use super::models::model_dir;

/// The node's settings from the command line.
fn node_config(data_dir: &Path, cli: &RunArgs) -> anyhow::Result<NodeConfig> {
    for (flag, v) in
        [("--swarm", Some(&cli.swarm)), ("--private-tenant", cli.private_tenant.as_ref())]
    {
        if let Some(v) = v.filter(|v| !gcs_node::topics::valid_tenant(v)) {
            bail!("{flag} {v:?}: use 1-128 printable ASCII characters without '/' or spaces");
        }
    }
    let mut config = NodeConfig::new(cli.role, data_dir.to_path_buf());
    config.max_concurrent_jobs =
        cli.max_jobs.unwrap_or(gcs_node::jobs::engine_exec::DEFAULT_MAX_JOBS).max(1);
    config.tracker = gcs_node::lifecycle::tracker::TrackerConfig {
        sit_out_ms: cli.sit_out_ms,
        ..gcs_node::lifecycle::tracker::TrackerConfig::with_lease_term(cli.lease_ms)
    };
    config.max_processing_jobs = cli.max_processing_jobs;
    config.processing_lease_ms = cli.processing_lease_ms;
    config.network.tenant_trust = gcs_node::tenants::TenantTrust::new(trusted_tenants(&cli.trust_tenant)?);
    config.network.listen = if cli.listen.is_empty() {
        let port = if cli.role == Role::Worker { 0 } else { 4001 };
        vec![
            format!("/ip4/0.0.0.0/tcp/{port}").parse()?,
            format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?,
        ]
    } else {
        cli.listen.clone()
    };
    config.network.bootstrap = cli.bootstrap.clone();
    config.swarm_id = cli.swarm.clone();
    config.memberships = gcs_node::tenants::cli::load_memberships(data_dir, &cli.membership)?;
    let groups = gcs_node::tenants::cli::worker_groups(
        &config.memberships,
        cli.private_tenant.as_deref(),
        &cli.swarm,
        &cli.gateway_local,
        gcs_node::now_ms(),
    );
    for w in groups.warnings.iter().filter(|_| cli.role.is_worker()) {
        tracing::warn!("{w}");
    }
    if cli.private_only && groups.private_tenant.is_none() {
        bail!("--private-only needs --private-tenant or a tenant_member certificate");
    }
    config.private_tenant = groups.private_tenant;
    config.private_only = cli.private_only;
    config.gateway_local = groups.gateway_local;
    config.gateway_share = gcs_node::lifecycle::worker_job::Share { percent: cli.gateway_share };
    config.gateways = (!cli.gateways.is_empty()).then(|| cli.gateways.iter().cloned().collect());
    config.network.mdns = !cli.no_mdns;
    config.network.quota.max_bytes = cli.peer_quota_bytes;
    config.network.quota.max_keys = cli.peer_quota_keys;
    config.network.connections.established = cli.max_peer_connections;
    config.heartbeat_interval = Duration::from_millis(cli.heartbeat_ms.max(100));
    config.registration_ttl =
        Duration::from_millis(cli.registration_ttl_ms.max(cli.heartbeat_ms + 100));
    Ok(config)
}

/// A worker's models, and the engines loaded with them: catalogue models
/// from the cache, files by path; a file the engine cannot serve (its
/// architecture, a tensor type) stops the worker with the engine's reason.
async fn load_engine(config: &mut NodeConfig, cli: &RunArgs) -> anyhow::Result<()> {
    use gcs_engine::backend::{ensure_servable, ComputeDevice};
    let device = ComputeDevice::from_gpu_flag(cli.gpu);
    // Before any model loads: burn-cuda panics without a driver, so the
    // engine probes it first and says what is missing.
    let gpu = ensure_servable(device).with_context(|| format!("--gpu {}", cli.gpu.unwrap_or(0)))?;
    if let Some(g) = &gpu {
        tracing::info!(gpu = %g.name, backend = g.kind.name(), memory_mib = g.memory_bytes >> 20, "serving on a GPU");
    }
    let dir = model_dir();
    let wanted = gcs_node::models::wanted(&dir, &cli.models, &cli.model_ids)?;
    if wanted.is_empty() {
        tracing::warn!(dir = %dir.display(), "no models in the cache (run scripts/fetch-models.sh); this worker will claim nothing");
        return Ok(());
    }
    let serving = gcs_node::jobs::engine_exec::Serving {
        max_context: cli.ctx,
        kv_bytes: cli.kv_cache_mb.map(|mb| mb << 20),
        max_running: cli.max_jobs,
        device,
        gpu,
    };
    let (models, exec) = tokio::task::spawn_blocking(move || {
        gcs_node::jobs::engine_exec::EngineExecutor::serve(&dir, &wanted, &serving)
    })
    .await?
    .context("cannot load the worker's models")?;
    // On a GPU without --max-jobs: what its K/V capacity holds.
    config.max_concurrent_jobs = exec.max_running();
    tracing::info!(models = ?models.iter().map(|m| &m.model_id).collect::<Vec<_>>(), "worker models loaded");
    config.models = models;
    config.executor = Some(std::sync::Arc::new(exec));
    Ok(())
}

/// The HTTP listener (and TLS), bound before the node starts, so a port in
/// use is a clear error and not a half-started node.
async fn bind_http(
    cli: &RunArgs,
) -> anyhow::Result<(tokio::net::TcpListener, Option<gcs_gateway::serve::TlsAcceptor>)> {
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => Some(gcs_gateway::serve::acceptor(&gcs_gateway::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
        })?),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(cli.http)
        .await
        .with_context(|| format!("cannot listen for HTTP on {}", cli.http))?;
    Ok((listener, tls))
}

/// Keys created for a new tenant while the gateway runs: it starts keeping
/// that tenant's usage records too.
fn follow_tenants(net: gcs_node::Network, mut served: Vec<String>, data_dir: &Path) {
    let store = gcs_gateway::KeyStore::new(data_dir);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(2));
        loop {
            every.tick().await;
            match tenants_of(&store) {
                Ok(t) if t != served => match net.serve_tenants(t.clone()).await {
                    Ok(()) => served = t,
                    Err(e) => tracing::warn!(error = %e, "cannot update served tenants"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read API keys"),
            }
        }
    });
}

/// The gateway's model policy: an operator's allow-list, or the build's
/// catalogue trusted for its own models.
fn model_policy(cli: &RunArgs) -> gcs_gateway::catalog::ModelPolicy {
    use gcs_gateway::catalog::{ModelPolicy, Trusted};
    if !cli.models_allow.is_empty() {
        return ModelPolicy { trusted: cli.models_allow.clone(), only_trusted: true };
    }
    let trusted = gcs_node::models::CATALOG.iter().map(|e| Trusted::from_info(&e.info())).collect();
    ModelPolicy { trusted, only_trusted: false }
}

fn gateway_config(cli: &RunArgs) -> gcs_gateway::GatewayConfig {
    gcs_gateway::GatewayConfig {
        models: model_policy(cli),
        stream_buffer_bytes: cli.stream_buffer_bytes,
        keepalive: Duration::from_millis(cli.keepalive_ms.max(100)),
        first_token_timeout_ms: cli.first_token_timeout_ms,
        idle_timeout_ms: cli.idle_timeout_ms,
        wall_timeout_ms: cli.wall_timeout_ms,
        max_in_flight: cli.max_in_flight.max(1),
        max_jobs_per_request: cli.max_jobs_per_request.max(1),
        batch_price_percent: cli.batch_price_percent.clamp(1, 100),
        stream_hold: Duration::from_millis(cli.stream_hold_ms),
        swarm_id: cli.swarm.clone(),
        edge: gcs_gateway::serve::EdgeLimits {
            body_read_timeout: Duration::from_millis(cli.body_read_timeout_ms.max(100)),
            max_connections_per_ip: cli.max_connections_per_ip.max(1),
            unauthenticated_per_ip_per_minute: cli.unauthenticated_per_ip_per_minute.max(1),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// `--trust-tenant TENANT=ISSUER` pairs: the tenants whose gateways'
/// processing tasks a worker takes (a gateway loads its own tenant store).
fn trusted_tenants(pairs: &[String]) -> anyhow::Result<gcs_node::tenants::Trust> {
    let mut t = gcs_node::tenants::Trust::default();
    for p in pairs {
        let Some((tenant, issuer)) = p.split_once('=') else {
            bail!("--trust-tenant {p:?}: use TENANT=ISSUER");
        };
        let issuer: gcs_protocol::NodeId = issuer
            .parse()
            .map_err(|e| anyhow::anyhow!("--trust-tenant {p:?}: {e}"))?;
        t.tenants.insert(tenant.to_string(), issuer);
    }
    Ok(t)
}

/// Runs the node until SIGINT or SIGTERM, then shuts it down.
pub async fn run(data_dir: PathBuf, cli: RunArgs) -> anyhow::Result<()> {
    let mut config = node_config(&data_dir, &cli)?;
    if cli.role.is_worker() {
        load_engine(&mut config, &cli).await?;
    }
    let is_gateway = cli.role != Role::Worker;
    let http = if is_gateway { Some(bind_http(&cli).await?) } else { None };
    let store = gcs_gateway::KeyStore::new(&data_dir);
    if is_gateway {
        if cli.role == Role::All {
            first_local_key(&store)?;
        }
        // This gateway's tenants: their usage records replicate among the
        // gateways that serve them.
        config.network.served_tenants = tenants_of(&store)?;
    }
    if is_gateway {
        // The tenant and swarm keys this gateway holds: the only issuers of
        // certificates it accepts in claims and usage records.
        let mut trust = gcs_node::tenants::TenantStore::new(&data_dir).trust()?;
        trust.key_tenants = gcs_node::tenants::cli::key_tenants(&store)?;
        config.network.tenant_trust = gcs_node::tenants::TenantTrust::new(trust);
    }
    let trust = config.network.tenant_trust.clone();
    let served = config.network.served_tenants.clone();
    let node = gcs_node::start(config).await?;
    if is_gateway {
        let keys = gcs_gateway::KeyStore::new(&data_dir);
        gcs_node::tenants::follow(&data_dir, node.shared_keyspace(), node.network().clone(), trust, move || {
            gcs_node::tenants::cli::key_tenants(&keys).unwrap_or_default()
        });
    }
    for a in node.listen_addrs().await? {
        tracing::info!(addr = %a, "dial this node with --bootstrap");
    }
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = match http {
        Some((listener, tls)) => {
            follow_tenants(node.network().clone(), served, &data_dir);
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut gw = gateway_config(&cli);
            gw.gateway_id = node.node_id.to_string();
            let edge = gw.edge.clone();
            let app = gcs_gateway::router(
                std::sync::Arc::new(node.client()),
                std::sync::Arc::new(store),
                gw,
            );
            println!("OpenAI-compatible API: {scheme}://{}/v1  (keys: gcs-node keys create --data-dir {} --tenant T --project P)", listener.local_addr()?, data_dir.display());
            tracing::info!(addr = %listener.local_addr()?, scheme, "HTTP API listening");
            Some(tokio::spawn(gcs_gateway::serve::serve_with(listener, app, tls, edge, async move {
                let _ = http_stopped.await;
            })))
        }
        None => None,
    };
    wait_for_signal().await?;
    tracing::info!("shutting down");
    let _ = stop_http.send(());
    if let Some(s) = server {
        let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
    }
    node.shutdown().await;
    Ok(())
}

