//! The request index and the traffic timeline that `scope --out` writes next
//! to the findings: requests.csv (every request of the trace, affected or
//! not, so that `lookup` can tell "not affected" from "not in the trace")
//! and timeline.json (requests per time bucket, with the affected responses
//! in the same buckets, for the report's exposure chart).
//!
//! Both stream the requests table through `Trace::requests()` (two passes:
//! the time range, then the rows), so memory stays constant in the number
//! of requests. Rows keep trace order (files sorted by path, rows in file
//! order): the same trace gives the same bytes.
//!
//! requests.csv is for people and for `lookup`: its text cells (external_id,
//! tenant) follow the reversible cell encoding of `report::csv` and
//! `read_index` undoes it exactly, so an external id that begins with `=`
//! is found, two tenants that differ only in a NUL stay two, and an empty
//! external id (a lone `'`) is not an absent one (the empty cell).
//!
//! requests.index.parquet is `lookup`'s index into requests.csv: one
//! `trace::sorted` key file of (key, byte offset of the row) pairs, three
//! keys per request (its external id, output hash and tenant, each hashed
//! to 61 bits with its kind in the top bits), sorted, so that a look-up
//! reads a few small row groups and then only the rows it points at, and
//! checks every row it reads against the question (a hash collision only
//! costs a row read). It is built from requests.csv as written, by the
//! same parser `lookup` uses, and records requests.csv's digest and size,
//! so an index is only used with the requests.csv it was built from.
//! Building it holds at most 16 MiB of keys, whatever the number of
//! requests: sorted runs are spilled into the folder as unnamed temporary
//! files and merged (`crate::spill::Sorter`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::report::csv;
use crate::schema::hex32;
use crate::scope::ScopeReport;
use crate::scope::anomalies::answered_ok;
use crate::spill::{Place, Sorter};
use crate::trace::chunked::ChunkedFile;
use crate::trace::read::Trace;
use crate::trace::sorted::{SortedReader, SortedWriter};

/// File names inside a scope output folder.
pub const REQUESTS_CSV: &str = "requests.csv";
pub const LOOKUP_INDEX: &str = "requests.index.parquet";
pub const TIMELINE_JSON: &str = "timeline.json";

/// Header of requests.csv.
pub const REQUESTS_HEADER: &str = "request_id,external_id,tenant,arrival_ns,finish_ns,http_status,prompt_tokens,prefilled_tokens,output_tokens,output_hash";

/// Number of buckets of the timeline.
pub const BUCKETS: usize = 48;

/// Requests per time bucket; bucket i covers
/// `[start_ns + i*width_ns, start_ns + (i+1)*width_ns)`, by arrival time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub format: String,
    pub version: u32,
    pub start_ns: i64,
    pub width_ns: i64,
    /// Every request that arrived in the bucket.
    pub requests: Vec<u64>,
    /// Requests in the bucket that got a 2xx status.
    pub ok_responses: Vec<u64>,
    /// Affected responses (confirmed or possible) by arrival time; an
    /// affected response missing from the requests table is placed by its
    /// first foreign read.
    pub affected: Vec<u64>,
    pub confirmed: Vec<u64>,
}

impl Timeline {
    fn bucket(&self, t: i64) -> usize {
        if self.width_ns <= 0 {
            return 0;
        }
        (((t - self.start_ns).max(0) / self.width_ns) as usize).min(self.requests.len() - 1)
    }
}

/// One row of requests.csv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexRow {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    pub arrival_ns: i64,
    pub finish_ns: Option<i64>,
    pub http_status: u16,
    pub prompt_tokens: u32,
    pub prefilled_tokens: Option<u32>,
    pub output_tokens: u32,
    pub output_hash: Option<String>,
}

impl Timeline {
    /// Empty buckets over `[lo, hi]`, widened to the affected responses'
    /// arrival (or first read) times.
    fn spanning(mut lo: i64, mut hi: i64, report: &ScopeReport) -> Self {
        for a in &report.affected_responses {
            let t = a.arrival_ns.unwrap_or(a.first_read_ns);
            lo = lo.min(t);
            hi = hi.max(t);
        }
        if lo > hi {
            (lo, hi) = (0, 0);
        }
        let span = (hi as i128 - lo as i128 + 1).max(1);
        let width = ((span + BUCKETS as i128 - 1) / BUCKETS as i128).max(1) as i64;
        Timeline {
            format: "kvtrail-timeline".into(),
            version: 1,
            start_ns: lo,
            width_ns: width,
            requests: vec![0; BUCKETS],
            ok_responses: vec![0; BUCKETS],
            affected: vec![0; BUCKETS],
            confirmed: vec![0; BUCKETS],
        }
    }

    fn add_request(&mut self, arrival_ns: i64, http_status: u16) {
        let b = self.bucket(arrival_ns);
        self.requests[b] += 1;
        self.ok_responses[b] += answered_ok(http_status) as u64;
    }

    /// Adds the affected responses and writes timeline.json into `dir`.
    fn finish(mut self, report: &ScopeReport, dir: &Path) -> Result<Self> {
        for a in &report.affected_responses {
            let b = self.bucket(a.arrival_ns.unwrap_or(a.first_read_ns));
            self.affected[b] += 1;
            self.confirmed[b] += (a.confidence == crate::scope::Confidence::Confirmed) as u64;
        }
        let p = dir.join(TIMELINE_JSON);
        let mut text = serde_json::to_string_pretty(&self).expect("timeline serializes");
        text.push('\n');
        crate::custody::write_private(&p, text)?;
        Ok(self)
    }
}

/// Writes requests.csv and timeline.json into `dir`; returns the timeline.
pub fn write_index(trace: &Trace, report: &ScopeReport, dir: &Path) -> Result<Timeline> {
    // Pass 1: time range.
    let (mut lo, mut hi) = (i64::MAX, i64::MIN);
    for batch in trace.requests() {
        for r in batch? {
            lo = lo.min(r.arrival_ns);
            hi = hi.max(r.arrival_ns);
        }
    }
    let mut tl = Timeline::spanning(lo, hi, report);
    // Pass 2: rows and buckets.
    let path = dir.join(REQUESTS_CSV);
    let file = crate::custody::create_private(&path)?;
    let mut w = csv::writer(std::io::BufWriter::new(file));
    let io = |e: ::csv::Error| Error::io(&path, e.into());
    w.write_record(REQUESTS_HEADER.split(',')).map_err(io)?;
    for batch in trace.requests() {
        for r in batch? {
            tl.add_request(r.arrival_ns, r.http_status);
            let opt = |v: Option<String>| v.unwrap_or_default();
            w.write_record([
                r.request_id.to_string(),
                csv::text_opt(r.external_id.as_deref()).into_owned(),
                csv::text(&r.tenant).into_owned(),
                r.arrival_ns.to_string(),
                opt(r.finish_ns.map(|v| v.to_string())),
                r.http_status.to_string(),
                r.prompt_tokens.to_string(),
                opt(r.prefilled_tokens.map(|v| v.to_string())),
                r.output_tokens.to_string(),
                opt(r.output_hash.as_ref().map(hex32)),
            ])
            .map_err(io)?;
        }
    }
    w.flush().map_err(|e| Error::io(&path, e))?;
    drop(w);
    write_lookup_index(dir)?;
    tl.finish(report, dir)
}

/// The same two files from another scope folder's request index instead of
/// the trace (`merge`: every shard's requests.csv is the trace's whole
/// requests table): requests.csv copied from `src`, timeline.json built
/// from its rows exactly as `write_index` builds it from the trace.
pub fn copy_index(src: &Path, report: &ScopeReport, dir: &Path) -> Result<Timeline> {
    let (mut lo, mut hi) = (i64::MAX, i64::MIN);
    read_index(src, |r| {
        lo = lo.min(r.arrival_ns);
        hi = hi.max(r.arrival_ns);
        true
    })?;
    let mut tl = Timeline::spanning(lo, hi, report);
    read_index(src, |r| {
        tl.add_request(r.arrival_ns, r.http_status);
        true
    })?;
    let from = src.join(REQUESTS_CSV);
    let to = dir.join(REQUESTS_CSV);
    let mut f = std::fs::File::open(&from).map_err(|e| Error::io(&from, e))?;
    let mut w = crate::custody::create_private(&to)?;
    std::io::copy(&mut f, &mut w).map_err(|e| Error::io(&to, e))?;
    drop(w);
    write_lookup_index(dir)?;
    tl.finish(report, dir)
}

/// Reads requests.csv of a scope folder, calling `f` for every row until it
/// returns false. Streams record by record (a quoted field may span lines),
/// so memory does not grow with the trace. Text cells are returned as they
/// were in the trace (`csv::read_text`, exact). Errors name the file and row.
pub fn read_index(dir: &Path, f: impl FnMut(IndexRow) -> bool) -> Result<()> {
    read_index_from(&open_requests(dir)?, f)
}

/// `read_index` over requests.csv already opened (e.g. checked chunk by
/// chunk against the folder's evidence.json as it is read).
pub fn read_index_from(file: &ChunkedFile, mut f: impl FnMut(IndexRow) -> bool) -> Result<()> {
    read_index_at(file, |row, _| f(row))
}

/// The folder's requests.csv, opened as it is.
pub fn open_requests(dir: &Path) -> Result<ChunkedFile> {
    let path = dir.join(REQUESTS_CSV);
    if !path.exists() {
        return Err(Error::invalid(
            crate::error::Location::file(&path),
            "the scope folder has no request index",
            "it was written by an older kvtrail; run `kvtrail scope TRACE --out DIR` again",
        ));
    }
    ChunkedFile::open(&path, REQUESTS_CSV)
}

fn bad_row(path: &Path, row: Option<u64>, what: String) -> Error {
    let loc = crate::error::Location::file(path);
    Error::invalid(
        match row {
            Some(r) => loc.row(r),
            None => loc,
        },
        what,
        "requests.csv is written by `kvtrail scope --out`; run `kvtrail verify` on the folder and re-run scope",
    )
}

/// `read_index` with each row's byte offset in requests.csv.
fn read_index_at(file: &ChunkedFile, mut f: impl FnMut(IndexRow, u64) -> bool) -> Result<()> {
    let path = file.path();
    let mut rd = csv::reader(std::io::BufReader::new(file.cursor(0)));
    let mut rec = ::csv::StringRecord::new();
    let mut header = true;
    loop {
        // Row numbers count lines before the record: the header is row 0.
        let row = rd.position().line().saturating_sub(1);
        match rd.read_record(&mut rec) {
            Ok(false) => return Ok(()),
            Ok(true) => {}
            Err(e) => {
                let row = e.position().map_or(row, |p| p.line().saturating_sub(1));
                return Err(bad_row(path, Some(row), format!("not valid CSV: {e}")));
            }
        }
        let i = rec.position().map_or(row, |p| p.line().saturating_sub(1));
        let offset = rec.position().map_or(0, |p| p.byte());
        if header {
            if rec.iter().collect::<Vec<_>>().join(",") != REQUESTS_HEADER {
                return Err(bad_row(
                    path,
                    Some(i),
                    format!("header is not `{REQUESTS_HEADER}`"),
                ));
            }
            header = false;
            continue;
        }
        let row = parse_row(&rec).map_err(|what| bad_row(path, Some(i), what))?;
        if !f(row, offset) {
            return Ok(());
        }
    }
}

/// One record of requests.csv as an `IndexRow`, or what is wrong with it.
fn parse_row(rec: &::csv::StringRecord) -> std::result::Result<IndexRow, String> {
    let r: Vec<&str> = rec.iter().collect();
    if r.len() != 10 {
        return Err(format!("{} fields, expected 10", r.len()));
    }
    let num = |k: usize| -> std::result::Result<Option<i128>, String> {
        if r[k].is_empty() {
            return Ok(None);
        }
        r[k].parse::<i128>()
            .map(Some)
            .map_err(|_| format!("field {} is not a number: {:?}", k + 1, r[k]))
    };
    let need = |k: usize| -> std::result::Result<i128, String> {
        num(k)?.ok_or_else(|| format!("field {} is empty", k + 1))
    };
    let cell = |k: usize, name: &str, e: String| format!("field {} ({name}) {e}", k + 1);
    Ok(IndexRow {
        request_id: need(0)? as u64,
        external_id: csv::read_text_opt(r[1])
            .map_err(|e| cell(1, "external_id", e))?
            .map(|v| v.into_owned()),
        tenant: csv::read_text(r[2])
            .map_err(|e| cell(2, "tenant", e))?
            .into_owned(),
        arrival_ns: need(3)? as i64,
        finish_ns: num(4)?.map(|v| v as i64),
        http_status: need(5)? as u16,
        prompt_tokens: need(6)? as u32,
        prefilled_tokens: num(7)?.map(|v| v as u32),
        output_tokens: need(8)? as u32,
        output_hash: (!r[9].is_empty()).then(|| r[9].to_string()),
    })
}

/// What a look-up index key stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    ExternalId = 0,
    OutputHash = 1,
    Tenant = 2,
}

/// The index key of a value: blake3 of the kind and the value, 61 bits,
/// with the kind in bits 61 and 62 (so the keys of one kind are
/// contiguous and every key is a non-negative 64-bit integer).
pub fn lookup_key(kind: KeyKind, value: &str) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&[kind as u8]);
    h.update(value.as_bytes());
    let b = h.finalize();
    let low = u64::from_le_bytes(b.as_bytes()[..8].try_into().expect("8 bytes"));
    ((kind as u64) << 61) | (low & ((1 << 61) - 1))
}

/// Format name and version in the index's footer metadata.
const INDEX_FORMAT: &str = "kvtrail-lookup-index";
const INDEX_VERSION: &str = "1";

/// (key, offset) pairs sorted in memory before a run is spilled (16 MiB).
pub const SORT_PAIRS: usize = 1 << 20;

/// Builds requests.index.parquet from the folder's requests.csv. The
/// pairs are sorted with bounded memory, spilled to unnamed files in the
/// folder itself (never a RAM-backed /tmp).
pub fn write_lookup_index(dir: &Path) -> Result<()> {
    let mut pairs: Sorter<(u64, u64)> =
        Sorter::new(Place::unnamed(Some(dir), "look-up index"), SORT_PAIRS);
    let mut n = 0u64;
    let mut failed = None;
    read_index_at(&open_requests(dir)?, |row, off| {
        n += 1;
        let keys = [
            Some(lookup_key(KeyKind::Tenant, &row.tenant)),
            row.external_id
                .as_ref()
                .map(|x| lookup_key(KeyKind::ExternalId, x)),
            row.output_hash
                .as_ref()
                .map(|x| lookup_key(KeyKind::OutputHash, x)),
        ];
        for k in keys.into_iter().flatten() {
            if let Err(e) = pairs.push((k, off)) {
                failed = Some(e);
                return false;
            }
        }
        true
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    let (blake3, bytes) = crate::custody::hash_file(&dir.join(REQUESTS_CSV))?;
    let path = dir.join(LOOKUP_INDEX);
    let file = crate::custody::create_private(&path)?;
    let mut w = SortedWriter::new(
        file,
        &path,
        &[
            ("kvtrail.format", INDEX_FORMAT.into()),
            ("kvtrail.version", INDEX_VERSION.into()),
            ("kvtrail.requests", n.to_string()),
            ("kvtrail.requests_csv_bytes", bytes.to_string()),
            ("kvtrail.requests_csv_blake3", blake3),
        ],
    )?;
    for p in pairs.finish()? {
        let (k, off) = p?;
        w.push(k, off)?;
    }
    w.finish()?;
    Ok(())
}

/// A scope folder's look-up index, opened and matched to its requests.csv.
pub struct LookupIndex {
    csv: ChunkedFile,
    keys: SortedReader,
    requests: u64,
}

impl LookupIndex {
    /// Opens the index (`index`, the folder's requests.index.parquet) when
    /// it is of this format and was built from the requests.csv (`csv`)
    /// whose digest and size evidence.json records (`csv_blake3`,
    /// `csv_bytes`). `Err` says why it cannot be used (the caller scans
    /// requests.csv instead and says so).
    pub fn open(
        index: ChunkedFile,
        csv: ChunkedFile,
        csv_blake3: &str,
        csv_bytes: u64,
    ) -> std::result::Result<LookupIndex, String> {
        let keys = SortedReader::from_file(index)
            .map_err(|e| format!("{LOOKUP_INDEX} unreadable: {e}"))?;
        if keys.metadata("kvtrail.format") != Some(INDEX_FORMAT)
            || keys.metadata("kvtrail.version") != Some(INDEX_VERSION)
        {
            return Err(format!(
                "{LOOKUP_INDEX} is not a look-up index of this version"
            ));
        }
        if keys.metadata("kvtrail.requests_csv_blake3") != Some(csv_blake3)
            || keys.metadata("kvtrail.requests_csv_bytes") != Some(&csv_bytes.to_string())
        {
            return Err(format!(
                "{LOOKUP_INDEX} was built from another {REQUESTS_CSV} than the one evidence.json records"
            ));
        }
        let requests = keys
            .metadata("kvtrail.requests")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{LOOKUP_INDEX} does not record its number of requests"))?;
        Ok(LookupIndex {
            csv,
            keys,
            requests,
        })
    }

    /// Number of requests (rows of requests.csv) the index covers.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Byte offsets in requests.csv of the rows whose `kind` value may be
    /// `value` (ascending: file order). Every row they point at must still
    /// be compared with the question.
    pub fn candidates(&self, kind: KeyKind, value: &str) -> Result<Vec<u64>> {
        self.keys.find(lookup_key(kind, value))
    }

    /// Reads the rows of requests.csv at `offsets` (ascending), calling `f`
    /// for each in order. Errors name the file and byte offset.
    pub fn rows_at(&self, offsets: &[u64], mut f: impl FnMut(IndexRow)) -> Result<()> {
        let path = self.csv.path();
        let mut rd = csv::row_reader(self.csv.cursor(0));
        let mut rec = ::csv::StringRecord::new();
        for &off in offsets {
            let mut pos = ::csv::Position::new();
            pos.set_byte(off);
            rd.seek(pos).map_err(|e| Error::io(path, e.into()))?;
            let what = |w: String| bad_row(path, None, format!("at byte {off}: {w}"));
            match rd.read_record(&mut rec) {
                Ok(true) => {}
                Ok(false) => return Err(what("no row there".into())),
                Err(e) => return Err(what(format!("not valid CSV: {e}"))),
            }
            f(parse_row(&rec).map_err(what)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_index_streams_quoted_fields_across_lines() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "{REQUESTS_HEADER}\n1,\"a,\"\"b\"\"\nc\",t1,5,,200,8,,2,\n2,plain,t2,6,7,500,9,1,0,{}\n",
            "ab".repeat(32)
        );
        std::fs::write(dir.path().join(REQUESTS_CSV), text).unwrap();
        let mut rows = Vec::new();
        read_index(dir.path(), |r| {
            rows.push(r);
            true
        })
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].external_id.as_deref(), Some("a,\"b\"\nc"));
        assert_eq!(rows[0].finish_ns, None);
        assert_eq!(rows[1].prefilled_tokens, Some(1));
        assert_eq!(rows[1].output_hash.as_deref().map(str::len), Some(64));
        std::fs::write(
            dir.path().join(REQUESTS_CSV),
            format!("{REQUESTS_HEADER}\n1,x\n"),
        )
        .unwrap();
        let e = read_index(dir.path(), |_| true).unwrap_err().to_string();
        assert!(
            e.contains("requests.csv") && e.contains("row 1") && e.contains("2 fields"),
            "{e}"
        );
    }

    #[test]
    fn defect6_cells_of_earlier_versions_read_as_before_or_fail_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let rows = |text: &str| {
            std::fs::write(
                dir.path().join(REQUESTS_CSV),
                format!("{REQUESTS_HEADER}\n{text}"),
            )
            .unwrap();
            let mut rows = Vec::new();
            read_index(dir.path(), |r| {
                rows.push((r.external_id, r.tenant));
                true
            })
            .map(|_| rows)
        };
        // An empty cell is an absent id (all an earlier version wrote for
        // "" too); a lone `'` is the empty id.
        assert_eq!(
            rows("1,,t,5,,200,8,,2,\n2,',t,5,,200,8,,2,\n").unwrap(),
            [(None, "t".into()), (Some(String::new()), "t".into())]
        );
        // U+FFFD outside `'%`: an earlier version's NUL, refused naming
        // the row and the field.
        let e = rows("1,x,acme\u{fffd},5,,200,8,,2,\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("requests.csv")
                && e.contains("row 1")
                && e.contains("tenant")
                && e.contains("earlier kvtrail"),
            "{e}"
        );
        assert_eq!(
            rows("1,'%a%00,'%acme%00,5,,200,8,,2,\n").unwrap(),
            [(Some("a\0".into()), "acme\0".into())]
        );
    }
}
