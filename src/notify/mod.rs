//! Notification packs: from a scope folder (what `scope --out` wrote) to
//! what a compliance team sends. One folder per affected customer, on both
//! sides (recipients: their responses carried another customer's data;
//! sources: their data appeared in another customer's response), each with
//! a letter (letter.md), the processor-to-controller notice
//! (processor-notice.md, GDPR Art. 33(2)) and notice.json (the Art. 33(3)
//! content, machine-readable); plus one breach-register entry for the whole
//! incident (register.csv, register.json, and register.md from its template) and evidence.json.
//!
//! Cross-tenant prefix-cache hits (`cross_tenant_shared`) are notified on
//! both sides (the reader served from another customer's cached prefix,
//! the source whose cached prefix served it) only where the deployment
//! promised per-tenant prefix caches (`prefix_cache_scope = "tenant"`):
//! a prefix-cache isolation breach, never worded as a disclosure of
//! content. Otherwise the register counts them and nobody is notified.
//! Packs and registers of traces without hits are byte-identical to
//! what they were before.
//!
//! Isolation invariant: a customer's folder holds only that customer's
//! identifiers (request ids, external ids, output hashes) and tenant name.
//! Other customers appear only as counts, never by name or id. The folder
//! name is derived from the customer's own name.
//!
//! The scope folder is read through `report::folder::ScopeFolder`, checked
//! against its evidence.json (a modified scope folder is refused), and every
//! notice cites that evidence digest. Pure function of the scope folder and the config: the
//! same inputs give the same bytes.

//!
//! Files: `customers.rs` is the pure step (scope report -> one pack per
//! customer, no IO), `notice.rs` the data written (notice.json, the
//! register entry), `letter.rs` the sentences and template contexts,
//! `templates.rs` the letter templates, `config.rs` the operator's config;
//! here, `notify` reads the folder, renders every document into memory,
//! then writes them.

pub mod config;
mod customers;
mod letter;
mod notice;
pub mod templates;

use std::path::{Path, PathBuf};

pub use config::NotifyConfig;
pub use customers::{Customers, folder_names};
pub use notice::{
    Contact, EvidenceRef, ExposedRequest, IncidentTotals, Notice, Pack, PrefixCacheRevealed,
    PrefixCacheServed, ReceivedResponse, Records, RegisterEntry, RegisterPrefixCache, Window,
};
pub use templates::{Lang, Templates};

use crate::custody;
use crate::error::Result;
use crate::report::folder::ScopeFolder;
use crate::scope::ScopeReport;

/// Result of `notify`.
#[derive(Debug, Clone)]
pub struct NotifyOutcome {
    pub files: Vec<PathBuf>,
    pub packs: Vec<String>,
    pub evidence_digest: String,
    pub unfilled: Vec<&'static str>,
}

/// Builds every pack and writes the output folder. `command` is the command
/// line as given; `config_path` the config file, if any (hashed as an input);
/// `templates` lay out the letters (`Templates::load`).
/// The output folder must be new or empty, outside the scope folder; with
/// `force`, an earlier notify output of the same scope folder is replaced
/// (`custody::prepare_out`).
pub fn notify(
    scope_dir: &Path,
    out: &Path,
    cfg: &NotifyConfig,
    config_path: Option<&Path>,
    command: &[String],
    force: bool,
    templates: &Templates,
) -> Result<NotifyOutcome> {
    // Without --force nothing is removed: the folder is checked here, before
    // any work. With --force an earlier output is replaced only once every
    // document has been rendered.
    if !force {
        custody::prepare_out(out, "notify", &[scope_dir], false)?;
    }
    let folder = ScopeFolder::open(scope_dir)?;
    // A shard's findings cover some pools only: refused before the check
    // of the folder, whatever state it is in.
    folder.refuse_shard("notify")?;
    // The whole scope folder matches its evidence.json, or nothing is written.
    let scope_inputs = folder.as_input()?;
    // A signed scope folder's statement must hold too (its signer is
    // checked by `verify --allowed-signers`): the packs cite it.
    let statement = match custody::statement::check_folder_statement(scope_dir, None)? {
        Some(r) if !r.ok => {
            return Err(crate::error::Error::invalid(
                crate::error::Location::file(&scope_dir.join(custody::statement::STATEMENT_FILE)),
                format!(
                    "the scope folder's signed statement does not hold: {}",
                    r.problems.join("; ")
                ),
                "run `kvtrail verify` on the scope folder; re-create it from the trace instead of editing it",
            ));
        }
        Some(_) => custody::statement::folder_statement(scope_dir)?.map(|d| d.sha256),
        None => None,
    };
    let sum = folder.summary();

    let mut customers = Customers::of(sum);
    // Source requests' own arrival time and output hash from the index.
    if customers.wants() {
        folder.requests(|row| {
            customers.fill(&row);
            true
        })?;
    }
    let ev = EvidenceRef {
        scope_evidence_blake3: folder.evidence_blake3().to_string(),
        scope_summary_blake3: folder.summary_blake3().to_string(),
        tool: format!("kvtrail {}", env!("CARGO_PKG_VERSION")),
        evidence_complete: sum.coverage.complete,
        // Worded without file paths: a trace's file names may carry other
        // customers' names.
        coverage_notes: crate::scope::customer_notes(&sum.coverage),
        scope_statement_sha256: statement,
    };
    // Everything is rendered into memory first: a template that fails
    // leaves no output folder behind, half-written or emptied.
    let docs = documents(sum, customers, &ev, cfg, templates)?;

    if force {
        custody::prepare_out(out, "notify", &[scope_dir], force)?;
    }
    let mut files = write_documents(out, &docs.files)?;
    let mut inputs = vec![scope_inputs];
    if let Some(c) = config_path {
        inputs.push(custody::file_input(c, "config")?);
    }
    let digest = custody::write_evidence(out, "notify", command, inputs)?;
    files.push(out.join(custody::EVIDENCE_JSON));
    files.sort();
    Ok(NotifyOutcome {
        files,
        packs: docs.packs,
        evidence_digest: digest,
        unfilled: cfg.unfilled(),
    })
}

/// The output folder, rendered in memory.
#[derive(Debug, Clone)]
pub struct Documents {
    /// The packs' folders (`customers/<name>`), sorted by customer.
    pub packs: Vec<String>,
    /// Every document by path relative to the output folder: per customer
    /// notice.json, letter.md and processor-notice.md, then register.json,
    /// register.csv and register.md.
    pub files: Vec<(String, String)>,
}

/// Every document of the output folder, rendered in memory from the
/// customers' packs. No file is read or written.
pub fn documents(
    sum: &ScopeReport,
    customers: Customers,
    ev: &EvidenceRef,
    cfg: &NotifyConfig,
    templates: &Templates,
) -> Result<Documents> {
    let unattributed_responses = customers.unattributed_responses;
    let unattributed_sources = customers.unattributed_sources.len() as u64;
    let prefix_cache = customers.prefix_cache.clone();
    let packs = customers.into_packs()?;
    let ctx = letter::Ctx::new(cfg, sum, packs.len() as u64, templates.lang());
    let mut docs: Vec<(String, String)> = Vec::new();
    for p in &packs {
        let notice = ctx.notice(p, ev);
        let mut j = serde_json::to_string_pretty(&notice).expect("notice serializes");
        j.push('\n');
        let view = letter::template_context(&notice, templates.lang());
        let rows = notice.received_responses.len()
            + notice.exposed_requests.len()
            + notice.prefix_cache_served.len()
            + notice.prefix_cache_revealed.len();
        let letter_md = templates.render(templates::LETTER, &view, rows)?;
        let processor_md = templates.render(templates::PROCESSOR_NOTICE, &view, rows)?;
        docs.push((format!("{}/notice.json", p.folder), j));
        docs.push((format!("{}/letter.md", p.folder), letter_md));
        docs.push((format!("{}/processor-notice.md", p.folder), processor_md));
    }
    let folders: Vec<String> = packs.into_iter().map(|p| p.folder).collect();
    let reg = ctx.register(
        sum,
        ev,
        folders.clone(),
        unattributed_responses,
        unattributed_sources,
        prefix_cache,
    );
    let mut j = serde_json::to_string_pretty(&reg).expect("register serializes");
    j.push('\n');
    docs.push(("register.json".into(), j));
    docs.push(("register.csv".into(), letter::register_csv(&reg)));
    let rows = reg.notification_packs.len()
        + reg.measures_taken.len()
        + reg.likely_consequences.len()
        + reg.evidence.coverage_notes.len();
    let view = letter::register_context(&reg, templates.lang());
    docs.push((
        "register.md".into(),
        templates.render(templates::REGISTER, &view, rows)?,
    ));
    Ok(Documents {
        packs: folders,
        files: docs,
    })
}

/// Writes `docs` under `out` (private folders and files); the paths written.
fn write_documents(out: &Path, docs: &[(String, String)]) -> Result<Vec<PathBuf>> {
    custody::create_private_dir(out)?;
    let mut files = Vec::new();
    for (rel, text) in docs {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            custody::create_private_dir(d)?;
        }
        custody::write_private(&p, text)?;
        files.push(p);
    }
    Ok(files)
}
