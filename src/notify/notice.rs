//! What notify writes, as data: notice.json (`Notice`, with the customer's
//! received responses, exposed requests and prefix-cache hits), the
//! register entry (`RegisterEntry`), and `Pack`, one customer's facts
//! before they are rendered. Field order is the order in JSON output.

use serde::Serialize;

use crate::scope::Confidence;
use crate::text::utc;

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
    pub confidence: Confidence,
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
    pub confidence: Confidence,
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
    pub confidence: Confidence,
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
    pub confidence: Confidence,
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
    pub(super) fn new(first: Option<i64>, last: Option<i64>) -> Self {
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
    /// sha256 of the scope folder's signed statement
    /// (statement.intoto.jsonl), when it is signed: the chain of signed
    /// findings carried into the packs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope_statement_sha256: Option<String>,
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

/// One customer's pack before rendering: the customer's own facts only.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pack {
    pub tenant: String,
    /// `customers/<folder name>` (`folder_names`).
    pub folder: String,
    pub received: Vec<ReceivedResponse>,
    pub exposed: Vec<ExposedRequest>,
    pub served: Vec<PrefixCacheServed>,
    pub revealed: Vec<PrefixCacheRevealed>,
}
