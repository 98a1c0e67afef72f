//! JSON-lines import: one JSON object per line, each a KV event or a
//! request, turned into a v1 trace through the [`Recorder`].
//!
//! Engines written in other languages (SGLang is Python) emit this shape;
//! `kvtrail ingest` and the future `kvtrail record` sidecar both parse it
//! with [`parse_line`]. The shape is documented in docs/jsonl.md.
//!
//! Strictness: a line is either exactly right or an error naming the field.
//! Unknown keys are errors too (a typo in a nullable field would otherwise
//! drop evidence silently), except keys starting with `x_`, which are left
//! for engine-specific annotations and ignored.
//!
//! Lost evidence is never silent: with `skip_bad_lines` each skipped line is
//! counted, a skipped KV line whose pool is readable leaves an explicit seq
//! hole in that pool, and the trace is closed with `capture.complete =
//! false` and `capture.skipped_lines = N`.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::capture::{Recorder, RecorderOptions};
use crate::error::{Error, Location, Result};
use crate::schema::{CopySrc, KvEvent, Op, RequestRecord, parse_hex32};
use crate::trace::manifest::Deployment;

/// One parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonlRecord {
    /// A KV event. `seq` is `Some` when the line carried one (the recorder
    /// keeps it, holes included) and `None` when the recorder assigns it;
    /// `event.seq` is 0 in that case.
    Kv {
        event: KvEvent,
        seq: Option<u64>,
    },
    /// A KV line of several runs (`runs`): one event per run, in the
    /// line's order, each taking its pool's next seq (`event.seq` is 0).
    KvRuns(Vec<KvEvent>),
    Request(RequestRecord),
}

/// Why a line was rejected: the field at fault (when there is one) and what
/// is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    pub field: Option<String>,
    pub message: String,
    /// The pool of a KV line, when it could be read (so a skipped line can
    /// leave an explicit hole in that pool's seq stream).
    pub pool: Option<u16>,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.field {
            Some(field) => write!(f, "field `{field}`: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

fn err(field: &str, message: impl Into<String>) -> LineError {
    LineError {
        field: Some(field.to_string()),
        message: message.into(),
        pool: None,
    }
}

/// The longest string field (tenant, external_id, finish_reason) in bytes of
/// UTF-8. Ids and account names are far shorter; the bound keeps what a
/// capture holds per request (and what the sidecar holds while a request
/// waits for its partner view) small.
pub const MAX_STRING_BYTES: usize = 256;

/// The longest line, in bytes without its newline, that `kvtrail ingest`
/// reads (and the record sidecar's default `--max-line-bytes`). A longer
/// line is a bad line, skipped unread: a line needs a few hundred bytes.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The most runs one KV line of several runs (`runs`) carries.
pub const MAX_LINE_RUNS: usize = 65_536;

/// What a KV line with `runs` gives per run instead: none of these may be
/// set beside `runs`.
const NOT_WITH_RUNS: [&str; 7] = [
    "seq",
    "slot_start",
    "slot_count",
    "token_pos",
    "src_pool",
    "src_slot_start",
    "src_seq",
];

const KV_KEYS: [&str; 13] = [
    "type",
    "pool",
    "seq",
    "ts_ns",
    "request_id",
    "op",
    "slot_start",
    "slot_count",
    "token_pos",
    "src_pool",
    "src_slot_start",
    "src_seq",
    "runs",
];

const REQ_KEYS: [&str; 15] = [
    "type",
    "request_id",
    "external_id",
    "tenant",
    "arrival_ns",
    "finish_ns",
    "prompt_tokens",
    "prefilled_tokens",
    "output_tokens",
    "http_status",
    "finish_reason",
    "prefill_pool",
    "decode_pool",
    "prompt_hash",
    "output_hash",
];

/// Typed access to the fields of one object.
struct Obj<'a>(&'a Map<String, Value>);

impl Obj<'_> {
    /// A field that may be absent or null.
    fn opt_value(&self, key: &str) -> Option<&Value> {
        match self.0.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    fn opt_int<T: TryFrom<i128>>(&self, key: &str, ty: &str) -> Result<Option<T>, LineError> {
        match self.opt_value(key) {
            None => Ok(None),
            Some(v) => int_value(v, key, ty).map(Some),
        }
    }

    fn int<T: TryFrom<i128>>(&self, key: &str, ty: &str) -> Result<T, LineError> {
        self.opt_int(key, ty)?
            .ok_or_else(|| err(key, format!("required field is missing or null ({ty})")))
    }

    fn opt_str(&self, key: &str) -> Result<Option<String>, LineError> {
        match self.opt_value(key) {
            None => Ok(None),
            Some(Value::String(s)) if s.len() > MAX_STRING_BYTES => Err(err(
                key,
                format!(
                    "{} bytes long; a string field holds at most {MAX_STRING_BYTES} bytes (UTF-8)",
                    s.len()
                ),
            )),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(err(key, format!("expected a string, got {v}"))),
        }
    }

    fn opt_hash(&self, key: &str) -> Result<Option<[u8; 32]>, LineError> {
        match self.opt_str(key)? {
            None => Ok(None),
            Some(s) => parse_hex32(&s)
                .map(Some)
                .ok_or_else(|| err(key, "expected 64 hex digits (a blake3 digest)")),
        }
    }

    fn check_keys(&self, known: &[&str]) -> Result<(), LineError> {
        // Report the first unknown key in sorted order (deterministic).
        let mut unknown: Vec<&String> = self
            .0
            .keys()
            .filter(|k| !known.contains(&k.as_str()) && !k.starts_with("x_"))
            .collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => Err(err(
                k,
                "unknown field (misspelt? engine-specific fields must start with `x_`)",
            )),
        }
    }
}

/// `v` as an integer of type `T` (named `ty` in errors), for `field`.
fn int_value<T: TryFrom<i128>>(v: &Value, field: &str, ty: &str) -> Result<T, LineError> {
    let n: Option<i128> = v
        .as_u64()
        .map(i128::from)
        .or_else(|| v.as_i64().map(i128::from));
    match n {
        Some(n) => T::try_from(n).map_err(|_| err(field, format!("{n} does not fit {ty}"))),
        None => Err(err(field, format!("expected an integer ({ty}), got {v}"))),
    }
}

/// A line's top-level JSON value: an object (with the first key it names
/// twice, if any; the first value is kept) or anything else.
enum Top {
    Object(Map<String, Value>, Option<String>),
    Other,
}

impl<'de> serde::Deserialize<'de> for Top {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Top, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Top;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> std::result::Result<Top, A::Error> {
                let mut map = Map::new();
                let mut dup = None;
                while let Some((k, v)) = a.next_entry::<String, Value>()? {
                    if map.contains_key(&k) {
                        dup.get_or_insert(k);
                    } else {
                        map.insert(k, v);
                    }
                }
                Ok(Top::Object(map, dup))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Top, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Top::Other)
            }
            fn visit_bool<E>(self, _: bool) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_i64<E>(self, _: i64) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_u64<E>(self, _: u64) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_f64<E>(self, _: f64) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_str<E>(self, _: &str) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_unit<E>(self) -> std::result::Result<Top, E> {
                Ok(Top::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses one line of the JSONL import format (see docs/jsonl.md).
///
/// Checks everything that can be checked without the deployment (types,
/// ranges, op names, slot_count ≥ 1, src fields all-or-none and on `write`
/// only, request_id ≠ 0 for requests). Pool ids and extents are checked by
/// the [`Recorder`].
pub fn parse_line(line: &str) -> Result<JsonlRecord, LineError> {
    let top: Top = serde_json::from_str(line).map_err(|e| LineError {
        field: None,
        message: format!("not valid JSON: {e}"),
        pool: None,
    })?;
    let Top::Object(map, dup) = &top else {
        return Err(LineError {
            field: None,
            message: "expected a JSON object".into(),
            pool: None,
        });
    };
    if let Some(k) = dup {
        // Readers disagree on which of two equal keys counts (serde_json:
        // the last, others the first): a line naming a key twice is refused.
        return Err(err(
            k,
            "duplicate key: the line names it more than once; keep one",
        ));
    }
    let o = Obj(map);
    match o.opt_value("type") {
        Some(Value::String(t)) if t == "kv" => {
            // Read the pool first so a later failure can still name it.
            let pool: u16 = o.int("pool", "UInt16")?;
            parse_kv(&o, pool).map_err(|mut e| {
                e.pool = Some(pool);
                e
            })
        }
        Some(Value::String(t)) if t == "request" => parse_request(&o),
        Some(v) => Err(err(
            "type",
            format!("expected \"kv\" or \"request\", got {v}"),
        )),
        None => Err(err(
            "type",
            "missing: every line needs \"type\": \"kv\" or \"request\"",
        )),
    }
}

fn parse_kv(o: &Obj, pool: u16) -> Result<JsonlRecord, LineError> {
    o.check_keys(&KV_KEYS)?;
    if let Some(runs) = o.opt_value("runs") {
        return parse_kv_runs(o, pool, runs);
    }
    let seq: Option<u64> = o.opt_int("seq", "UInt64")?;
    let op = parse_op(o)?;
    let slot_count: u32 = o.int("slot_count", "UInt32")?;
    if slot_count == 0 {
        return Err(err(
            "slot_count",
            "slot_count is 0; an extent covers at least one slot",
        ));
    }
    let src_pool: Option<u16> = o.opt_int("src_pool", "UInt16")?;
    let src_slot_start: Option<u32> = o.opt_int("src_slot_start", "UInt32")?;
    let src_seq: Option<u64> = o.opt_int("src_seq", "UInt64")?;
    let src = match (src_pool, src_slot_start, src_seq) {
        (None, None, None) => None,
        (Some(pool), Some(slot_start), Some(seq)) => Some(CopySrc {
            pool,
            slot_start,
            seq,
        }),
        (p, s, _) => {
            let missing = if p.is_none() {
                "src_pool"
            } else if s.is_none() {
                "src_slot_start"
            } else {
                "src_seq"
            };
            return Err(err(
                missing,
                "a copy needs src_pool, src_slot_start and src_seq together; this one is partial",
            ));
        }
    };
    if src.is_some() && op != Op::Write {
        return Err(err(
            "src_pool",
            format!("src is set on a `{op}` event; only `write` copies"),
        ));
    }
    if let Some(s) = seq {
        reader_rule("seq", crate::trace::read::check_seq(|| at("seq"), s))?;
    }
    let event = KvEvent {
        pool,
        seq: seq.unwrap_or(0),
        ts_ns: o.int("ts_ns", "Int64")?,
        request_id: o.int("request_id", "UInt64")?,
        op,
        slot_start: o.int("slot_start", "UInt32")?,
        slot_count,
        token_pos: o.opt_int("token_pos", "UInt32")?,
        src,
    };
    check_kv(&event)?;
    Ok(JsonlRecord::Kv { event, seq })
}

fn parse_op(o: &Obj) -> Result<Op, LineError> {
    match o.opt_value("op") {
        Some(Value::String(s)) => Op::parse(s).ok_or_else(|| {
            err(
                "op",
                format!("unknown op {s:?}: expected alloc, write, read, free, share or scrub"),
            )
        }),
        Some(v) => Err(err("op", format!("expected a string, got {v}"))),
        None => Err(err("op", "required field is missing or null")),
    }
}

/// A KV line of several runs: `"runs":[[slot_start,slot_count,token_pos],...]`
/// (`token_pos` null or left out), one event per run, in order. Every run
/// is checked before any is taken; no seq and no copy (docs/jsonl.md).
fn parse_kv_runs(o: &Obj, pool: u16, runs: &Value) -> Result<JsonlRecord, LineError> {
    if let Some(k) = NOT_WITH_RUNS.iter().find(|k| o.opt_value(k).is_some()) {
        return Err(err(
            k,
            "not allowed beside `runs`: each run gives its slot_start, slot_count and \
             token_pos, and a line with runs carries no seq and no copy (send those as \
             one line per event)",
        ));
    }
    let op = parse_op(o)?;
    let ts_ns: i64 = o.int("ts_ns", "Int64")?;
    let request_id: u64 = o.int("request_id", "UInt64")?;
    let Value::Array(rs) = runs else {
        return Err(err(
            "runs",
            "expected an array of [slot_start, slot_count, token_pos] runs",
        ));
    };
    if rs.is_empty() || rs.len() > MAX_LINE_RUNS {
        return Err(err(
            "runs",
            format!(
                "{} runs; a line carries 1 to {MAX_LINE_RUNS} (split longer lists over lines)",
                rs.len()
            ),
        ));
    }
    let mut events = Vec::with_capacity(rs.len());
    for (i, r) in rs.iter().enumerate() {
        let field = format!("runs[{i}]");
        let run = match r {
            Value::Array(a) if (2..=3).contains(&a.len()) => a,
            _ => {
                return Err(err(
                    &field,
                    "expected [slot_start, slot_count] or [slot_start, slot_count, token_pos]",
                ));
            }
        };
        let slot_start: u32 = int_value(&run[0], &field, "UInt32")?;
        let slot_count: u32 = int_value(&run[1], &field, "UInt32")?;
        if slot_count == 0 {
            return Err(err(
                &field,
                "slot_count is 0; an extent covers at least one slot",
            ));
        }
        let token_pos = match run.get(2) {
            None | Some(Value::Null) => None,
            Some(v) => Some(int_value::<u32>(v, &field, "UInt32")?),
        };
        events.push(KvEvent::unsequenced(
            pool, ts_ns, request_id, op, slot_start, slot_count, token_pos,
        ));
    }
    // The reader's rules look at the request id only: alike for every run.
    check_kv(&events[0])?;
    Ok(JsonlRecord::KvRuns(events))
}

/// The reader's rules on a KV event's own values (crate::trace::read): the
/// reserved request ids and src_seq. Pools and extents need the deployment
/// and are the [`Recorder`]'s; the record sidecar's fast paths call this
/// too, so nothing a capture writes is refused by a reader.
pub fn check_kv(event: &KvEvent) -> Result<(), LineError> {
    use crate::trace::read::{check_request_id, check_seq};
    reader_rule(
        "request_id",
        check_request_id(|| at("request_id"), event.request_id),
    )?;
    if let Some(src) = event.src {
        reader_rule("src_seq", check_seq(|| at("src_seq"), src.seq))?;
    }
    Ok(())
}

/// The reader's request-id rule, for any line naming a request.
pub fn check_request_id(id: u64) -> Result<(), LineError> {
    reader_rule(
        "request_id",
        crate::trace::read::check_request_id(|| at("request_id"), id),
    )
}

fn at(col: &str) -> Location {
    Location::default().column(col)
}

/// A reader rule's error as a line error on `field`.
fn reader_rule(field: &str, r: Result<()>) -> Result<(), LineError> {
    r.map_err(|e| match e {
        Error::Invalid { what, .. } => err(field, what),
        other => err(field, other.to_string()),
    })
}

fn parse_request(o: &Obj) -> Result<JsonlRecord, LineError> {
    o.check_keys(&REQ_KEYS)?;
    let request_id: u64 = o.int("request_id", "UInt64")?;
    if request_id == 0 {
        return Err(err(
            "request_id",
            "request_id 0 is reserved for the engine itself",
        ));
    }
    check_request_id(request_id)?;
    let tenant = o
        .opt_str("tenant")?
        .ok_or_else(|| err("tenant", "required field is missing or null"))?;
    Ok(JsonlRecord::Request(RequestRecord {
        request_id,
        external_id: o.opt_str("external_id")?,
        tenant,
        arrival_ns: o.int("arrival_ns", "Int64")?,
        finish_ns: o.opt_int("finish_ns", "Int64")?,
        prompt_tokens: o.int("prompt_tokens", "UInt32")?,
        prefilled_tokens: o.opt_int("prefilled_tokens", "UInt32")?,
        output_tokens: o.int("output_tokens", "UInt32")?,
        http_status: o.int("http_status", "UInt16")?,
        finish_reason: o.opt_str("finish_reason")?,
        prefill_pool: o.opt_int("prefill_pool", "UInt16")?,
        decode_pool: o.opt_int("decode_pool", "UInt16")?,
        prompt_hash: o.opt_hash("prompt_hash")?,
        output_hash: o.opt_hash("output_hash")?,
    }))
}

/// Reads a deployment file: either the `deployment` object of trace.json,
/// or a whole trace.json manifest (its `deployment` is used), read by
/// trace.json's own rules ([`Deployment::load`]).
pub fn load_deployment(path: &Path) -> Result<Deployment> {
    Deployment::load(path)
}

/// How `ingest` treats malformed lines.
#[derive(Debug, Clone, Default)]
pub struct IngestOptions {
    /// Count and skip malformed lines instead of stopping at the first.
    pub skip_bad_lines: bool,
    pub recorder: RecorderOptions,
}

/// A line that was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    /// 1-based line number.
    pub line: u64,
    pub error: String,
}

/// What `ingest` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestReport {
    pub lines: u64,
    pub kv_events: u64,
    pub requests: u64,
    pub skipped_lines: u64,
    /// The first [`MAX_SKIPPED_LISTED`] skipped lines.
    pub skipped: Vec<SkippedLine>,
    pub complete: bool,
    pub files: usize,
}

/// How many skipped lines an [`IngestReport`] lists (all are counted).
pub const MAX_SKIPPED_LISTED: usize = 20;

/// The error for a bad line: file and 1-based line number, field, message.
fn line_error(path: &Path, line: u64, e: &LineError) -> Error {
    Error::invalid(
        Location::file(&PathBuf::from(format!("{}:{line}", path.display()))),
        e.to_string(),
        "fix the line (docs/jsonl.md), or pass --skip-bad-lines to count and skip malformed lines",
    )
}

/// Converts a JSONL stream into a v1 trace at `out` (see docs/jsonl.md).
///
/// Streaming: memory is the recorder's row buffers, whatever the input
/// size. The capture's time range comes from the data, so the same input
/// gives byte-identical output.
pub fn ingest(
    input: impl BufRead,
    input_name: &Path,
    deployment: Deployment,
    out: &Path,
    opts: IngestOptions,
) -> Result<IngestReport> {
    let mut ropts = opts.recorder.clone();
    // Data-derived time range: started_ns is set from the first timestamp
    // seen (so a crash mid-import leaves a sensible manifest) and lowered to
    // the smallest one before close.
    ropts.started_ns = Some(ropts.started_ns.unwrap_or(0));
    // What is there before, so a failed import removes only what it made.
    let existed: Vec<bool> = std::iter::once(out.to_path_buf())
        .chain(OWNED.iter().map(|p| out.join(p)))
        .map(|p| p.exists())
        .collect();
    let mut rec = Recorder::create(out, deployment, ropts)?;
    let res = ingest_lines(input, input_name, &mut rec, &opts);
    let report = match res {
        Ok(r) => r,
        Err(e) => {
            // Nothing half-written is left behind to be mistaken for a
            // trace: the user fixes the input (or skips bad lines) and
            // runs again with the same --out.
            drop(rec);
            if !existed[0] {
                let _ = std::fs::remove_dir_all(out);
            } else {
                for (p, was) in OWNED.iter().zip(&existed[1..]) {
                    let p = out.join(p);
                    if !was {
                        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
                    }
                }
            }
            return Err(e);
        }
    };
    let mut report = report;
    if report.skipped_lines > 0 {
        rec.set_capture_extra("skipped_lines", report.skipped_lines.into());
    }
    // No KV events is no evidence (an empty file, or the wrong one): such
    // a trace is never a complete capture.
    if report.kv_events == 0 {
        rec.set_capture_extra("no_kv_events", true.into());
    }
    report.complete = report.skipped_lines == 0 && report.kv_events > 0;
    if report.complete {
        rec.close()?;
    } else {
        rec.close_unclean()?;
    }
    report.files = crate::trace::read::list_parquet(&out.join("kv"))?.len()
        + crate::trace::read::list_parquet(&out.join("requests"))?.len();
    Ok(report)
}

/// What a Recorder creates inside its directory.
const OWNED: [&str; 4] = ["trace.json", ".trace.json.tmp", "kv", "requests"];

fn ingest_lines(
    input: impl BufRead,
    input_name: &Path,
    rec: &mut Recorder,
    opts: &IngestOptions,
) -> Result<IngestReport> {
    let mut report = IngestReport::default();
    let mut min_ts = i64::MAX;
    let mut buf = Vec::new();
    let mut input = input;
    let mut lineno = 0u64;
    while let Some(fits) =
        read_line_bounded(&mut input, &mut buf).map_err(|e| Error::io(input_name, e))?
    {
        lineno += 1;
        let mut bytes = &buf[..];
        if lineno == 1 {
            // A byte-order mark (Windows writers) is tolerated before line 1
            // only, as trace.json tolerates one before its text.
            bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
        }
        let text = if fits {
            std::str::from_utf8(bytes).map_err(|e| LineError {
                field: None,
                message: format!(
                    "not UTF-8 (an invalid byte at column {})",
                    e.valid_up_to() + 1
                ),
                pool: None,
            })
        } else {
            Err(LineError {
                field: None,
                message: format!(
                    "longer than {MAX_LINE_BYTES} bytes, the longest line read (skipped unread)"
                ),
                pool: None,
            })
        };
        let line = match &text {
            Ok(t) => t.trim_end_matches(['\n', '\r']),
            Err(_) => "",
        };
        if text.is_ok() && line.trim().is_empty() {
            continue;
        }
        report.lines += 1;
        let first = min_ts == i64::MAX;
        let parsed = text
            .and_then(|_| parse_line(line))
            .map_err(|e| (e, line_runs(line).unwrap_or(1)))
            .and_then(|r| {
                apply(
                    rec,
                    r,
                    opts.skip_bad_lines,
                    &mut min_ts,
                    &mut report.kv_events,
                )
            });
        if first && min_ts != i64::MAX {
            rec.set_started_ns(min_ts);
        }
        match parsed {
            Ok(true) => {}
            Ok(false) => report.requests += 1,
            Err((e, lost)) if opts.skip_bad_lines => {
                report.skipped_lines += 1;
                if report.skipped.len() < MAX_SKIPPED_LISTED {
                    report.skipped.push(SkippedLine {
                        line: lineno,
                        error: e.to_string(),
                    });
                }
                // A lost KV event with recorder-assigned seqs would vanish
                // without trace: make the loss an explicit hole instead.
                // (With seqs on the lines, the hole is there already.)
                // (A line of several runs refused whole: as many as it
                // lists; a run the recorder refused is a hole of its own,
                // made in `apply`, the line's other runs recorded, as the
                // sidecar does: `lost` is 0.)
                if let Some(pool) = e.pool
                    && lost > 0
                    && rec.next_seq(pool).is_ok()
                    && !line_has_seq(line)
                {
                    rec.lose(pool, lost)?;
                }
            }
            Err((e, _)) => return Err(line_error(input_name, lineno, &e)),
        }
    }
    if min_ts != i64::MAX {
        rec.set_started_ns(min_ts);
    } else {
        rec.set_started_ns(0);
    }
    Ok(report)
}

/// Reads one line (its newline included) into `buf`, keeping at most
/// [`MAX_LINE_BYTES`] of it: the rest of a longer line is consumed unread.
/// `None` at the end of input; `Some(false)` for a line over the limit.
fn read_line_bounded(r: &mut impl BufRead, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
    buf.clear();
    let mut fits = true;
    let mut any = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(any.then_some(fits));
        }
        any = true;
        let (chunk, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..=i], true),
            None => (avail, false),
        };
        let n = chunk.len();
        if fits {
            // The newline does not count.
            if buf.len() + n - usize::from(done) > MAX_LINE_BYTES {
                fits = false;
                *buf = Vec::new();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        r.consume(n);
        if done {
            return Ok(Some(fits));
        }
    }
}

/// How many runs a (malformed) line lists in an array `runs` (1 to
/// [`MAX_LINE_RUNS`]): the events its emitter counted for it, so a line
/// refused whole is a hole of that many.
pub fn line_runs(line: &str) -> Option<u64> {
    let v = serde_json::from_str::<Value>(line).ok()?;
    let n = v.get("runs")?.as_array()?.len();
    (n > 0).then(|| n.min(MAX_LINE_RUNS) as u64)
}

/// Whether a (malformed) line still carries an integer `seq`.
fn line_has_seq(line: &str) -> bool {
    serde_json::from_str::<Value>(line)
        .ok()
        .and_then(|v| v.get("seq").and_then(Value::as_u64))
        .is_some()
}

/// Hands a parsed record to the recorder, counting its KV events in
/// `events`. Returns true for KV events; an error comes with how many of
/// the line's events were not recorded and are no hole yet. With `skip`
/// (`--skip-bad-lines`), a run of a line of several runs that the recorder
/// refuses (an extent outside the pool) is a hole of one event and the
/// line's other runs are recorded, as the sidecar does; the first such
/// error is returned, with 0.
fn apply(
    rec: &mut Recorder,
    r: JsonlRecord,
    skip: bool,
    min_ts: &mut i64,
    events: &mut u64,
) -> Result<bool, (LineError, u64)> {
    let from_recorder = |pool: Option<u16>| {
        move |e: Error| match e {
            Error::Invalid { loc, what, .. } => LineError {
                field: loc.column,
                message: what,
                pool,
            },
            other => LineError {
                field: None,
                message: other.to_string(),
                pool,
            },
        }
    };
    match r {
        JsonlRecord::Kv { event, seq } => {
            let pool = Some(event.pool);
            let res = match seq {
                Some(_) => rec.kv_with_seq(event),
                None => rec.kv(event).map(|_| ()),
            };
            res.map_err(|e| (from_recorder(pool)(e), 1))?;
            *min_ts = (*min_ts).min(event.ts_ns);
            *events += 1;
            Ok(true)
        }
        JsonlRecord::KvRuns(evs) => {
            let n = evs.len() as u64;
            let mut first: Option<LineError> = None;
            for (i, event) in evs.into_iter().enumerate() {
                let pool = Some(event.pool);
                match rec.kv(event) {
                    Ok(_) => {
                        *min_ts = (*min_ts).min(event.ts_ns);
                        *events += 1;
                    }
                    Err(e) => {
                        let named = |e| {
                            let mut e = from_recorder(pool)(e);
                            e.field = Some(format!("runs[{i}]"));
                            e
                        };
                        if !skip {
                            return Err((named(e), n - i as u64));
                        }
                        if rec.next_seq(event.pool).is_ok() {
                            rec.lose(event.pool, 1)
                                .map_err(|e| (from_recorder(pool)(e), 0))?;
                        }
                        // The first refused run names the line; a line of
                        // many such runs builds one message, not one a run.
                        if first.is_none() {
                            first = Some(named(e));
                        }
                    }
                }
            }
            match first {
                None => Ok(true),
                Some(e) => Err((e, 0)),
            }
        }
        JsonlRecord::Request(r) => {
            let ts = r.arrival_ns;
            rec.request(r).map_err(|e| (from_recorder(None)(e), 1))?;
            *min_ts = (*min_ts).min(ts);
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(line: &str, expect: &str) {
        let got = match parse_line(line) {
            Ok(JsonlRecord::Kv { event, seq }) => format!(
                "kv pool={} seq={seq:?} ts={} rid={} {} {}+{} tp={:?} src={:?}",
                event.pool,
                event.ts_ns,
                event.request_id,
                event.op,
                event.slot_start,
                event.slot_count,
                event.token_pos,
                event.src.map(|s| (s.pool, s.slot_start, s.seq))
            ),
            Ok(JsonlRecord::Request(r)) => format!(
                "request {} {} prompt={} prefilled={:?} status={} hash={}",
                r.request_id,
                r.tenant,
                r.prompt_tokens,
                r.prefilled_tokens,
                r.http_status,
                r.prompt_hash.is_some()
            ),
            Ok(JsonlRecord::KvRuns(evs)) => {
                let runs: Vec<String> = evs
                    .iter()
                    .map(|e| format!("{}+{} tp={:?}", e.slot_start, e.slot_count, e.token_pos))
                    .collect();
                let e = &evs[0];
                format!(
                    "kv runs pool={} ts={} rid={} {} [{}]",
                    e.pool,
                    e.ts_ns,
                    e.request_id,
                    e.op,
                    runs.join(", ")
                )
            }
            Err(e) => format!("error {e}"),
        };
        assert_eq!(got, expect, "line: {line}");
    }

    #[test]
    fn lines() {
        let h = "ab".repeat(32);
        // 128 two-byte characters: exactly the 256-byte limit.
        let e128 = format!(
            "request 1 {} prompt=1 prefilled=None status=200 hash=false",
            "é".repeat(128)
        );
        let cases: Vec<(String, &str)> = vec![
            (r#"{"type":"kv","pool":1,"seq":17,"ts_ns":5,"request_id":3,"op":"write","slot_start":8,"slot_count":4,"token_pos":null,"src_pool":0,"src_slot_start":2,"src_seq":9}"#.into(),
             "kv pool=1 seq=Some(17) ts=5 rid=3 write 8+4 tp=None src=Some((0, 2, 9))"),
            (r#"{"type":"kv","pool":0,"ts_ns":-1,"request_id":0,"op":"scrub","slot_start":0,"slot_count":1}"#.into(),
             "kv pool=0 seq=None ts=-1 rid=0 scrub 0+1 tp=None src=None"),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":3,"token_pos":5,"x_layer":"all"}"#.into(),
             "kv pool=0 seq=None ts=1 rid=2 read 0+3 tp=Some(5) src=None"),
            (format!(r#"{{"type":"request","request_id":4,"tenant":"acme","arrival_ns":1,"prompt_tokens":900,"prefilled_tokens":1,"output_tokens":3,"http_status":200,"prompt_hash":"{h}"}}"#),
             "request 4 acme prompt=900 prefilled=Some(1) status=200 hash=true"),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"wrte","slot_start":0,"slot_count":3}"#.into(),
             r#"error field `op`: unknown op "wrte": expected alloc, write, read, free, share or scrub"#),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":0}"#.into(),
             "error field `slot_count`: slot_count is 0; an extent covers at least one slot"),
            (r#"{"type":"kv","pool":70000,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1}"#.into(),
             "error field `pool`: 70000 does not fit UInt16"),
            (r#"{"type":"kv","pool":0,"ts_ns":"1","request_id":2,"op":"read","slot_start":0,"slot_count":1}"#.into(),
             r#"error field `ts_ns`: expected an integer (Int64), got "1""#),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1,"src_pool":1}"#.into(),
             "error field `src_slot_start`: a copy needs src_pool, src_slot_start and src_seq together; this one is partial"),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1,"src_pool":1,"src_slot_start":0,"src_seq":0}"#.into(),
             "error field `src_pool`: src is set on a `read` event; only `write` copies"),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1,"tokenpos":3}"#.into(),
             "error field `tokenpos`: unknown field (misspelt? engine-specific fields must start with `x_`)"),
            (r#"{"type":"kv","pool":0,"ts_ns":1,"op":"read","slot_start":0,"slot_count":1}"#.into(),
             "error field `request_id`: required field is missing or null (UInt64)"),
            (r#"{"type":"request","request_id":0,"tenant":"a","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}"#.into(),
             "error field `request_id`: request_id 0 is reserved for the engine itself"),
            (r#"{"type":"request","request_id":1,"tenant":"a","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200,"prompt_hash":"abc"}"#.into(),
             "error field `prompt_hash`: expected 64 hex digits (a blake3 digest)"),
            (r#"{"type":"request","request_id":1,"arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}"#.into(),
             "error field `tenant`: required field is missing or null"),
            (r#"{"type":"span"}"#.into(), r#"error field `type`: expected "kv" or "request", got "span""#),
            (format!(r#"{{"type":"request","request_id":1,"tenant":"{}","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#, "é".repeat(128)),
             &e128),
            (format!(r#"{{"type":"request","request_id":1,"tenant":"{}","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#, "t".repeat(257)),
             "error field `tenant`: 257 bytes long; a string field holds at most 256 bytes (UTF-8)"),
            (format!(r#"{{"type":"request","request_id":1,"tenant":"a","external_id":"{}","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#, "x".repeat(1 << 20)),
             "error field `external_id`: 1048576 bytes long; a string field holds at most 256 bytes (UTF-8)"),
            (format!(r#"{{"type":"request","request_id":1,"tenant":"a","finish_reason":"{}","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#, "x".repeat(300)),
             "error field `finish_reason`: 300 bytes long; a string field holds at most 256 bytes (UTF-8)"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":[[16,16,0],[48,4],[64,1,null]]}"#.into(),
             "kv runs pool=2 ts=9 rid=4 read [16+16 tp=Some(0), 48+4 tp=None, 64+1 tp=None]"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":[[16,16,0],[48,0,4]]}"#.into(),
             "error field `runs[1]`: slot_count is 0; an extent covers at least one slot"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":[[16,16,0],"a"]}"#.into(),
             "error field `runs[1]`: expected [slot_start, slot_count] or [slot_start, slot_count, token_pos]"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":[[16,16,-1]]}"#.into(),
             "error field `runs[0]`: -1 does not fit UInt32"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":[]}"#.into(),
             "error field `runs`: 0 runs; a line carries 1 to 65536 (split longer lists over lines)"),
            (r#"{"type":"kv","pool":2,"seq":3,"ts_ns":9,"request_id":4,"op":"read","runs":[[1,1]]}"#.into(),
             "error field `seq`: not allowed beside `runs`: each run gives its slot_start, slot_count and token_pos, and a line with runs carries no seq and no copy (send those as one line per event)"),
            (r#"{"type":"kv","pool":2,"ts_ns":9,"request_id":4,"op":"read","runs":null,"slot_start":1,"slot_count":1}"#.into(),
             "kv pool=2 seq=None ts=9 rid=4 read 1+1 tp=None src=None"),
            ("[1,2]".into(), "error expected a JSON object"),
            (r#"{"type":"kv","pool":0,"#.into(), "error not valid JSON: EOF while parsing a value at line 1 column 22"),
        ];
        for (line, expect) in &cases {
            check(line, expect);
        }
    }

    proptest::proptest! {
        /// Arbitrary bytes spliced into a valid line never panic the parser.
        #[test]
        fn parse_line_never_panics(at in 0usize..400, junk in ".{0,12}", cut in 0usize..400) {
            let good = r#"{"type":"kv","pool":1,"seq":17,"ts_ns":5,"request_id":3,"op":"write","slot_start":8,"slot_count":4,"token_pos":null,"src_pool":0,"src_slot_start":2,"src_seq":9}"#;
            let mut line: String = good.chars().take(at % good.len()).collect();
            line.push_str(&junk);
            line.extend(good.chars().skip(cut % good.len()));
            let _ = parse_line(&line);
        }
    }
}
