//! The findings as an Arrow record batch: the rows of findings.parquet,
//! which `report::write_out` writes through `trace::write` (only `trace`
//! knows Parquet).

use std::sync::Arc;

use arrow_array::{ArrayRef, BooleanArray, RecordBatch, StringArray, UInt16Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema};

use crate::scope::{Confidence, ScopeReport};

/// `kind` of a row for a foreign (or unknown, or after-gap) read.
pub const KIND_FOREIGN: &str = "foreign";
/// `kind` of a row for a cross-tenant prefix-cache hit.
pub const KIND_PREFIX_CACHE: &str = "prefix_cache";

/// findings.parquet rows: one per (response, source) of kind `foreign`; a
/// response without sources (unknown or after-gap reads only) gets one row
/// with null source. Then one row of kind `prefix_cache` per cross-tenant
/// prefix-cache hit and source (`cross_tenant_shared`), whatever the
/// deployment's `prefix_cache_scope`: analysts filter on `kind`.
pub fn findings_batch(r: &ScopeReport) -> RecordBatch {
    // A hit's HTTP status, where the reader is also an affected response.
    let http: std::collections::HashMap<u64, Option<u16>> = r
        .affected_responses
        .iter()
        .map(|a| (a.request_id, a.http_status))
        .collect();
    let mut rid = Vec::new();
    let mut ext: Vec<Option<String>> = Vec::new();
    let mut ten: Vec<Option<String>> = Vec::new();
    let mut status: Vec<Option<u16>> = Vec::new();
    let mut src: Vec<Option<u64>> = Vec::new();
    let mut sten: Vec<Option<String>> = Vec::new();
    let mut tok = Vec::new();
    let mut fseq: Vec<Option<u64>> = Vec::new();
    let mut lseq: Vec<Option<u64>> = Vec::new();
    let mut cross = Vec::new();
    let mut conf = Vec::new();
    let mut kind = Vec::new();
    for a in &r.affected_responses {
        let mut push = |s: Option<&crate::scope::Source>| {
            rid.push(a.request_id);
            ext.push(a.external_id.clone());
            ten.push(a.tenant.customer().map(str::to_string));
            status.push(a.http_status);
            src.push(s.map(|x| x.request_id));
            sten.push(s.and_then(|x| x.tenant.customer().map(str::to_string)));
            tok.push(s.map(|x| x.tokens).unwrap_or(a.exposed_tokens));
            fseq.push(s.map(|x| x.first_seq));
            lseq.push(s.map(|x| x.last_seq));
            cross.push(s.map(|x| x.cross_tenant).unwrap_or(false));
            conf.push(
                s.map(|x| x.confidence)
                    .unwrap_or(Confidence::Possible)
                    .as_str(),
            );
            kind.push(KIND_FOREIGN);
        };
        if a.sources.is_empty() {
            push(None);
        }
        for s in &a.sources {
            push(Some(s));
        }
    }
    for hit in &r.cross_tenant_shared {
        for s in &hit.sources {
            rid.push(hit.request_id);
            ext.push(hit.external_id.clone());
            ten.push(hit.tenant.customer().map(str::to_string));
            status.push(http.get(&hit.request_id).copied().flatten());
            src.push(Some(s.request_id));
            sten.push(s.tenant.customer().map(str::to_string));
            tok.push(s.tokens);
            fseq.push(None);
            lseq.push(None);
            cross.push(true);
            conf.push(Confidence::Confirmed.as_str());
            kind.push(KIND_PREFIX_CACHE);
        }
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("request_id", DataType::UInt64, false),
        Field::new("external_id", DataType::Utf8, true),
        // null: the engine (request 0) or a request missing from the
        // requests table, never a name a tenant could have.
        Field::new("tenant", DataType::Utf8, true),
        Field::new("http_status", DataType::UInt16, true),
        Field::new("source_request_id", DataType::UInt64, true),
        Field::new("source_tenant", DataType::Utf8, true),
        Field::new("tokens", DataType::UInt64, false),
        Field::new("first_seq", DataType::UInt64, true),
        Field::new("last_seq", DataType::UInt64, true),
        Field::new("cross_tenant", DataType::Boolean, false),
        Field::new("confidence", DataType::Utf8, false),
        // foreign | prefix_cache (appended last: earlier columns keep
        // their positions).
        Field::new("kind", DataType::Utf8, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from(rid)),
        Arc::new(StringArray::from(ext)),
        Arc::new(StringArray::from(ten)),
        Arc::new(UInt16Array::from(status)),
        Arc::new(UInt64Array::from(src)),
        Arc::new(StringArray::from(sten)),
        Arc::new(UInt64Array::from(tok)),
        Arc::new(UInt64Array::from(fseq)),
        Arc::new(UInt64Array::from(lseq)),
        Arc::new(BooleanArray::from(cross)),
        Arc::new(StringArray::from(conf)),
        Arc::new(StringArray::from(kind)),
    ];
    RecordBatch::try_new(schema, cols).expect("findings batch matches its schema")
}
