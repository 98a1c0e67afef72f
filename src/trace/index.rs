//! The request keys: every request id of a trace with its tenant, read in
//! one streaming pass, compact, with duplicate ids rejected.
//!
//! Analyses (inspect, scope, verify) join KV events to requests by id; this
//! is the one place that reads the requests table for that purpose, so a
//! duplicate `request_id` is caught the same way everywhere: an error naming
//! both files and rows (bad input, exit 2).
//!
//! Memory: 16 bytes per request (its id and tenant key, sorted, no hash
//! map), plus each distinct tenant string once; whatever else an analysis
//! needs of a row it takes from the row as the pass hands it over
//! ([`scan_requests`]), so the full rows are never all held (they were, at
//! about 600 bytes per request: 1.2 GB for 2 million requests).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Location, Result};
use crate::schema::{RequestRecord, req_col};
use crate::trace::read::{RequestFileReader, Trace};

/// Every request id of a trace, sorted, each with its tenant as a small key.
#[derive(Debug, Clone, Default)]
pub struct RequestKeys {
    /// (request_id, index into `tenants`), ascending by id, ids unique.
    keys: Vec<(u64, u32)>,
    tenants: Vec<Box<str>>,
}

impl RequestKeys {
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant key of a request, when the requests table has it.
    pub fn tenant_key(&self, request_id: u64) -> Option<u32> {
        self.keys
            .binary_search_by_key(&request_id, |&(id, _)| id)
            .ok()
            .map(|i| self.keys[i].1)
    }

    /// Whether the requests table has this request.
    pub fn contains(&self, request_id: u64) -> bool {
        self.tenant_key(request_id).is_some()
    }

    /// The tenant of a request, when the requests table has it.
    pub fn tenant(&self, request_id: u64) -> Option<&str> {
        self.tenant_key(request_id)
            .map(|k| &*self.tenants[k as usize])
    }

    /// Distinct tenants, in order of first appearance (a tenant key
    /// indexes it).
    pub fn tenants(&self) -> &[Box<str>] {
        &self.tenants
    }

    /// Every (request_id, tenant key), ascending by id.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.keys.iter().copied()
    }
}

/// Reads every request of `trace` once, in reading order (files sorted by
/// path, rows in file order), handing each row to `visit`, and returns the
/// request keys. Errors (exit 2) on any invalid row, on a pool id the
/// deployment does not list, and on a duplicate `request_id` (naming both
/// places: the first row, in reading order, whose id came before, and where
/// it came first). A duplicate is found once the pass is over (the keys are
/// sorted then), so `visit` may have seen both rows of it; its caller
/// discards what it gathered on an error.
pub fn scan_requests(trace: &Trace, mut visit: impl FnMut(RequestRecord)) -> Result<RequestKeys> {
    let mut known = vec![false; 1 << 16];
    for p in &trace.deployment().pools {
        known[p.id as usize] = true;
    }
    let mut keys = RequestKeys::default();
    let mut tenant_ids: HashMap<Box<str>, u32> = HashMap::new();
    for path in &trace.request_files {
        let mut row = 0u64;
        for batch in RequestFileReader::open(path)? {
            for r in batch? {
                check_pools(&known, path, row, &r)?;
                let tenant = match tenant_ids.get(r.tenant.as_str()) {
                    Some(&k) => k,
                    None => {
                        let k = keys.tenants.len() as u32;
                        keys.tenants.push(r.tenant.as_str().into());
                        tenant_ids.insert(r.tenant.as_str().into(), k);
                        k
                    }
                };
                keys.keys.push((r.request_id, tenant));
                visit(r);
                row += 1;
            }
        }
    }
    drop(tenant_ids);
    keys.keys.shrink_to_fit();
    keys.keys.sort_unstable_by_key(|&(id, _)| id);
    let mut dups: Vec<u64> = keys
        .keys
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| w[0].0)
        .collect();
    if dups.is_empty() {
        return Ok(keys);
    }
    drop(keys);
    dups.dedup();
    Err(locate_duplicate(trace, &dups))
}

/// The error for the first row, in reading order, whose id is among `dups`
/// and came before (a second pass, holding only the duplicated ids).
fn locate_duplicate(trace: &Trace, dups: &[u64]) -> Error {
    let mut first: HashMap<u64, (PathBuf, u64)> = HashMap::new();
    for path in &trace.request_files {
        let mut row = 0u64;
        let reader = match RequestFileReader::open(path) {
            Ok(r) => r,
            Err(e) => return e,
        };
        for batch in reader {
            let batch = match batch {
                Ok(b) => b,
                Err(e) => return e,
            };
            for r in batch {
                if dups.binary_search(&r.request_id).is_ok() {
                    if let Some((f, fr)) = first.get(&r.request_id) {
                        return duplicate_id(r.request_id, path, row, f, *fr);
                    }
                    first.insert(r.request_id, (path.clone(), row));
                }
                row += 1;
            }
        }
    }
    Error::Other(
        "a request_id occurs twice, but not on a second reading: the requests table changed while it was read".into(),
    )
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
