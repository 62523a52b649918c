//! `gcs-node keys`: the gateway's API keys.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

/// `gcs-node keys …`.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Create a key and print it (once; only its hash is stored).
    Create {
        /// Tenant the key bills to.
        #[arg(long)]
        tenant: String,
        /// Project within the tenant.
        #[arg(long)]
        project: String,
        /// Models or aliases the key may use (default: all).
        #[arg(long, value_delimiter = ',')]
        models: Vec<String>,
        /// Routing modes the key may use: public, private, hybrid, local_only (default: all).
        #[arg(long, value_delimiter = ',')]
        routing: Vec<String>,
        /// Requests per minute.
        #[arg(long)]
        rpm: Option<u32>,
        /// Tokens per minute.
        #[arg(long)]
        tpm: Option<u64>,
        /// Lifetime token budget.
        #[arg(long)]
        budget_tokens: Option<u64>,
        /// Expire the key after this many days.
        #[arg(long)]
        ttl_days: Option<u64>,
        /// This key's first-token timeout in ms (default: the gateway's).
        #[arg(long)]
        first_token_timeout_ms: Option<u64>,
        /// This key's idle-stream timeout in ms.
        #[arg(long)]
        idle_timeout_ms: Option<u64>,
        /// This key's wall-clock timeout in ms.
        #[arg(long)]
        wall_timeout_ms: Option<u64>,
    },
    /// List keys (ids, prefixes, scopes; never the keys themselves).
    List {
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id (`key_...`) or by its printed prefix.
    Revoke {
        /// Key id or prefix.
        id: String,
    },
}

/// Runs a `keys` subcommand on the key store of `data_dir`.
pub fn keys(data_dir: PathBuf, action: KeysCommand) -> anyhow::Result<()> {
    let store = gcs_gateway::KeyStore::new(&data_dir);
    let now = gcs_node::now_ms();
    match action {
        KeysCommand::Create {
            tenant,
            project,
            models,
            routing,
            rpm,
            tpm,
            budget_tokens,
            ttl_days,
            first_token_timeout_ms,
            idle_timeout_ms,
            wall_timeout_ms,
        } => {
            let routing = routing
                .iter()
                .map(|r| {
                    gcs_protocol::RoutingMode::ALL
                        .iter()
                        .copied()
                        .find(|m| m.as_str() == r)
                        .with_context(|| format!("unknown routing mode {r:?}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let new = gcs_gateway::NewKey {
                tenant_id: tenant,
                project_id: project,
                models,
                routing,
                rpm,
                tpm,
                budget_tokens,
                ttl_ms: ttl_days.map(|d| d * 86_400_000),
                first_token_timeout_ms,
                idle_timeout_ms,
                wall_timeout_ms,
            };
            let (secret, rec) = store.create(new, now)?;
            match gcs_node::tenants::cli::ensure_tenant_key(&data_dir, &rec.tenant_id) {
                Ok(Some(id)) => eprintln!("created tenant {}'s membership key {id} (tenants/; copy it to the tenant's other gateways)", rec.tenant_id),
                Ok(None) => {}
                Err(e) => eprintln!("warning: no membership key for tenant {}: {e}", rec.tenant_id),
            }
            eprintln!(
                "created {} for tenant {} project {} (the key is shown only once)",
                rec.id, rec.tenant_id, rec.project_id
            );
            println!("{secret}");
        }
        KeysCommand::List { json } => {
            for k in store.list()? {
                if json {
                    println!("{}", serde_json::to_string(&k)?);
                } else {
                    let state = if k.revoked_at_ms.is_some() {
                        "revoked"
                    } else if !k.is_live(now) {
                        "expired"
                    } else {
                        "active"
                    };
                    println!(
                        "{}  {}...  {}/{}  {}  models={}  rpm={}  tpm={}  budget={}",
                        k.id,
                        k.prefix,
                        k.tenant_id,
                        k.project_id,
                        state,
                        if k.models.is_empty() { "*".into() } else { k.models.join(",") },
                        k.rpm.map_or("-".into(), |v| v.to_string()),
                        k.tpm.map_or("-".into(), |v| v.to_string()),
                        k.budget_tokens.map_or("-".into(), |v| v.to_string()),
                    );
                }
            }
        }
        KeysCommand::Revoke { id } => {
            let k = store.revoke(&id, now)?;
            eprintln!("revoked {} ({}...)", k.id, k.prefix);
        }
    }
    Ok(())
}

/// The tenants that have keys on this gateway, sorted.
pub fn tenants_of(store: &gcs_gateway::KeyStore) -> anyhow::Result<Vec<String>> {
    let mut t: Vec<String> = store.list()?.into_iter().map(|k| k.tenant_id).collect();
    t.sort();
    t.dedup();
    Ok(t)
}

/// `--role all` on its first start: a local key, shown once.
pub fn first_local_key(store: &gcs_gateway::KeyStore) -> anyhow::Result<()> {
    if !store.list()?.is_empty() {
        return Ok(());
    }
    let new = gcs_gateway::NewKey {
        tenant_id: "local".into(),
        project_id: "default".into(),
        ..Default::default()
    };
    let (secret, rec) = store.create(new, gcs_node::now_ms())?;
    println!(
        "Created a local API key ({}; shown only this once, stored as a hash in {}):",
        rec.id,
        store.path().display()
    );
    println!("  {secret}");
    Ok(())
}

