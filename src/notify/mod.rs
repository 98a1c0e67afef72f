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

pub mod config;
mod letter;
pub mod templates;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use config::NotifyConfig;
pub use templates::{Lang, Templates};

use crate::custody;
use crate::error::{Error, Result};
use crate::report::csv;
use crate::report::fmt::utc;
use crate::report::folder::ScopeFolder;
use crate::schema::ENGINE_REQUEST;
use crate::scope::Crossing;

/// One of the customer's responses that carried data not its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReceivedResponse {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub arrival_ns: Option<i64>,
    pub arrival_utc: Option<String>,
    pub finish_ns: Option<i64>,
    pub http_status: Option<u16>,
    pub prompt_tokens: Option<u32>,
    pub prefilled_tokens: Option<u32>,
    pub output_hash: Option<String>,
    /// KV slots read that held other requests' data.
    pub foreign_tokens: u64,
    /// foreign + of unknown origin + uncertain after lost events.
    pub exposed_tokens: u64,
    /// Whether any of that data belonged to another customer: `null` when
    /// it cannot be told (a source's customer is not known), never a guess.
    pub other_customer_data: Option<bool>,
    pub confidence: String,
    pub first_exposure_ns: i64,
    pub last_exposure_ns: i64,
}

/// One of the customer's requests whose KV was read by other responses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExposedRequest {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub arrival_ns: Option<i64>,
    pub arrival_utc: Option<String>,
    pub output_hash: Option<String>,
    /// Sum over the reading responses of distinct KV slots read.
    pub tokens: u64,
    /// Responses that read this request's KV.
    pub responses: u64,
    /// Whether any of them went to another customer: `null` when it
    /// cannot be told (a reader's customer is not known and none is
    /// certainly another customer), never a guess.
    pub reached_other_customers: Option<bool>,
    pub confidence: String,
    pub first_exposure_ns: i64,
    pub last_exposure_ns: i64,
}

/// One of the customer's requests served from a prompt prefix another
/// customer's request had cached (a cross-tenant prefix-cache hit under
/// `prefix_cache_scope = "tenant"`). No other customer's data entered the
/// response; the other customer is counted, never named.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCacheServed {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub arrival_ns: Option<i64>,
    pub arrival_utc: Option<String>,
    pub output_hash: Option<String>,
    /// KV tokens served from other customers' cached prefixes.
    pub tokens: u64,
    /// Other customers' requests whose cached prefix served it (a count).
    pub source_requests: u64,
    pub confidence: String,
}

/// One of the customer's requests whose cached prompt prefix served other
/// customers' requests (a cross-tenant prefix-cache hit under
/// `prefix_cache_scope = "tenant"`). Its prompt content was not disclosed;
/// the readers are counted, never named.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCacheRevealed {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub arrival_ns: Option<i64>,
    pub arrival_utc: Option<String>,
    pub output_hash: Option<String>,
    /// Sum over the reading responses of the tokens served.
    pub tokens: u64,
    /// Other customers' responses served from it (a count).
    pub responses: u64,
    pub confidence: String,
}

/// Time window of a notice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    pub first_ns: Option<i64>,
    pub last_ns: Option<i64>,
    pub first_utc: Option<String>,
    pub last_utc: Option<String>,
}

impl Window {
    fn new(first: Option<i64>, last: Option<i64>) -> Self {
        Window {
            first_ns: first,
            last_ns: last,
            first_utc: first.map(utc),
            last_utc: last.map(utc),
        }
    }
}

/// Approximate numbers of records concerned (Art. 33(3)(a)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Records {
    pub responses: u64,
    pub requests: u64,
    pub tokens: u64,
}

/// The operator and how to reach it (filled from the config).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Contact {
    pub operator_name: String,
    pub dpo_contact: String,
    pub contact_point: String,
}

/// Where the facts come from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvidenceRef {
    /// blake3 of the scope folder's evidence.json.
    pub scope_evidence_blake3: String,
    /// blake3 of the scope folder's summary.json.
    pub scope_summary_blake3: String,
    pub tool: String,
    pub evidence_complete: bool,
    pub coverage_notes: Vec<String>,
}

/// Incident-wide figures a customer may see (counts only).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IncidentTotals {
    pub service: String,
    pub affected_responses: u64,
    pub confirmed_responses: u64,
    pub possible_responses: u64,
    pub customers_notified: u64,
    /// Responses with a prefix-cache isolation breach (cross-tenant
    /// prefix-cache hits under `prefix_cache_scope = "tenant"`).
    #[serde(skip_serializing_if = "is_zero")]
    pub prefix_cache_breach_responses: u64,
    pub window: Window,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// notice.json: the Art. 33(3) content for one customer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notice {
    pub format: String,
    pub version: u32,
    pub incident_id: String,
    pub customer: String,
    /// recipient and/or source
    pub roles: Vec<String>,
    /// Art. 33(3)(a): nature of the breach.
    pub nature: String,
    /// Art. 33(3)(a): categories of data subjects and of records.
    pub data_subject_categories: Vec<String>,
    pub data_subjects_approximate: String,
    pub record_categories: Vec<String>,
    /// Art. 33(3)(a): approximate numbers of records.
    pub records: Records,
    pub time_window: Window,
    /// Art. 33(3)(c).
    pub likely_consequences: Vec<String>,
    /// Art. 33(3)(d).
    pub measures_taken: Vec<String>,
    /// Art. 33(3)(b).
    pub contact: Contact,
    pub became_aware: String,
    pub confirmed: u64,
    pub possible: u64,
    pub received_responses: Vec<ReceivedResponse>,
    pub exposed_requests: Vec<ExposedRequest>,
    /// Prefix-cache isolation breach, reading side (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefix_cache_served: Vec<PrefixCacheServed>,
    /// Prefix-cache isolation breach, cached side (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefix_cache_revealed: Vec<PrefixCacheRevealed>,
    pub incident: IncidentTotals,
    pub evidence: EvidenceRef,
    /// The human-readable versions next to this file.
    pub documents: Vec<String>,
}

/// register.json: one breach-register entry (Art. 33(5)) for the incident.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegisterEntry {
    pub format: String,
    pub version: u32,
    pub incident_id: String,
    pub operator_name: String,
    pub dpo_contact: String,
    pub became_aware: String,
    pub service: String,
    pub engine: String,
    pub nature: String,
    pub time_window: Window,
    pub affected_responses: u64,
    pub confirmed_responses: u64,
    pub possible_responses: u64,
    /// Responses that certainly carried another customer's data.
    pub cross_customer_responses: u64,
    /// Responses where it cannot be told (a customer on either side is
    /// not known); absent when 0.
    #[serde(skip_serializing_if = "is_zero")]
    pub cross_customer_unknown_responses: u64,
    pub source_requests: u64,
    pub foreign_tokens: u64,
    pub recipient_customers: u64,
    pub source_customers: u64,
    /// Affected responses or source requests whose customer is not known
    /// (missing from the requests table): nobody can be notified for them.
    pub unattributed_responses: u64,
    pub unattributed_source_requests: u64,
    pub notification_packs: Vec<String>,
    /// Cross-tenant prefix-cache hits (absent when there are none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<RegisterPrefixCache>,
    pub likely_consequences: Vec<String>,
    pub measures_taken: Vec<String>,
    pub evidence: EvidenceRef,
}

/// The register's figures on cross-tenant prefix-cache hits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegisterPrefixCache {
    /// `tenant` (the deployment promises a prefix cache per customer: each
    /// hit is a prefix-cache isolation breach and its customers are
    /// notified) or `global` (information only: nobody is notified for
    /// them).
    pub scope: String,
    pub isolation_breach: bool,
    /// Responses served from another customer's cached prefix.
    pub responses: u64,
    /// Distinct requests whose cached prefix served them.
    pub source_requests: u64,
    /// Sum over (response, source request) of the tokens served.
    pub tokens: u64,
    /// Distinct customers on the reading side and on the cached side.
    pub reader_customers: u64,
    pub source_customers: u64,
    /// Readers or source requests whose customer is not known.
    pub unattributed: u64,
}

/// One customer's pack before rendering.
#[derive(Debug, Clone, Default)]
struct Pack {
    tenant: String,
    folder: String,
    received: Vec<ReceivedResponse>,
    exposed: Vec<ExposedRequest>,
    served: Vec<PrefixCacheServed>,
    revealed: Vec<PrefixCacheRevealed>,
}

/// Result of `notify`.
#[derive(Debug, Clone)]
pub struct NotifyOutcome {
    pub files: Vec<PathBuf>,
    pub packs: Vec<String>,
    pub evidence_digest: String,
    pub unfilled: Vec<&'static str>,
}

/// Whether Windows (and so any share, archive or mail client a pack may
/// travel through) reserves a file name: CON, PRN, AUX, NUL, COM0-9 and
/// LPT0-9 (also with superscript digits), with or without an extension,
/// any case; and names that end in a dot or a space.
fn reserved_on_windows(name: &str) -> bool {
    let stem = name.split('.').next().unwrap_or("").to_ascii_uppercase();
    let stem = stem.trim_end_matches(' ');
    let device = matches!(stem, "CON" | "PRN" | "AUX" | "NUL")
        || ((stem.starts_with("COM") || stem.starts_with("LPT"))
            && stem.len() > 3
            && stem[3..]
                .chars()
                .all(|c| c.is_ascii_digit() || matches!(c, '¹' | '²' | '³'))
            && stem[3..].chars().count() == 1);
    device || name.ends_with(['.', ' '])
}

/// Folder names for tenants: the tenant's own name when it is a safe file
/// name (ASCII letters, digits, `-`, `_`, `.`; not starting with `.`; not a
/// name Windows reserves) and unique ignoring case; otherwise a sanitised
/// name plus hex digits of blake3(tenant) (8, more if that is taken).
/// Deterministic; unique ignoring case; never another tenant's name.
pub fn folder_names(tenants: &BTreeSet<String>) -> BTreeMap<String, String> {
    let safe = |t: &str| -> String {
        let s: String = t
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        s.trim_start_matches('.').to_string()
    };
    let mut by_lower: HashMap<String, usize> = HashMap::new();
    for t in tenants {
        *by_lower.entry(safe(t).to_ascii_lowercase()).or_default() += 1;
    }
    let clean = |t: &str| {
        let s = safe(t);
        !s.is_empty()
            && s == *t
            && !reserved_on_windows(&s)
            && by_lower[&s.to_ascii_lowercase()] == 1
    };
    // Clean names first, so a hashed name never takes one.
    let mut used: BTreeSet<String> = tenants
        .iter()
        .filter(|t| clean(t.as_str()))
        .map(|t| t.to_ascii_lowercase())
        .collect();
    tenants
        .iter()
        .map(|t| {
            if clean(t) {
                return (t.clone(), t.clone());
            }
            // Dots become `_` so no extension is left for Windows to read
            // a device name (`aux.txt`) from.
            let s = safe(t).replace('.', "_");
            let hx = blake3::hash(t.as_bytes()).to_hex();
            let mut name = String::new();
            for n in [8, 16, 32, 64] {
                name = if s.is_empty() {
                    format!("customer-{}", &hx[..n])
                } else {
                    format!("{s}-{}", &hx[..n])
                };
                if !used.contains(&name.to_ascii_lowercase()) {
                    break;
                }
            }
            used.insert(name.to_ascii_lowercase());
            (t.clone(), name)
        })
        .collect()
}

fn conf_min(a: &str, b: &str) -> String {
    if a == "confirmed" || b == "confirmed" {
        "confirmed".into()
    } else {
        "possible".into()
    }
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
    let evidence_digest = folder.evidence_blake3().to_string();
    let summary_digest = folder.summary_blake3().to_string();
    let sum = folder.summary();

    // Per-customer facts.
    let mut received: BTreeMap<String, Vec<ReceivedResponse>> = BTreeMap::new();
    // tenant -> request id -> accumulated exposure
    let mut exposed: BTreeMap<String, BTreeMap<u64, ExposedRequest>> = BTreeMap::new();
    let mut unattributed_responses = 0;
    let mut unattributed_sources = BTreeSet::new();
    for a in &sum.affected_responses {
        if let Some(t) = a.tenant.customer() {
            received
                .entry(t.to_string())
                .or_default()
                .push(ReceivedResponse {
                    request_id: a.request_id,
                    external_id: a.external_id.clone(),
                    arrival_ns: a.arrival_ns,
                    arrival_utc: a.arrival_ns.map(utc),
                    finish_ns: a.finish_ns,
                    http_status: a.http_status,
                    prompt_tokens: a.prompt_tokens,
                    prefilled_tokens: a.prefilled_tokens,
                    output_hash: a.output_hash.clone(),
                    foreign_tokens: a.foreign_tokens,
                    exposed_tokens: a.exposed_tokens,
                    other_customer_data: a.crossing().known(),
                    confidence: a.confidence.as_str().into(),
                    first_exposure_ns: a.first_read_ns,
                    last_exposure_ns: a.last_read_ns,
                });
        } else {
            unattributed_responses += 1;
        }
        for s in &a.sources {
            if s.request_id == ENGINE_REQUEST {
                continue;
            }
            let Some(t) = s.tenant.customer() else {
                unattributed_sources.insert(s.request_id);
                continue;
            };
            let e = exposed
                .entry(t.to_string())
                .or_default()
                .entry(s.request_id)
                .or_insert_with(|| ExposedRequest {
                    request_id: s.request_id,
                    external_id: s.external_id.clone(),
                    arrival_ns: None,
                    arrival_utc: None,
                    output_hash: None,
                    tokens: 0,
                    responses: 0,
                    reached_other_customers: Some(false),
                    confidence: s.confidence.as_str().into(),
                    first_exposure_ns: s.first_ts_ns,
                    last_exposure_ns: s.last_ts_ns,
                });
            e.tokens += s.tokens;
            e.responses += 1;
            e.reached_other_customers = Crossing::from_known(e.reached_other_customers)
                .max(s.crossing(&a.tenant))
                .known();
            e.confidence = conf_min(&e.confidence, s.confidence.as_str());
            e.first_exposure_ns = e.first_exposure_ns.min(s.first_ts_ns);
            e.last_exposure_ns = e.last_exposure_ns.max(s.last_ts_ns);
        }
    }
    // Cross-tenant prefix-cache hits: notified (both sides) only where the
    // deployment promised per-tenant prefix caches; counted in the register
    // either way.
    let breach = sum.deployment.tenant_prefix_cache();
    let mut served: BTreeMap<String, BTreeMap<u64, PrefixCacheServed>> = BTreeMap::new();
    let mut revealed: BTreeMap<String, BTreeMap<u64, PrefixCacheRevealed>> = BTreeMap::new();
    let reg_pc = (!sum.cross_tenant_shared.is_empty()).then(|| {
        let mut readers = BTreeSet::new();
        let mut sources = BTreeSet::new();
        let mut source_requests = BTreeSet::new();
        let mut unattributed = BTreeSet::new();
        let mut tokens = 0u64;
        for hit in &sum.cross_tenant_shared {
            match hit.tenant.customer() {
                Some(t) => {
                    readers.insert(t.to_string());
                }
                None => {
                    unattributed.insert(hit.request_id);
                }
            }
            for x in &hit.sources {
                source_requests.insert(x.request_id);
                tokens = tokens.saturating_add(x.tokens);
                match x.tenant.customer() {
                    Some(t) => {
                        sources.insert(t.to_string());
                    }
                    None => {
                        unattributed.insert(x.request_id);
                    }
                }
            }
        }
        RegisterPrefixCache {
            scope: if breach { "tenant" } else { "global" }.into(),
            isolation_breach: breach,
            responses: sum.cross_tenant_shared.len() as u64,
            source_requests: source_requests.len() as u64,
            tokens,
            reader_customers: readers.len() as u64,
            source_customers: sources.len() as u64,
            unattributed: unattributed.len() as u64,
        }
    });
    if breach {
        for hit in &sum.cross_tenant_shared {
            if let Some(t) = hit.tenant.customer() {
                served.entry(t.to_string()).or_default().insert(
                    hit.request_id,
                    PrefixCacheServed {
                        request_id: hit.request_id,
                        external_id: hit.external_id.clone(),
                        arrival_ns: None,
                        arrival_utc: None,
                        output_hash: None,
                        tokens: hit.tokens,
                        source_requests: hit.sources.len() as u64,
                        confidence: "confirmed".into(),
                    },
                );
            }
            for x in &hit.sources {
                if x.request_id == ENGINE_REQUEST {
                    continue;
                }
                let Some(t) = x.tenant.customer() else {
                    continue;
                };
                let e = revealed
                    .entry(t.to_string())
                    .or_default()
                    .entry(x.request_id)
                    .or_insert_with(|| PrefixCacheRevealed {
                        request_id: x.request_id,
                        external_id: None,
                        arrival_ns: None,
                        arrival_utc: None,
                        output_hash: None,
                        tokens: 0,
                        responses: 0,
                        confidence: "confirmed".into(),
                    });
                e.tokens = e.tokens.saturating_add(x.tokens);
                e.responses += 1;
            }
        }
    }
    // Source requests' own arrival time and output hash from the index.
    // (tenant, the tenant as requests.csv holds it: no NUL)
    let mut want: HashMap<u64, (String, String)> = HashMap::new();
    for (t, m) in &exposed {
        for id in m.keys() {
            let in_csv = csv::untext(&csv::text(t)).to_string();
            want.insert(*id, (t.clone(), in_csv));
        }
    }
    for (t, ids) in served
        .iter()
        .map(|(t, m)| (t, m.keys().copied().collect::<Vec<_>>()))
        .chain(
            revealed
                .iter()
                .map(|(t, m)| (t, m.keys().copied().collect::<Vec<_>>())),
        )
    {
        for id in ids {
            let in_csv = csv::untext(&csv::text(t)).to_string();
            want.insert(id, (t.clone(), in_csv));
        }
    }
    if !want.is_empty() {
        folder.requests(|row| {
            if let Some((t, in_csv)) = want.get(&row.request_id)
                && *in_csv == row.tenant
                && let Some(e) = exposed.get_mut(t).and_then(|m| m.get_mut(&row.request_id))
            {
                e.arrival_ns = Some(row.arrival_ns);
                e.arrival_utc = Some(utc(row.arrival_ns));
                e.output_hash = row.output_hash.clone();
            }
            if let Some((t, in_csv)) = want.get(&row.request_id)
                && *in_csv == row.tenant
            {
                if let Some(e) = served.get_mut(t).and_then(|m| m.get_mut(&row.request_id)) {
                    e.arrival_ns = Some(row.arrival_ns);
                    e.arrival_utc = Some(utc(row.arrival_ns));
                    e.output_hash = row.output_hash.clone();
                    if e.external_id.is_none() {
                        e.external_id = row.external_id.clone();
                    }
                }
                if let Some(e) = revealed.get_mut(t).and_then(|m| m.get_mut(&row.request_id)) {
                    e.arrival_ns = Some(row.arrival_ns);
                    e.arrival_utc = Some(utc(row.arrival_ns));
                    e.output_hash = row.output_hash.clone();
                    e.external_id = row.external_id.clone();
                }
            }
            true
        })?;
    }

    let tenants: BTreeSet<String> = received
        .keys()
        .chain(exposed.keys())
        .chain(served.keys())
        .chain(revealed.keys())
        .cloned()
        .collect();
    let folders = folder_names(&tenants);
    // One folder per customer, whatever `folder_names` returns: a pack is
    // never written over another customer's.
    let mut taken = BTreeSet::new();
    if let Some(f) = folders
        .values()
        .find(|f| !taken.insert(f.to_ascii_lowercase()))
    {
        return Err(Error::Other(format!(
            "notify: two customers would share the pack folder customers/{f}; nothing was written"
        )));
    }
    let packs: Vec<Pack> = tenants
        .iter()
        .map(|t| Pack {
            tenant: t.clone(),
            folder: format!("customers/{}", folders[t]),
            received: received.remove(t).unwrap_or_default(),
            exposed: exposed
                .remove(t)
                .map(|m| m.into_values().collect())
                .unwrap_or_default(),
            served: served
                .remove(t)
                .map(|m| m.into_values().collect())
                .unwrap_or_default(),
            revealed: revealed
                .remove(t)
                .map(|m| m.into_values().collect())
                .unwrap_or_default(),
        })
        .collect();

    let ev = EvidenceRef {
        scope_evidence_blake3: evidence_digest.clone(),
        scope_summary_blake3: summary_digest,
        tool: format!("kvtrail {}", env!("CARGO_PKG_VERSION")),
        evidence_complete: sum.coverage.complete,
        // Worded without file paths: a trace's file names may carry other
        // customers' names.
        coverage_notes: crate::scope::customer_notes(&sum.coverage),
    };
    let ctx = letter::Ctx::new(cfg, sum, packs.len() as u64, templates.lang());

    // Everything is rendered into memory first: a template that fails
    // leaves no output folder behind, half-written or emptied.
    let mut docs: Vec<(String, String)> = Vec::new();
    for p in &packs {
        let notice = ctx.notice(p, &ev);
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
    let reg = ctx.register(
        sum,
        &ev,
        packs.iter().map(|p| p.folder.clone()).collect(),
        unattributed_responses,
        unattributed_sources.len() as u64,
        reg_pc,
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

    if force {
        custody::prepare_out(out, "notify", &[scope_dir], force)?;
    }
    custody::create_private_dir(out)?;
    let mut files = Vec::new();
    for (rel, text) in &docs {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            custody::create_private_dir(d)?;
        }
        custody::write_private(&p, text)?;
        files.push(p);
    }

    let mut inputs = vec![scope_inputs];
    if let Some(c) = config_path {
        inputs.push(custody::file_input(c, "config")?);
    }
    let digest = custody::write_evidence(out, "notify", command, inputs)?;
    files.push(out.join(custody::EVIDENCE_JSON));
    files.sort();
    Ok(NotifyOutcome {
        files,
        packs: packs.into_iter().map(|p| p.folder).collect(),
        evidence_digest: digest,
        unfilled: cfg.unfilled(),
    })
}
