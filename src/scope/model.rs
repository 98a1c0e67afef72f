//! The scope report: plain serializable data. Field order here is the order
//! in JSON output; lists are sorted by the builder (`scope_outcome`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::lineage::Gap;
use crate::trace::manifest::Manifest;

/// How sure a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Confidence {
    /// Backed by complete evidence.
    Confirmed,
    /// Depends on slot state after a hole, on an unclean capture, or on KV
    /// that predates the capture.
    Possible,
}

impl Confidence {
    pub fn as_str(self) -> &'static str {
        match self {
            Confidence::Confirmed => "confirmed",
            Confidence::Possible => "possible",
        }
    }
}

/// Whose request it is: a customer (the tenant of the requests table), or
/// no customer at all. The two "no customer" cases are variants, never
/// strings, so no tenant name can be mistaken for them.
///
/// JSON: a customer is its name; the engine and an unknown tenant are
/// `null` (which of the two follows from the request id: request 0 is the
/// engine; `ScopeReport::from_json` restores `Engine`). People see them as
/// `(engine)` and `(unknown)` (`Display`); a customer whose name reads like
/// one of those is shown in double quotes, so the two never look alike.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tenant {
    /// Request 0, the engine itself.
    Engine,
    /// A request missing from the requests table.
    Unknown,
    /// A customer, by its tenant name.
    Customer(String),
}

impl Tenant {
    /// Label shown for the engine.
    pub const ENGINE_LABEL: &'static str = "(engine)";
    /// Label shown for an unknown tenant.
    pub const UNKNOWN_LABEL: &'static str = "(unknown)";

    /// The customer's name, or None for the engine and unknown tenants.
    pub fn customer(&self) -> Option<&str> {
        match self {
            Tenant::Customer(s) => Some(s),
            _ => None,
        }
    }
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tenant::Engine => f.write_str(Self::ENGINE_LABEL),
            Tenant::Unknown => f.write_str(Self::UNKNOWN_LABEL),
            Tenant::Customer(s) if s == Self::ENGINE_LABEL || s == Self::UNKNOWN_LABEL => {
                write!(f, "\"{s}\"")
            }
            Tenant::Customer(s) => f.write_str(s),
        }
    }
}

impl Serialize for Tenant {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Tenant::Customer(n) => s.serialize_str(n),
            _ => s.serialize_none(),
        }
    }
}

impl<'de> Deserialize<'de> for Tenant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<String>::deserialize(d)? {
            Some(n) => Tenant::Customer(n),
            None => Tenant::Unknown,
        })
    }
}

/// Whether data went from one customer to another, as far as the tenants
/// tell: the one rule for "another customer" everywhere (scope's
/// `cross_tenant`, notices, the register, report texts, lookup).
///
/// An unknown tenant (a request missing from the requests table) is its
/// own category: the data may or may not have been another customer's, so
/// it is `Unknown`, never `Yes`. The engine's KV (request 0) is no
/// customer's: `No`. Ordered `No < Unknown < Yes`, so the answer for a
/// response over its sources is the largest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Crossing {
    /// The same customer, or the engine's own KV.
    No,
    /// A tenant on either side is unknown.
    Unknown,
    /// Two different customers.
    Yes,
}

impl Crossing {
    /// Between a reader's tenant and the tenant of source request `source_id`.
    pub fn between(reader: &Tenant, source_id: u64, source: &Tenant) -> Crossing {
        if source_id == crate::schema::ENGINE_REQUEST || *source == Tenant::Engine {
            return Crossing::No;
        }
        match (reader.customer(), source.customer()) {
            (Some(a), Some(b)) if a == b => Crossing::No,
            (Some(_), Some(_)) => Crossing::Yes,
            _ => Crossing::Unknown,
        }
    }

    /// Counted cross-tenant by the contract (`cross_tenant`: "differs, or
    /// either tenant is unknown"): not shown to stay with one customer.
    pub fn counted(self) -> bool {
        self != Crossing::No
    }

    /// The inverse of [`Crossing::known`].
    pub fn from_known(k: Option<bool>) -> Crossing {
        match k {
            Some(false) => Crossing::No,
            Some(true) => Crossing::Yes,
            None => Crossing::Unknown,
        }
    }

    /// `Some(true)`: certainly another customer's; `Some(false)`:
    /// certainly not; `None`: it cannot be told (a tenant is unknown).
    pub fn known(self) -> Option<bool> {
        match self {
            Crossing::No => Some(false),
            Crossing::Yes => Some(true),
            Crossing::Unknown => None,
        }
    }
}

/// One request whose KV another response read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Source {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: Tenant,
    /// Distinct (pool, slot) of this source read by the response.
    pub tokens: u64,
    /// seq (in the reading pool) of the first and last read of this source.
    pub first_seq: u64,
    pub last_seq: u64,
    pub first_ts_ns: i64,
    pub last_ts_ns: i64,
    pub pools: Vec<u16>,
    pub cross_tenant: bool,
    pub confidence: Confidence,
}

impl Source {
    /// Whether this source's KV was another customer's than `reader`'s.
    pub fn crossing(&self, reader: &Tenant) -> Crossing {
        Crossing::between(reader, self.request_id, &self.tenant)
    }
}

/// One affected response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: Tenant,
    pub in_requests_table: bool,
    pub arrival_ns: Option<i64>,
    pub finish_ns: Option<i64>,
    pub http_status: Option<u16>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<u32>,
    pub prefilled_tokens: Option<u32>,
    pub output_tokens: Option<u32>,
    /// Lower-case hex blake3 of the output token ids.
    pub output_hash: Option<String>,
    /// Distinct (pool, slot) read as foreign.
    pub foreign_tokens: u64,
    /// Distinct (pool, slot) never written in a capture that did not begin
    /// with the engine: KV of unknown origin.
    pub unknown_tokens: u64,
    /// Distinct (pool, slot) that look own/shared/blank but whose state
    /// depends on a hole in the seq stream.
    pub uncertain_tokens: u64,
    /// Distinct (pool, slot) in any of the three classes above.
    pub exposed_tokens: u64,
    pub cross_tenant: bool,
    pub confidence: Confidence,
    /// foreign | unknown_predates_capture | after_gap
    pub reasons: Vec<String>,
    pub first_read_ns: i64,
    pub last_read_ns: i64,
    pub sources: Vec<Source>,
}

impl Response {
    /// Whether this response carried another customer's data: `Yes` when a
    /// source certainly belongs to another customer, and also when the
    /// reader is unknown but its sources belong to two or more customers
    /// (it cannot be all of them); `Unknown` when a tenant on either side
    /// is unknown; else `No`.
    pub fn crossing(&self) -> Crossing {
        let mut c = Crossing::No;
        let mut customers = std::collections::BTreeSet::new();
        for s in &self.sources {
            c = c.max(s.crossing(&self.tenant));
            if let Some(n) = s.tenant.customer() {
                customers.insert(n);
            }
        }
        if c == Crossing::Unknown && self.tenant == Tenant::Unknown && customers.len() > 1 {
            Crossing::Yes
        } else {
            c
        }
    }

    /// The reader's customer is not known (it is missing from the requests
    /// table): nobody can be notified for this response.
    pub fn unattributed(&self) -> bool {
        self.tenant.customer().is_none()
    }
}

/// A tenant whose responses carried foreign data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recipient {
    pub tenant: Tenant,
    pub responses: u64,
    pub foreign_tokens: u64,
    pub unknown_tokens: u64,
    pub cross_tenant_responses: u64,
    pub confirmed: u64,
    pub possible: u64,
    pub request_ids: Vec<u64>,
}

/// A tenant whose KV leaked into responses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceTenant {
    pub tenant: Tenant,
    /// Distinct source requests of this tenant.
    pub requests: u64,
    /// Sum over (response, source request) of distinct slots read.
    pub tokens: u64,
    pub cross_tenant_tokens: u64,
    pub recipient_responses: u64,
    pub recipient_tenants: Vec<Tenant>,
    pub request_ids: Vec<u64>,
}

/// A response that read blank (scrubbed or never-written) KV: an integrity
/// defect, not a leak.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlankReads {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: Tenant,
    pub tokens: u64,
}

/// A response that read another tenant's KV through a prefix-cache hit (a
/// shared read: no foreign KV entered its attention, but the hit tells it,
/// through timing, that another tenant sent that prefix).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedHit {
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
    pub tenant: Tenant,
    /// Distinct (pool, slot) read as shared from other tenants' KV.
    pub tokens: u64,
    pub sources: Vec<SharedSource>,
}

/// Whose cached KV a [`SharedHit`] read, per source request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedSource {
    pub request_id: u64,
    pub tenant: Tenant,
    /// Distinct (pool, slot) of this source's KV read as shared.
    pub tokens: u64,
}

/// A request-level anomaly visible without KV events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Anomaly {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    /// error_looks_like_success | prompt_exceeds_prefill_pool
    pub kind: String,
    pub prompt_tokens: u32,
    pub prefilled_tokens: Option<u32>,
    pub http_status: u16,
    pub prefill_pool: Option<u16>,
    /// For prompt_exceeds_prefill_pool: the pool's max_req_input_len.
    pub limit: Option<u64>,
    pub detail: String,
}

/// Copies that read a source seq past the end of the recorded stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopiesPastEnd {
    pub pool: u16,
    pub min_src_seq: u64,
    pub max_src_seq: u64,
}

/// How complete the evidence is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Coverage {
    /// True only when nothing below lowers confidence.
    pub complete: bool,
    pub capture_complete: bool,
    pub from_engine_start: Option<bool>,
    pub gaps: Vec<Gap>,
    pub lost_events: u64,
    pub copies_past_end: Vec<CopiesPastEnd>,
    /// trace.json has no `files` list.
    pub unverifiable: bool,
    pub files_not_in_manifest: Vec<String>,
    pub files_missing: Vec<String>,
    /// Requests of findings (readers or sources) not in the requests table.
    pub requests_missing: Vec<u64>,
    /// Distinct (pool, slot) pairs that request 0, the engine itself, read
    /// while they held KV that was not its own (foreign, unknown or after a
    /// hole). The engine has no customer response, so these are no affected
    /// response; they are counted here so that the evidence still shows them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub engine_reads: u64,
    /// Files under requests/ or kv/ the readers do not take but that may
    /// hold rows of the trace: part files left open (`*.parquet.inprogress`)
    /// and `*.parquet` under a name starting with `_` or `.`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_unread: Vec<String>,
    /// Listed files whose bytes are not what trace.json's blake3 says
    /// (edited, re-written or damaged since the capture), or that are no
    /// regular file: what they hold is not the recorded evidence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_modified: Vec<String>,
    /// Listed files whose digest matches but whose row count is not the
    /// one trace.json lists: the manifest says rows were written that the
    /// trace does not hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_rows_differ: Vec<RowsDiffer>,
    /// Malformed input lines dropped at import (`capture.skipped_lines`):
    /// their events are lost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_lines: u64,
    /// The replayed pools hold no KV event at all: the trace records
    /// nothing of what any request read, so it is no evidence either way.
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_kv_events: bool,
    /// Set only in a shard's report (`scope --pools`): the pools it
    /// reports. A shard is never complete evidence (`scope::merge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_pools: Option<Vec<u16>>,
    /// Set only in a merged report whose shards' signed statements were not
    /// checked (`kvtrail merge` without `--allowed-signers`): anyone who
    /// can write a shard folder could have changed its findings, so the
    /// merged evidence is never complete (`scope::merge::merge_unauthenticated`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub shards_not_authenticated: bool,
    pub notes: Vec<String>,
}

/// A listed file with another row count than trace.json says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowsDiffer {
    pub path: String,
    /// Rows trace.json lists for the file.
    pub listed_rows: u64,
    /// Rows the file holds (its Parquet footer; its digest matches).
    pub file_rows: u64,
}

/// The deployment and capture the trace describes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentInfo {
    pub name: String,
    pub engine: String,
    pub context_window: u64,
    pub pools: Vec<PoolInfo>,
    pub capture_writer: String,
    pub capture_started_ns: i64,
    pub capture_ended_ns: i64,
    /// `deployment.prefix_cache_scope` of trace.json, when it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache_scope: Option<crate::trace::manifest::PrefixCacheScope>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolInfo {
    pub id: u16,
    pub name: String,
    pub role: String,
    pub capacity_tokens: u64,
    pub page_size: u32,
}

impl DeploymentInfo {
    pub fn from(m: &Manifest) -> Self {
        let d = &m.deployment;
        let mut pools: Vec<PoolInfo> = d
            .pools
            .iter()
            .map(|p| PoolInfo {
                id: p.id,
                name: p.name.clone(),
                role: p.role.as_str().to_string(),
                capacity_tokens: p.capacity_tokens,
                page_size: p.page_size,
            })
            .collect();
        pools.sort_by_key(|p| p.id);
        DeploymentInfo {
            name: d.name.clone(),
            engine: d.engine.clone(),
            context_window: d.context_window,
            pools,
            capture_writer: m.capture.writer.clone(),
            capture_started_ns: m.capture.started_ns,
            capture_ended_ns: m.capture.ended_ns,
            prefix_cache_scope: d.prefix_cache_scope,
        }
    }

    /// Whether the operator promised per-tenant prefix caches: then a
    /// cross-tenant shared read is an isolation finding.
    pub fn tenant_prefix_cache(&self) -> bool {
        self.prefix_cache_scope == Some(crate::trace::manifest::PrefixCacheScope::Tenant)
    }
}

/// When the exposure happened (over affected responses).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeWindow {
    pub first_exposure_ns: Option<i64>,
    pub last_exposure_ns: Option<i64>,
    pub first_arrival_ns: Option<i64>,
    pub last_arrival_ns: Option<i64>,
}

impl TimeWindow {
    pub fn include(&mut self, first: i64, last: i64, arrival: Option<i64>) {
        self.first_exposure_ns = Some(self.first_exposure_ns.map_or(first, |v| v.min(first)));
        self.last_exposure_ns = Some(self.last_exposure_ns.map_or(last, |v| v.max(last)));
        if let Some(a) = arrival {
            self.first_arrival_ns = Some(self.first_arrival_ns.map_or(a, |v| v.min(a)));
            self.last_arrival_ns = Some(self.last_arrival_ns.map_or(a, |v| v.max(a)));
        }
    }
}

/// Totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub requests: u64,
    pub kv_files: u64,
    pub kv_events: u64,
    pub slot_touches: u64,
    pub read_events: u64,
    pub read_slots: u64,
    pub affected_responses: u64,
    pub confirmed_responses: u64,
    pub possible_responses: u64,
    pub cross_tenant_responses: u64,
    /// Responses with a prefix-cache hit on another tenant's KV
    /// (`cross_tenant_shared`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cross_tenant_shared_responses: u64,
    pub foreign_tokens: u64,
    /// Distinct customers whose responses carried foreign data: tenants of
    /// the requests table only (an unknown tenant is no customer).
    pub recipient_tenants: u64,
    /// Distinct customers whose KV was read (neither the engine nor an
    /// unknown tenant is a customer).
    pub source_tenants: u64,
    pub source_requests: u64,
    /// Of `cross_tenant_responses`, those where it cannot be told whether
    /// the data belonged to another customer (a tenant on either side is
    /// unknown); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cross_tenant_unknown_responses: u64,
    /// Affected responses whose customer is unknown (missing from the
    /// requests table); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unattributed_responses: u64,
    /// Distinct source requests whose customer is unknown; absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unattributed_source_requests: u64,
    pub anomalies: u64,
    pub spilled_events: u64,
}

impl Counts {
    /// The cross-tenant responses for people: `2 cross-tenant`, and apart
    /// those where a tenant is unknown (`, 1 with a tenant unknown`),
    /// which are never counted as another customer's.
    pub fn cross_tenant_words(&self) -> String {
        let unknown = self
            .cross_tenant_unknown_responses
            .min(self.cross_tenant_responses);
        let mut t = format!("{} cross-tenant", self.cross_tenant_responses - unknown);
        if unknown > 0 {
            t.push_str(&format!(", {unknown} with a tenant unknown"));
        }
        t
    }

    /// The counts derived from the findings (the rest left at 0): a single
    /// run and a merge count them the same way.
    pub fn of_findings(
        affected: &[Response],
        recipients: &[Recipient],
        sources: &[SourceTenant],
    ) -> Self {
        let with = |c: Confidence| affected.iter().filter(|a| a.confidence == c).count() as u64;
        Counts {
            affected_responses: affected.len() as u64,
            confirmed_responses: with(Confidence::Confirmed),
            possible_responses: with(Confidence::Possible),
            cross_tenant_responses: affected.iter().filter(|a| a.cross_tenant).count() as u64,
            // Saturating: a merge reads these from the shards' files.
            foreign_tokens: affected
                .iter()
                .fold(0u64, |n, a| n.saturating_add(a.foreign_tokens)),
            recipient_tenants: recipients
                .iter()
                .filter(|r| r.tenant.customer().is_some())
                .count() as u64,
            source_tenants: sources
                .iter()
                .filter(|s| s.tenant.customer().is_some())
                .count() as u64,
            source_requests: sources
                .iter()
                .fold(0u64, |n, s| n.saturating_add(s.requests)),
            cross_tenant_unknown_responses: affected
                .iter()
                .filter(|a| a.crossing() == Crossing::Unknown)
                .count() as u64,
            unattributed_responses: affected.iter().filter(|a| a.unattributed()).count() as u64,
            unattributed_source_requests: affected
                .iter()
                .flat_map(|a| &a.sources)
                .filter(|s| s.tenant == Tenant::Unknown)
                .map(|s| s.request_id)
                .collect::<std::collections::BTreeSet<u64>>()
                .len() as u64,
            ..Default::default()
        }
    }
}

/// The whole scope report (`--json`, summary.json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeReport {
    pub format: String,
    pub version: u32,
    pub verdict: String,
    pub deployment: DeploymentInfo,
    pub time_window: TimeWindow,
    pub counts: Counts,
    pub affected_responses: Vec<Response>,
    pub recipients: Vec<Recipient>,
    pub sources: Vec<SourceTenant>,
    /// Distinct (response, pool, slot) read blank: integrity defects.
    pub blank_reads: u64,
    pub blank_read_responses: Vec<BlankReads>,
    /// Responses that read another tenant's KV through a prefix-cache hit,
    /// by request id (absent when there are none). With
    /// `prefix_cache_scope = "tenant"` each is an isolation finding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cross_tenant_shared: Vec<SharedHit>,
    pub anomalies: Vec<Anomaly>,
    pub coverage: Coverage,
}

impl ScopeReport {
    /// Responses that count as exposure for verdicts, exit codes and
    /// notifications: the affected ones, plus the cross-tenant prefix-cache
    /// hits where the deployment promised per-tenant prefix caches.
    pub fn exposed_responses(&self) -> u64 {
        let hits = if self.deployment.tenant_prefix_cache() {
            self.cross_tenant_shared.len() as u64
        } else {
            0
        };
        self.affected_responses.len() as u64 + hits
    }
}

impl ScopeReport {
    /// Reads a report written as JSON (summary.json, `--json`): the engine's
    /// entries (request 0, `tenant: null`) get `Tenant::Engine` back.
    pub fn from_json(bytes: &[u8]) -> serde_json::Result<Self> {
        let mut r: ScopeReport = serde_json::from_slice(bytes)?;
        let fix = |id: u64, t: &mut Tenant| {
            if id == crate::schema::ENGINE_REQUEST && *t == Tenant::Unknown {
                *t = Tenant::Engine;
            }
        };
        for a in &mut r.affected_responses {
            fix(a.request_id, &mut a.tenant);
            for s in &mut a.sources {
                fix(s.request_id, &mut s.tenant);
            }
        }
        for s in &mut r.sources {
            if s.request_ids == [crate::schema::ENGINE_REQUEST] && s.tenant == Tenant::Unknown {
                s.tenant = Tenant::Engine;
            }
        }
        for b in &mut r.blank_read_responses {
            fix(b.request_id, &mut b.tenant);
        }
        Ok(r)
    }

    /// Whether anything counts as exposure (`--fail-on-exposure`): an
    /// affected response (confirmed or possible), or a cross-tenant
    /// prefix-cache hit where the deployment promised per-tenant caches.
    pub fn any_exposure(&self) -> bool {
        self.exposed_responses() > 0
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
