//! The request index: every request of a trace by `request_id`, loaded once,
//! compact, with duplicate ids rejected.
//!
//! Analyses (inspect, scope, reports) join KV events to requests by id; this
//! is the one place that reads the requests table for that purpose, so a
//! duplicate `request_id` is caught the same way everywhere: an error naming
//! both files and rows (bad input, exit 2).
//!
//! Memory: the index grows with the number of requests, not with the
//! number of KV events: measured at about 600 bytes per request at its
//! peak (the row, its external id, and the hash map's spare capacity while
//! it grows; scripts/bench_seed_scale.py: 139 MB for 233,000 requests),
//! plus each distinct tenant/finish_reason string once. That is accepted
//! for now: a request is a customer-visible response, and reports must
//! name them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Location, Result};
use crate::schema::{RequestRecord, req_col};
use crate::trace::read::{RequestFileReader, Trace};

/// One request, compactly: strings interned, hashes kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRow {
    pub request_id: u64,
    /// Index into [`RequestIndex::tenants`].
    pub tenant: u32,
    pub external_id: Option<Box<str>>,
    pub arrival_ns: i64,
    pub finish_ns: Option<i64>,
    pub prompt_tokens: u32,
    pub prefilled_tokens: Option<u32>,
    pub output_tokens: u32,
    pub http_status: u16,
    /// Index into [`RequestIndex::finish_reasons`].
    pub finish_reason: Option<u32>,
    pub prefill_pool: Option<u16>,
    pub decode_pool: Option<u16>,
    pub prompt_hash: Option<[u8; 32]>,
    pub output_hash: Option<[u8; 32]>,
    /// Where the row is: index into [`RequestIndex::files`] and 0-based row.
    pub file: u32,
    pub row: u64,
}

/// Every request of a trace, by id.
#[derive(Debug, Clone, Default)]
pub struct RequestIndex {
    rows: HashMap<u64, RequestRow>,
    tenants: Vec<Box<str>>,
    tenant_ids: HashMap<Box<str>, u32>,
    finish_reasons: Vec<Box<str>>,
    reason_ids: HashMap<Box<str>, u32>,
    files: Vec<PathBuf>,
}

impl RequestIndex {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn get(&self, request_id: u64) -> Option<&RequestRow> {
        self.rows.get(&request_id)
    }

    /// The tenant of a row.
    pub fn tenant(&self, row: &RequestRow) -> &str {
        &self.tenants[row.tenant as usize]
    }

    /// The finish reason of a row.
    pub fn finish_reason(&self, row: &RequestRow) -> Option<&str> {
        row.finish_reason.map(|i| &*self.finish_reasons[i as usize])
    }

    /// Distinct tenants, in order of first appearance.
    pub fn tenants(&self) -> &[Box<str>] {
        &self.tenants
    }

    /// Distinct finish reasons, in order of first appearance.
    pub fn finish_reasons(&self) -> &[Box<str>] {
        &self.finish_reasons
    }

    /// The requests files, in reading order ([`RequestRow::file`] indexes it).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every row in unspecified order (use [`Self::sorted_ids`] for output).
    pub fn rows(&self) -> impl Iterator<Item = &RequestRow> {
        self.rows.values()
    }

    /// Every request id, ascending (deterministic output order).
    pub fn sorted_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.rows.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Rebuilds the full record of a row.
    pub fn record(&self, row: &RequestRow) -> RequestRecord {
        RequestRecord {
            request_id: row.request_id,
            external_id: row.external_id.as_deref().map(str::to_string),
            tenant: self.tenant(row).to_string(),
            arrival_ns: row.arrival_ns,
            finish_ns: row.finish_ns,
            prompt_tokens: row.prompt_tokens,
            prefilled_tokens: row.prefilled_tokens,
            output_tokens: row.output_tokens,
            http_status: row.http_status,
            finish_reason: self.finish_reason(row).map(str::to_string),
            prefill_pool: row.prefill_pool,
            decode_pool: row.decode_pool,
            prompt_hash: row.prompt_hash,
            output_hash: row.output_hash,
        }
    }

    fn intern(map: &mut HashMap<Box<str>, u32>, list: &mut Vec<Box<str>>, s: &str) -> u32 {
        if let Some(&i) = map.get(s) {
            return i;
        }
        let i = list.len() as u32;
        list.push(s.into());
        map.insert(s.into(), i);
        i
    }

    /// Adds one record read from `file` (an index into `files`) at `row`.
    fn insert(&mut self, r: RequestRecord, file: u32, row: u64) -> Result<()> {
        if let Some(prev) = self.rows.get(&r.request_id) {
            return Err(duplicate_id(
                r.request_id,
                &self.files[file as usize],
                row,
                &self.files[prev.file as usize],
                prev.row,
            ));
        }
        let tenant = Self::intern(&mut self.tenant_ids, &mut self.tenants, &r.tenant);
        let finish_reason = r
            .finish_reason
            .as_deref()
            .map(|s| Self::intern(&mut self.reason_ids, &mut self.finish_reasons, s));
        self.rows.insert(
            r.request_id,
            RequestRow {
                request_id: r.request_id,
                tenant,
                external_id: r.external_id.map(String::into_boxed_str),
                arrival_ns: r.arrival_ns,
                finish_ns: r.finish_ns,
                prompt_tokens: r.prompt_tokens,
                prefilled_tokens: r.prefilled_tokens,
                output_tokens: r.output_tokens,
                http_status: r.http_status,
                finish_reason,
                prefill_pool: r.prefill_pool,
                decode_pool: r.decode_pool,
                prompt_hash: r.prompt_hash,
                output_hash: r.output_hash,
                file,
                row,
            },
        );
        Ok(())
    }
}

/// Loads every request of `trace` into an index. Errors (exit 2) on any
/// invalid row, on a pool id the deployment does not list, and on a
/// duplicate `request_id` (naming both places).
pub fn load_request_index(trace: &Trace) -> Result<RequestIndex> {
    let mut idx = RequestIndex::default();
    // Declared pool ids, a flat table: one lookup per row, whatever the
    // number of pools.
    let mut known = vec![false; 1 << 16];
    for p in &trace.deployment().pools {
        known[p.id as usize] = true;
    }
    for (fi, path) in trace.request_files.iter().enumerate() {
        idx.files.push(path.clone());
        let mut row = 0u64;
        for batch in RequestFileReader::open(path)? {
            for r in batch? {
                check_pools(&known, path, row, &r)?;
                idx.insert(r, fi as u32, row)?;
                row += 1;
            }
        }
    }
    Ok(idx)
}

/// The checks `load_request_index` makes (every row valid, pool ids
/// declared, no `request_id` twice: the same errors), holding 8 bytes per
/// request instead of the index: for `verify`, which needs no request
/// data. A duplicate is located by a second pass over the table.
pub fn check_request_ids(trace: &Trace) -> Result<u64> {
    let mut known = vec![false; 1 << 16];
    for p in &trace.deployment().pools {
        known[p.id as usize] = true;
    }
    let mut ids: Vec<u64> = Vec::new();
    for path in &trace.request_files {
        let mut row = 0u64;
        for batch in RequestFileReader::open(path)? {
            for r in batch? {
                check_pools(&known, path, row, &r)?;
                ids.push(r.request_id);
                row += 1;
            }
        }
    }
    ids.sort_unstable();
    let mut dups: Vec<u64> = ids
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    if dups.is_empty() {
        return Ok(ids.len() as u64);
    }
    drop(ids);
    dups.dedup();
    // The error the index gives: at the first row, in reading order, whose
    // id came before, naming where it came first.
    let mut first: HashMap<u64, (PathBuf, u64)> = HashMap::new();
    for path in &trace.request_files {
        let mut row = 0u64;
        for batch in RequestFileReader::open(path)? {
            for r in batch? {
                if dups.binary_search(&r.request_id).is_ok() {
                    if let Some((f, fr)) = first.get(&r.request_id) {
                        return Err(duplicate_id(r.request_id, path, row, f, *fr));
                    }
                    first.insert(r.request_id, (path.clone(), row));
                }
                row += 1;
            }
        }
    }
    Err(Error::Other(
        "a request_id occurs twice, but not on a second reading: the requests table changed while it was read".into(),
    ))
}

fn duplicate_id(id: u64, path: &Path, row: u64, first: &Path, first_row: u64) -> Error {
    Error::invalid(
        Location::file(path).row(row).column(req_col::REQUEST_ID),
        format!(
            "duplicate request_id {id}: already at {}, row {first_row}",
            first.display()
        ),
        "request_id must be unique within a trace; fix the writer or remove the duplicate row",
    )
}

fn check_pools(known: &[bool], path: &Path, row: u64, r: &RequestRecord) -> Result<()> {
    for (col, p) in [
        (req_col::PREFILL_POOL, r.prefill_pool),
        (req_col::DECODE_POOL, r.decode_pool),
    ] {
        if let Some(p) = p
            && !known[p as usize]
        {
            return Err(Error::invalid(
                Location::file(path).row(row).column(col),
                format!("unknown pool id {p}"),
                "every pool id must be listed in trace.json deployment.pools",
            ));
        }
    }
    Ok(())
}
