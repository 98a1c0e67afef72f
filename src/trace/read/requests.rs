//! The requests table's reader: one file streamed as checked rows
//! ([`RequestRows`], read in place) or records.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use arrow_array::{BooleanArray, RecordBatch};
use arrow_buffer::NullBuffer;
use arrow_schema::ArrowError;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowPredicateFn, ParquetRecordBatchReaderBuilder, RowFilter};

use crate::error::{Error, Location, Result};
use crate::schema::{RequestRecord, req_col};
use crate::trace::hive::{self};
use crate::trace::read::column::{Col, Texts, opt};
use crate::trace::read::parquet_file::{Cursor, open_builder, project};
use crate::trace::read::values::{MAX_REQUEST_ID, reserved_id};
use crate::trace::root::TraceRoot;
use crate::trace::store::Source;

const REQ_REQUIRED: [&str; 7] = [
    req_col::REQUEST_ID,
    req_col::TENANT,
    req_col::ARRIVAL_NS,
    req_col::PROMPT_TOKENS,
    req_col::OUTPUT_TOKENS,
    req_col::HTTP_STATUS,
    // listed here so its absence is named; nulls are checked below
    req_col::TENANT,
];
const REQ_OPTIONAL: [&str; 8] = [
    req_col::EXTERNAL_ID,
    req_col::FINISH_NS,
    req_col::PREFILLED_TOKENS,
    req_col::FINISH_REASON,
    req_col::PREFILL_POOL,
    req_col::DECODE_POOL,
    req_col::PROMPT_HASH,
    req_col::OUTPUT_HASH,
];

/// Streams one requests file as checked records.
pub struct RequestFileReader {
    cur: Cursor,
}

impl RequestFileReader {
    /// Opens a requests file on this machine.
    pub fn open(path: &Path) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::open_at(&TraceRoot::Local(dir.to_path_buf()), path)
    }

    /// Opens the requests file at `path` of the trace at `root`.
    pub fn open_at(root: &TraceRoot, path: &Path) -> Result<Self> {
        let builder = open_builder(root, path)?;
        Self::with_builder(root, path, builder)
    }

    /// Opens the requests file at `path` for the rows whose request_id is
    /// in `ids` (sorted): a Parquet row filter decodes the request_id
    /// column of every row and the other columns only for the rows it
    /// keeps. Row numbers then count the rows kept, so errors name the
    /// wrong row: read a file this way only after a full read checked it.
    /// The caller still tests each record's id (a request_id given by a
    /// Hive folder is not filtered here).
    pub fn open_rows(root: &TraceRoot, path: &Path, ids: Arc<[u64]>) -> Result<Self> {
        let builder = open_builder(root, path)?;
        let at = builder
            .schema()
            .fields()
            .iter()
            .position(|f| f.name() == req_col::REQUEST_ID);
        let builder = match at {
            Some(i) => {
                let mask = ProjectionMask::roots(builder.parquet_schema(), [i]);
                let file = path.to_path_buf();
                let keep = ArrowPredicateFn::new(mask, move |batch: RecordBatch| {
                    let col = Col::get(&batch, &file, 0, req_col::REQUEST_ID);
                    let rid = col
                        .ints::<u64>("UInt64")
                        .map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
                    Ok(rid
                        .iter()
                        .map(|id| Some(ids.binary_search(id).is_ok()))
                        .collect::<BooleanArray>())
                });
                builder.with_row_filter(RowFilter::new(vec![Box::new(keep)]))
            }
            None => builder,
        };
        Self::with_builder(root, path, builder)
    }

    fn with_builder(
        root: &TraceRoot,
        path: &Path,
        builder: ParquetRecordBatchReaderBuilder<Source>,
    ) -> Result<Self> {
        let hive = hive::pairs(path, &[&REQ_REQUIRED[..6], &REQ_OPTIONAL[..]].concat())?;
        let reader = project(path, builder, &REQ_REQUIRED[..6], &REQ_OPTIONAL, &hive)?;
        Ok(RequestFileReader {
            cur: Cursor::new(root, path, hive, reader),
        })
    }

    pub fn path(&self) -> &Path {
        &self.cur.path
    }

    /// The next batch's rows, every one checked, handed to `f` with the
    /// batch's first row number (None: the file has no more rows). Nothing
    /// of a row is copied until `f` asks for it ([`RequestRows::record`]).
    pub fn next_rows<R>(
        &mut self,
        f: impl FnOnce(u64, &RequestRows<'_>) -> Result<R>,
    ) -> Option<Result<R>> {
        let batch = match self.cur.batch()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let path = self.cur.path.clone();
        let res = RequestRows::decode(&batch, &path, self.cur.rows);
        let out = self
            .cur
            .settle(&batch, res)
            .and_then(|(first, rows)| f(first, &rows));
        // An error of `f` ends the file too, as a decode error does.
        self.cur.stop_if(out.is_err());
        Some(out)
    }
}

/// One batch of the requests table, every row checked, its columns as
/// read: a row's fields are read in place and a whole record is built
/// only when asked for.
pub struct RequestRows<'a> {
    rid: Cow<'a, [u64]>,
    tenant: Texts,
    arrival: Cow<'a, [i64]>,
    prompt: Cow<'a, [u32]>,
    output: Cow<'a, [u32]>,
    status: Cow<'a, [u16]>,
    ext: Option<Texts>,
    fin: (Option<Cow<'a, [i64]>>, Option<NullBuffer>),
    prefilled: (Option<Cow<'a, [u32]>>, Option<NullBuffer>),
    reason: Option<Texts>,
    prefill_pool: (Option<Cow<'a, [u16]>>, Option<NullBuffer>),
    decode_pool: (Option<Cow<'a, [u16]>>, Option<NullBuffer>),
    prompt_hash: Option<Vec<Option<[u8; 32]>>>,
    output_hash: Option<Vec<Option<[u8; 32]>>>,
}

impl<'a> RequestRows<'a> {
    fn decode(batch: &'a RecordBatch, p: &'a Path, r0: u64) -> Result<Self> {
        let c = |name| Col::get(batch, p, r0, name);
        let (crid, cten, carr, cpt, cot, cst) = (
            c(req_col::REQUEST_ID),
            c(req_col::TENANT),
            c(req_col::ARRIVAL_NS),
            c(req_col::PROMPT_TOKENS),
            c(req_col::OUTPUT_TOKENS),
            c(req_col::HTTP_STATUS),
        );
        for col in [&crid, &cten, &carr, &cpt, &cot, &cst] {
            col.check_no_nulls()?;
        }
        let rid = crid.ints::<u64>("UInt64")?;
        let tenant = cten.texts()?;
        let arrival = carr.ints::<i64>("Int64")?;
        let prompt = cpt.ints::<u32>("UInt32")?;
        let output = cot.ints::<u32>("UInt32")?;
        let status = cst.ints::<u16>("UInt16")?;
        let cext = c(req_col::EXTERNAL_ID);
        let cfin = c(req_col::FINISH_NS);
        let cpf = c(req_col::PREFILLED_TOKENS);
        let cfr = c(req_col::FINISH_REASON);
        let cpp = c(req_col::PREFILL_POOL);
        let cdp = c(req_col::DECODE_POOL);
        let cph = c(req_col::PROMPT_HASH);
        let coh = c(req_col::OUTPUT_HASH);
        let ext = cext.arr.map(|_| cext.texts()).transpose()?;
        let fin = cfin.arr.map(|_| cfin.ints::<i64>("Int64")).transpose()?;
        let pf = cpf.arr.map(|_| cpf.ints::<u32>("UInt32")).transpose()?;
        let reason = cfr.arr.map(|_| cfr.texts()).transpose()?;
        let pp = cpp.arr.map(|_| cpp.ints::<u16>("UInt16")).transpose()?;
        let dp = cdp.arr.map(|_| cdp.ints::<u16>("UInt16")).transpose()?;
        let prompt_hash = cph.arr.map(|_| cph.hashes()).transpose()?;
        let output_hash = coh.arr.map(|_| coh.hashes()).transpose()?;
        for (i, &id) in rid.iter().enumerate() {
            let loc = || {
                Location::file(p)
                    .row(r0 + i as u64)
                    .column(req_col::REQUEST_ID)
            };
            if id == 0 {
                return Err(Error::invalid(
                    loc(),
                    "request_id 0 is reserved for the engine itself",
                    "number requests from 1",
                ));
            }
            if id > MAX_REQUEST_ID {
                return Err(reserved_id(loc(), id));
            }
        }
        Ok(RequestRows {
            rid,
            tenant,
            arrival,
            prompt,
            output,
            status,
            ext,
            fin: (fin, cfin.nulls()),
            prefilled: (pf, cpf.nulls()),
            reason,
            prefill_pool: (pp, cpp.nulls()),
            decode_pool: (dp, cdp.nulls()),
            prompt_hash,
            output_hash,
        })
    }

    pub fn len(&self) -> usize {
        self.rid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rid.is_empty()
    }

    #[inline]
    pub fn request_id(&self, i: usize) -> u64 {
        self.rid[i]
    }

    /// Row `i`'s tenant (a null from a Hive folder reads as "").
    #[inline]
    pub fn tenant(&self, i: usize) -> &str {
        self.tenant.get(i).unwrap_or_default()
    }

    #[inline]
    pub fn prompt_tokens(&self, i: usize) -> u32 {
        self.prompt[i]
    }

    #[inline]
    pub fn prefilled_tokens(&self, i: usize) -> Option<u32> {
        opt(&self.prefilled.0, &self.prefilled.1, i)
    }

    #[inline]
    pub fn http_status(&self, i: usize) -> u16 {
        self.status[i]
    }

    #[inline]
    pub fn prefill_pool(&self, i: usize) -> Option<u16> {
        opt(&self.prefill_pool.0, &self.prefill_pool.1, i)
    }

    #[inline]
    pub fn decode_pool(&self, i: usize) -> Option<u16> {
        opt(&self.decode_pool.0, &self.decode_pool.1, i)
    }

    /// Row `i` as a record.
    pub fn record(&self, i: usize) -> RequestRecord {
        let text = |t: &Option<Texts>| t.as_ref().and_then(|t| t.get(i)).map(str::to_string);
        RequestRecord {
            request_id: self.rid[i],
            external_id: text(&self.ext),
            tenant: self.tenant(i).to_string(),
            arrival_ns: self.arrival[i],
            finish_ns: opt(&self.fin.0, &self.fin.1, i),
            prompt_tokens: self.prompt[i],
            prefilled_tokens: self.prefilled_tokens(i),
            output_tokens: self.output[i],
            http_status: self.status[i],
            finish_reason: text(&self.reason),
            prefill_pool: self.prefill_pool(i),
            decode_pool: self.decode_pool(i),
            prompt_hash: self.prompt_hash.as_ref().and_then(|v| v[i]),
            output_hash: self.output_hash.as_ref().and_then(|v| v[i]),
        }
    }
}

impl Iterator for RequestFileReader {
    type Item = Result<Vec<RequestRecord>>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_rows(|_, rows| Ok((0..rows.len()).map(|i| rows.record(i)).collect()))
    }
}
