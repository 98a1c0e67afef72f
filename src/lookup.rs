//! Customer look-up: "was my response affected?" answered from a scope
//! folder, by external id, output hash or tenant. The request index
//! (requests.csv) says whether the trace saw the request at all: an id that
//! is not there is reported as not found, which is not "not affected". The
//! answer names only the asking side's own identifiers (the other side is
//! counted, never named) and carries the folder's evidence digest and
//! whether the folder still matches its evidence.json.
//!
//! An external id or output hash is not unique across customers (two
//! customers' clients may send the same id; identical short outputs have
//! the same hash). A look-up restricted to the asking customer (`tenant`)
//! sees only that customer's requests; one that is not, and matches
//! requests of more than one customer, answers with counts only
//! (`ambiguous`): no tenant name, request id or finding of anybody.
//! The folder is read through `report::folder::ScopeFolder`; a shard folder
//! is refused (`scope::shard::refuse_shard`). The rows that can match are
//! found through the folder's look-up index (requests.index.parquet,
//! `report::lookup_files::LookupIndex`), so a look-up in millions of requests
//! reads a few row groups and rows; a folder without a usable index (an
//! older kvtrail's, or one that no longer matches its evidence.json) is
//! scanned row by row, with the same answer and a note saying so.
//!
//! Ids and tenants are compared exactly as the trace holds them:
//! requests.csv's cells read back exactly (`report::csv`), so two tenants
//! that differ only in a NUL are two customers, and an empty external id
//! is not an absent one (`--external-id=` finds the requests whose id is
//! empty).
//!
//! Cross-tenant prefix-cache hits (`cross_tenant_shared`) are answered in a
//! match's `prefix_cache`, on either side (reader or source), with the
//! other side counted, never named. Where the deployment promised
//! per-tenant prefix caches (`prefix_cache_scope = "tenant"`) a hit is a
//! prefix-cache isolation breach and the match is affected; otherwise it
//! is information and does not make the match affected.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::report::folder::ScopeFolder;
use crate::report::lookup_files::{IndexRow, KeyKind};
use crate::scope::{Confidence, Crossing, ScopeReport};

/// What to look up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Query {
    ExternalId(String),
    OutputHash(String),
    Tenant(String),
}

impl Query {
    fn describe(&self) -> String {
        match self {
            Query::ExternalId(s) => format!("external id {s:?}"),
            Query::OutputHash(s) => format!("output hash {s}"),
            Query::Tenant(s) => format!("tenant {s:?}"),
        }
    }
}

/// The response side: this request's response read data not its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AsRecipient {
    pub foreign_tokens: u64,
    pub exposed_tokens: u64,
    /// `null` when it cannot be told (a source's customer is not known).
    pub other_customer_data: Option<bool>,
    pub confidence: Confidence,
    pub first_exposure_ns: i64,
    pub last_exposure_ns: i64,
}

/// The source side: this request's KV was read by other responses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AsSource {
    pub responses: u64,
    pub tokens: u64,
    /// `null` when it cannot be told (a reader's customer is not known).
    pub reached_other_customers: Option<bool>,
    pub confidence: Confidence,
}

/// `prefix_cache.kind` under `prefix_cache_scope = "tenant"`.
pub const PREFIX_CACHE_BREACH: &str = "prefix_cache_isolation_breach";
/// `prefix_cache.kind` where the prefix cache is shared across tenants.
pub const PREFIX_CACHE_INFORMATION: &str = "information";

/// This request's part in cross-tenant prefix-cache hits: no other
/// customer's KV entered a response, but a hit tells the reader, through
/// timing, that another customer sent the same prompt prefix.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCache {
    /// `prefix_cache_isolation_breach` (the deployment promised per-tenant
    /// prefix caches) or `information`.
    pub kind: String,
    /// Served from a prefix other customers' requests had cached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub as_reader: Option<PrefixCacheReader>,
    /// Its cached prefix served other customers' requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub as_source: Option<PrefixCacheSource>,
}

/// The reading side of prefix-cache hits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCacheReader {
    /// KV tokens served from other customers' cached prefixes.
    pub tokens: u64,
    /// How many other customers' requests they came from (counted only).
    pub source_requests: u64,
}

/// The cached side of prefix-cache hits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCacheSource {
    /// Other customers' responses served from this request's cached prefix
    /// (counted only).
    pub responses: u64,
    /// Sum over them of the tokens served.
    pub tokens: u64,
}

/// One request of the trace that matches the query.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Match {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    pub arrival_ns: i64,
    pub http_status: u16,
    pub output_hash: Option<String>,
    pub affected: bool,
    pub as_recipient: Option<AsRecipient>,
    pub as_source: Option<AsSource>,
    /// Cross-tenant prefix-cache hits (absent when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixCache>,
}

/// The answer to a look-up.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Answer {
    pub query: String,
    /// not_found | affected | not_affected | not_affected_incomplete_evidence
    /// | ambiguous
    pub status: String,
    pub message: String,
    pub requests_in_trace: u64,
    pub matches: Vec<Match>,
    /// Matches left out of `matches` (tenant queries list affected ones only).
    pub unaffected_matches: u64,
    /// `ambiguous`: requests of more than one customer match; only counted.
    #[serde(skip_serializing_if = "is_zero")]
    pub ambiguous_matches: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub ambiguous_customers: u64,
    pub evidence_blake3: String,
    /// No difference from evidence.json was found by the check
    /// `evidence_check` names.
    pub evidence_intact: bool,
    /// `whole_folder`: every file re-hashed; `bytes_read`: every file
    /// present with its recorded size, files under 4 MiB re-hashed, and
    /// every byte the answer read of larger ones compared with their chunk
    /// digests (`kvtrail verify` checks every byte).
    pub evidence_check: String,
    pub evidence_problems: Vec<String>,
    pub evidence_complete: bool,
    /// How the answer was found, where it was not the usual way (a folder
    /// without a usable look-up index: requests.csv was scanned).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The sentence appended to an answer about matches with prefix-cache hits
/// (empty when there are none).
fn prefix_cache_note(matches: &[Match], breach: bool) -> String {
    let k = matches.iter().filter(|m| m.prefix_cache.is_some()).count();
    if k == 0 {
        String::new()
    } else if breach {
        format!(
            " {k} of them also had a cross-tenant prefix-cache hit: a prefix-cache isolation breach (the deployment promises a prefix cache per customer; no prompt content was disclosed)."
        )
    } else {
        format!(
            " Information: {k} matching request(s) had a cross-tenant prefix-cache hit; the deployment shares its prefix cache across customers, so this is no isolation finding (no other customer's data entered a response)."
        )
    }
}

fn evidence_check(folder: &ScopeFolder) -> String {
    if folder.deferred() {
        CHECKED_BYTES_READ
    } else {
        CHECKED_WHOLE_FOLDER
    }
    .into()
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The note of an empty external id not found: requests.csv of earlier
/// versions wrote it as an empty cell, like an absent one.
pub const EMPTY_ID_NOTE: &str = "requests.csv writes an empty external id as a lone `'` and an absent one as an empty cell; a folder written by an earlier kvtrail wrote both as an empty cell, so there an empty id cannot be found: run `kvtrail scope TRACE --out DIR` again if the folder predates that";

/// `Answer::evidence_check` after a check of every byte of the folder.
pub const CHECKED_WHOLE_FOLDER: &str = "whole_folder";
/// `Answer::evidence_check` after a check of the bytes the answer read.
pub const CHECKED_BYTES_READ: &str = "bytes_read";

/// Answers a query from a scope folder; `only_tenant` restricts an
/// external-id or output-hash query to the asking customer's requests.
/// The folder is checked as far as the answer reads it
/// (`ScopeFolder::open_deferred`: every file present with its recorded
/// size, small files re-hashed, the bytes read of large ones compared with
/// their chunk digests); `lookup_checked` with `whole` checks every byte
/// first. Where the bytes read do not match, the look-up is answered again
/// after a check of the whole folder, so a changed folder is answered as
/// `lookup_checked` answers it.
pub fn lookup(dir: &Path, q: &Query, only_tenant: Option<&str>) -> Result<Answer> {
    lookup_checked(dir, q, only_tenant, false)
}

/// `lookup`; with `whole`, every file of the folder is re-hashed before
/// the answer (as `kvtrail verify` does).
pub fn lookup_checked(
    dir: &Path,
    q: &Query,
    only_tenant: Option<&str>,
    whole: bool,
) -> Result<Answer> {
    if !whole {
        let folder = ScopeFolder::open_deferred(dir)?;
        let a = answer(&folder, q, only_tenant);
        if folder.read_mismatches().is_empty() {
            return a;
        }
    }
    answer(&ScopeFolder::open(dir)?, q, only_tenant)
}

/// The answer, stage by stage: the query checked, each request's part in
/// the findings, the matching rows (through the look-up index, or a scan),
/// then the verdict.
fn answer(folder: &ScopeFolder, q: &Query, only_tenant: Option<&str>) -> Result<Answer> {
    folder.refuse_shard("lookup")?;
    let sum = folder.summary();
    let hash_q = output_hash(q)?;
    let found = Findings::of(sum);
    let what = match only_tenant {
        Some(t) => format!("{} of tenant {t:?}", q.describe()),
        None => q.describe(),
    };
    let mut matches = Vec::new();
    let mut unaffected = 0u64;
    let visit = |row: IndexRow| {
        let hit = match q {
            Query::ExternalId(id) => row.external_id.as_deref() == Some(id.as_str()),
            Query::OutputHash(_) => row.output_hash.as_deref() == hash_q.as_deref(),
            Query::Tenant(t) => row.tenant == *t,
        } && only_tenant.is_none_or(|t| row.tenant == t);
        if hit {
            let m = found.matched(row);
            if matches!(q, Query::Tenant(_)) && !m.affected && m.prefix_cache.is_none() {
                unaffected += 1;
            } else {
                matches.push(m);
            }
        }
    };
    let (n, notes) = visit_matching_rows(folder, q, hash_q.as_deref(), visit)?;
    let base = Answer {
        query: what.clone(),
        status: String::new(),
        message: String::new(),
        requests_in_trace: n,
        matches: Vec::new(),
        unaffected_matches: 0,
        ambiguous_matches: 0,
        ambiguous_customers: 0,
        evidence_blake3: folder.evidence_blake3().into(),
        evidence_intact: folder.intact(),
        evidence_check: evidence_check(folder),
        evidence_problems: folder.evidence_problems(),
        evidence_complete: folder.coverage().complete,
        notes,
    };
    // Several customers behind one id or hash, and no asker named: counts
    // only, so that no answer names one customer to another.
    let customers: BTreeSet<&str> = matches.iter().map(|m| m.tenant.as_str()).collect();
    if only_tenant.is_none() && !matches!(q, Query::Tenant(_)) && customers.len() > 1 {
        return Ok(Answer {
            status: "ambiguous".into(),
            message: format!(
                "AMBIGUOUS: {} requests of {} different customers match {}; none is shown, so that no customer sees another's. Ask again with --tenant NAME, the asking customer's tenant, to see that customer's requests only.",
                matches.len(),
                customers.len(),
                what
            ),
            ambiguous_matches: matches.len() as u64,
            ambiguous_customers: customers.len() as u64,
            ..base
        });
    }
    Ok(verdict(base, q, matches, unaffected, sum, found.breach))
}

/// An output-hash query's digest, lower case; `None` for other queries.
fn output_hash(q: &Query) -> Result<Option<String>> {
    let Query::OutputHash(h) = q else {
        return Ok(None);
    };
    let h = h.trim().to_ascii_lowercase();
    if crate::schema::parse_hex32(&h).is_none() {
        return Err(Error::Other(format!(
            "--output-hash {h:?} is not 64 hex digits (a blake3 digest)"
        )));
    }
    Ok(Some(h))
}

/// Each request's part in the findings, by request id: the response side,
/// the source side, and cross-tenant prefix-cache hits on either side.
struct Findings {
    recv: BTreeMap<u64, AsRecipient>,
    src: BTreeMap<u64, AsSource>,
    pc: BTreeMap<u64, PrefixCache>,
    /// Prefix-cache hits are isolation breaches (`prefix_cache_scope =
    /// "tenant"`).
    breach: bool,
}

impl Findings {
    fn of(sum: &ScopeReport) -> Self {
        let mut recv: BTreeMap<u64, AsRecipient> = BTreeMap::new();
        let mut src: BTreeMap<u64, AsSource> = BTreeMap::new();
        for a in &sum.affected_responses {
            recv.insert(
                a.request_id,
                AsRecipient {
                    foreign_tokens: a.foreign_tokens,
                    exposed_tokens: a.exposed_tokens,
                    other_customer_data: a.crossing().known(),
                    confidence: a.confidence,
                    first_exposure_ns: a.first_read_ns,
                    last_exposure_ns: a.last_read_ns,
                },
            );
            for s in &a.sources {
                let e = src.entry(s.request_id).or_insert_with(|| AsSource {
                    responses: 0,
                    tokens: 0,
                    reached_other_customers: Some(false),
                    confidence: s.confidence,
                });
                e.responses += 1;
                e.tokens += s.tokens;
                e.reached_other_customers = Crossing::from_known(e.reached_other_customers)
                    .max(s.crossing(&a.tenant))
                    .known();
                // Confirmed when any reading is (Confirmed sorts first).
                e.confidence = e.confidence.min(s.confidence);
            }
        }
        let breach = sum.deployment.tenant_prefix_cache();
        Findings {
            recv,
            src,
            pc: prefix_cache_hits(sum, breach),
            breach,
        }
    }

    /// The match for a row of requests.csv.
    fn matched(&self, row: IndexRow) -> Match {
        let r = self.recv.get(&row.request_id).cloned();
        let s = self.src.get(&row.request_id).cloned();
        let p = self.pc.get(&row.request_id).cloned();
        let affected = r.is_some() || s.is_some() || (self.breach && p.is_some());
        Match {
            request_id: row.request_id,
            external_id: row.external_id,
            tenant: row.tenant,
            arrival_ns: row.arrival_ns,
            http_status: row.http_status,
            output_hash: row.output_hash,
            affected,
            as_recipient: r,
            as_source: s,
            prefix_cache: p,
        }
    }
}

/// Cross-tenant prefix-cache hits, by request, on either side.
fn prefix_cache_hits(sum: &ScopeReport, breach: bool) -> BTreeMap<u64, PrefixCache> {
    let kind = if breach {
        PREFIX_CACHE_BREACH
    } else {
        PREFIX_CACHE_INFORMATION
    };
    let mut pc: BTreeMap<u64, PrefixCache> = BTreeMap::new();
    let new_pc = || PrefixCache {
        kind: kind.into(),
        as_reader: None,
        as_source: None,
    };
    for hit in &sum.cross_tenant_shared {
        pc.entry(hit.request_id).or_insert_with(new_pc).as_reader = Some(PrefixCacheReader {
            tokens: hit.tokens,
            source_requests: hit.sources.len() as u64,
        });
        for s in &hit.sources {
            let e = pc
                .entry(s.request_id)
                .or_insert_with(new_pc)
                .as_source
                .get_or_insert(PrefixCacheSource {
                    responses: 0,
                    tokens: 0,
                });
            e.responses += 1;
            e.tokens += s.tokens;
        }
    }
    pc
}

/// Calls `visit` with every row of requests.csv that can match `q`, in
/// file order, and returns the number of requests in the trace and the
/// notes on how they were found. The look-up index points at the few rows
/// that can match; without a usable one, every row is read. Both visit the
/// matching rows in file order, so the answers are the same.
fn visit_matching_rows(
    folder: &ScopeFolder,
    q: &Query,
    hash_q: Option<&str>,
    mut visit: impl FnMut(IndexRow),
) -> Result<(u64, Vec<String>)> {
    let mut notes = Vec::new();
    let keyed = match folder.lookup_index() {
        Ok(ix) => {
            let (kind, value) = match q {
                Query::ExternalId(id) => (KeyKind::ExternalId, id.as_str()),
                Query::OutputHash(_) => (KeyKind::OutputHash, hash_q.unwrap_or("")),
                Query::Tenant(t) => (KeyKind::Tenant, t.as_str()),
            };
            let offsets = ix.candidates(kind, value)?;
            // Rows read one by one cost a seek each: past about one row in
            // 32 (a large tenant), one pass over the file is cheaper.
            if (offsets.len() as u64).saturating_mul(32) <= ix.requests() {
                ix.rows_at(&offsets, &mut visit)?;
                Some(ix.requests())
            } else {
                None
            }
        }
        Err(why) => {
            notes.push(why);
            None
        }
    };
    let n = match keyed {
        Some(n) => n,
        None => {
            let mut n = 0u64;
            folder.requests(|row: IndexRow| {
                n += 1;
                visit(row);
                true
            })?;
            n
        }
    };
    Ok((n, notes))
}

/// The status and message of an answer that is not ambiguous.
fn verdict(
    base: Answer,
    q: &Query,
    matches: Vec<Match>,
    unaffected: u64,
    sum: &ScopeReport,
    breach: bool,
) -> Answer {
    let what = &base.query;
    let n = base.requests_in_trace;
    let complete = base.evidence_complete;
    let mut notes = base.notes.clone();
    let found = !matches.is_empty() || unaffected > 0;
    if !found && matches!(q, Query::ExternalId(id) if id.is_empty()) {
        notes.push(EMPTY_ID_NOTE.into());
    }
    let any = matches.iter().any(|m| m.affected);
    let (status, message) = if !found {
        (
            "not_found",
            format!(
                "NOT FOUND: {} does not occur among the {n} requests of this trace. Not found is not 'not affected': the request may predate or postdate the capture, or have been served by a deployment this trace does not cover.",
                what
            ),
        )
    } else if any {
        let k = matches.iter().filter(|m| m.affected).count();
        let foreign = matches
            .iter()
            .any(|m| m.as_recipient.is_some() || m.as_source.is_some());
        if foreign {
            (
                "affected",
                format!(
                    "AFFECTED: {k} matching request(s) of {} are affected (see each match for the side).{}",
                    what,
                    prefix_cache_note(&matches, breach)
                ),
            )
        } else {
            (
                "affected",
                format!(
                    "AFFECTED (prefix-cache isolation breach): {k} matching request(s) of {} were served from, or had their cached prompt prefix served to, another customer's request, although the deployment promises a prefix cache per customer. No other customer's data entered a response and no prompt content was disclosed; the cache hit's timing can reveal that the same prompt prefix was sent by another customer.",
                    what
                ),
            )
        }
    } else if complete {
        (
            "not_affected",
            format!(
                "NOT AFFECTED: {} is in the trace and no exposure touches it; the evidence is complete.{}",
                what,
                prefix_cache_note(&matches, breach)
            ),
        )
    } else {
        (
            "not_affected_incomplete_evidence",
            format!(
                "NO EXPOSURE RECORDED for {}, but the evidence is INCOMPLETE ({} coverage notes): exposure cannot be ruled out.{}",
                what,
                sum.coverage.notes.len(),
                prefix_cache_note(&matches, breach)
            ),
        )
    };
    Answer {
        status: status.into(),
        message,
        matches,
        unaffected_matches: unaffected,
        notes,
        ..base
    }
}
