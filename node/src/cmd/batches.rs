//! `gcs-node batches`: the gateway's OpenAI batches, read from its data
//! directory (specs/batch.md, "Storage"); the running gateway writes each
//! record's `request_counts` every 500 ms, so a list shows live progress.

use std::path::Path;

use anyhow::Context;
use clap::Subcommand;
use gcs_gateway::batch::{BatchRecord, BatchStore};

/// `gcs-node batches …`.
#[derive(Subcommand, Debug)]
pub enum BatchesCommand {
    /// Every batch (newest first): id, status, endpoint, request counts and
    /// a progress bar.
    List {
        /// Only this tenant's batches.
        #[arg(long)]
        tenant: Option<String>,
        /// The batch objects as JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One batch in full (the OpenAI batch object as JSON).
    Show {
        /// The batch id (`batch_…`).
        id: String,
    },
}

/// Width of the progress bar in characters.
const BAR: u64 = 10;

/// `[#####-----] 512/1000`: finished (completed + failed) of total.
pub fn progress(done: u64, total: u64) -> String {
    let filled = (done.min(total) * BAR).checked_div(total).unwrap_or(0);
    let bar: String = (0..BAR).map(|i| if i < filled { '#' } else { '-' }).collect();
    format!("[{bar}] {done}/{total}")
}

fn line(r: &BatchRecord) -> String {
    format!(
        "{}  {:<11} {:<20} {}  completed={} failed={}  tenant={}",
        r.id,
        r.status.as_str(),
        r.endpoint,
        progress(r.completed + r.failed, r.total),
        r.completed,
        r.failed,
        r.tenant_id
    )
}

/// Runs a `batches` subcommand on the batch store of `data_dir`.
pub fn batches(data_dir: &Path, action: BatchesCommand) -> anyhow::Result<()> {
    let store = BatchStore::new(data_dir.join("batches"));
    let all = store.all().context("cannot read the batch store")?;
    match action {
        BatchesCommand::List { tenant, json } => {
            let mine = all.iter().filter(|r| tenant.as_ref().is_none_or(|t| &r.tenant_id == t));
            let mut n = 0;
            for r in mine {
                n += 1;
                if json {
                    println!("{}", serde_json::to_string(&r.to_json())?);
                } else {
                    println!("{}", line(r));
                }
            }
            if n == 0 && !json {
                eprintln!("no batches in {}", data_dir.join("batches").display());
            }
        }
        BatchesCommand::Show { id } => {
            let r = all.iter().find(|r| r.id == id).with_context(|| format!("no batch {id}"))?;
            println!("{}", line(r));
            println!("{}", serde_json::to_string_pretty(&r.to_json())?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::progress;

    #[test]
    fn the_bar_fills_with_finished_requests() {
        assert_eq!(progress(512, 1000), "[#####-----] 512/1000");
        assert_eq!(progress(0, 0), "[----------] 0/0");
        assert_eq!(progress(1000, 1000), "[##########] 1000/1000");
        assert_eq!(progress(7, 5), "[##########] 7/5", "never more than full");
    }
}
