//! The requests table's reader: one file streamed as checked records.

use std::path::Path;

use std::sync::Arc;

use arrow_array::{BooleanArray, RecordBatch};
use arrow_schema::ArrowError;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowPredicateFn, ParquetRecordBatchReaderBuilder, RowFilter};

use crate::error::{Error, Location, Result};
use crate::schema::{RequestRecord, req_col};
use crate::trace::hive::{self};
use crate::trace::read::column::{Col, opt};
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

    fn decode(&self, batch: &RecordBatch) -> Result<Vec<RequestRecord>> {
        let p = &self.cur.path;
        let r0 = self.cur.rows;
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
        let mut tenant = cten.strings()?;
        let arr = carr.ints::<i64>("Int64")?;
        let pt = cpt.ints::<u32>("UInt32")?;
        let ot = cot.ints::<u32>("UInt32")?;
        let st = cst.ints::<u16>("UInt16")?;
        let cext = c(req_col::EXTERNAL_ID);
        let cfin = c(req_col::FINISH_NS);
        let cpf = c(req_col::PREFILLED_TOKENS);
        let cfr = c(req_col::FINISH_REASON);
        let cpp = c(req_col::PREFILL_POOL);
        let cdp = c(req_col::DECODE_POOL);
        let cph = c(req_col::PROMPT_HASH);
        let coh = c(req_col::OUTPUT_HASH);
        let mut ext = cext.arr.map(|_| cext.strings()).transpose()?;
        let fin = cfin.arr.map(|_| cfin.ints::<i64>("Int64")).transpose()?;
        let pf = cpf.arr.map(|_| cpf.ints::<u32>("UInt32")).transpose()?;
        let mut fr = cfr.arr.map(|_| cfr.strings()).transpose()?;
        let pp = cpp.arr.map(|_| cpp.ints::<u16>("UInt16")).transpose()?;
        let dp = cdp.arr.map(|_| cdp.ints::<u16>("UInt16")).transpose()?;
        let ph = cph.arr.map(|_| cph.hashes()).transpose()?;
        let oh = coh.arr.map(|_| coh.hashes()).transpose()?;
        let (finn, pfn, ppn, dpn) = (cfin.nulls(), cpf.nulls(), cpp.nulls(), cdp.nulls());
        let n = batch.num_rows();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            if rid[i] == 0 {
                return Err(Error::invalid(
                    Location::file(p)
                        .row(r0 + i as u64)
                        .column(req_col::REQUEST_ID),
                    "request_id 0 is reserved for the engine itself",
                    "number requests from 1",
                ));
            }
            if rid[i] > MAX_REQUEST_ID {
                return Err(reserved_id(
                    Location::file(p)
                        .row(r0 + i as u64)
                        .column(req_col::REQUEST_ID),
                    rid[i],
                ));
            }
            out.push(RequestRecord {
                request_id: rid[i],
                external_id: ext.as_mut().and_then(|v| v[i].take()),
                tenant: tenant[i].take().unwrap_or_default(),
                arrival_ns: arr[i],
                finish_ns: opt(&fin, &finn, i),
                prompt_tokens: pt[i],
                prefilled_tokens: opt(&pf, &pfn, i),
                output_tokens: ot[i],
                http_status: st[i],
                finish_reason: fr.as_mut().and_then(|v| v[i].take()),
                prefill_pool: opt(&pp, &ppn, i),
                decode_pool: opt(&dp, &dpn, i),
                prompt_hash: ph.as_ref().and_then(|v| v[i]),
                output_hash: oh.as_ref().and_then(|v| v[i]),
            });
        }
        Ok(out)
    }
}

impl Iterator for RequestFileReader {
    type Item = Result<Vec<RequestRecord>>;
    fn next(&mut self) -> Option<Self::Item> {
        let batch = match self.cur.batch()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let res = self.decode(&batch);
        Some(self.cur.settle(&batch, res).map(|(_, v)| v))
    }
}
