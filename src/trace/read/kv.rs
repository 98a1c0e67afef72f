//! The kv table's reader: one file streamed as checked events.

use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;

use crate::error::{Error, Location, Result};
use crate::schema::{CopySrc, KvEvent, Op, kv_col};
use crate::trace::hive::{self};
use crate::trace::manifest::Deployment;
use crate::trace::read::column::{Col, opt};
use crate::trace::read::parquet_file::{Cursor, open_builder_dict, project};
use crate::trace::read::values::{
    Capacities, Extent, MAX_REQUEST_ID, SAME_POOL_COPY_HINT, check_extent, check_same_pool_copy,
    check_seq, reserved_id,
};
use crate::trace::root::TraceRoot;

/// Events from one stretch of one kv file.
#[derive(Debug, Clone)]
pub struct KvChunk {
    pub file: PathBuf,
    /// Row (0-based, within the file) of `events[0]`.
    pub first_row: u64,
    pub events: Vec<KvEvent>,
}

/// Streams one kv file as checked events.
pub struct KvFileReader {
    cur: Cursor,
    capacity: Capacities,
    /// A used batch's buffer handed back ([`KvFileReader::recycle`]): the
    /// next batch is decoded into it instead of a new allocation.
    spare: Vec<KvEvent>,
}

const KV_REQUIRED: [&str; 7] = [
    kv_col::POOL,
    kv_col::SEQ,
    kv_col::TS_NS,
    kv_col::REQUEST_ID,
    kv_col::OP,
    kv_col::SLOT_START,
    kv_col::SLOT_COUNT,
];
const KV_OPTIONAL: [&str; 4] = [
    kv_col::TOKEN_POS,
    kv_col::SRC_POOL,
    kv_col::SRC_SLOT_START,
    kv_col::SRC_SEQ,
];

impl KvFileReader {
    /// Opens the kv file at `path` of the trace at `root`.
    pub fn open(root: &TraceRoot, path: &Path, deployment: &Deployment) -> Result<Self> {
        let builder = open_builder_dict(root, path, kv_col::OP)?;
        let hive = hive::pairs(path, &[&KV_REQUIRED[..], &KV_OPTIONAL[..]].concat())?;
        let reader = project(path, builder, &KV_REQUIRED, &KV_OPTIONAL, &hive)?;
        Ok(KvFileReader {
            cur: Cursor::new(root, path, hive, reader),
            capacity: Capacities::of(deployment),
            spare: Vec::new(),
        })
    }

    /// Hands back a batch's buffer once its events are used: the next
    /// batch is decoded into it (the larger of two kept), so a stream of
    /// batches allocates once instead of once per batch.
    pub fn recycle(&mut self, mut buf: Vec<KvEvent>) {
        if buf.capacity() > self.spare.capacity() {
            buf.clear();
            self.spare = buf;
        }
    }

    #[inline]
    fn capacity(&self, pool: u16) -> Option<u64> {
        self.capacity.get(pool)
    }

    fn decode(&mut self, batch: &RecordBatch) -> Result<Vec<KvEvent>> {
        let p = &self.cur.path;
        let r0 = self.cur.rows;
        let c = |name| Col::get(batch, p, r0, name);
        let (cpool, cseq, cts, crid, cop, cstart, ccount) = (
            c(kv_col::POOL),
            c(kv_col::SEQ),
            c(kv_col::TS_NS),
            c(kv_col::REQUEST_ID),
            c(kv_col::OP),
            c(kv_col::SLOT_START),
            c(kv_col::SLOT_COUNT),
        );
        for col in [&cpool, &cseq, &cts, &crid, &cop, &cstart, &ccount] {
            col.check_no_nulls()?;
        }
        let pool = cpool.ints::<u16>("UInt16")?;
        let seq = cseq.ints::<u64>("UInt64")?;
        let ts = cts.ints::<i64>("Int64")?;
        let rid = crid.ints::<u64>("UInt64")?;
        let ops = cop.ops()?;
        let start = cstart.ints::<u32>("UInt32")?;
        let count = ccount.ints::<u32>("UInt32")?;
        let ctp = c(kv_col::TOKEN_POS);
        let csp = c(kv_col::SRC_POOL);
        let css = c(kv_col::SRC_SLOT_START);
        let csq = c(kv_col::SRC_SEQ);
        let tp = ctp.arr.map(|_| ctp.ints::<u32>("UInt32")).transpose()?;
        let sp = csp.arr.map(|_| csp.ints::<u16>("UInt16")).transpose()?;
        let ss = css.arr.map(|_| css.ints::<u32>("UInt32")).transpose()?;
        let sq = csq.arr.map(|_| csq.ints::<u64>("UInt64")).transpose()?;
        let (tpn, spn, ssn, sqn) = (ctp.nulls(), csp.nulls(), css.nulls(), csq.nulls());
        let n = batch.num_rows();
        let mut out = std::mem::take(&mut self.spare);
        out.clear();
        out.reserve(n);
        // (pool, capacity) of the previous row: rows of one pool come in
        // runs. None before the first row (every u16 is a valid pool id).
        let mut last_pool: Option<(u16, u64)> = None;
        for i in 0..n {
            let loc = |col: &str| Location::file(p).row(r0 + i as u64).column(col);
            let cap = match last_pool {
                Some((id, cap)) if id == pool[i] => Some(cap),
                _ => self.capacity(pool[i]),
            }
            .ok_or_else(|| {
                Error::invalid(
                    loc(kv_col::POOL),
                    format!("unknown pool id {}", pool[i]),
                    "every pool id must be listed in trace.json deployment.pools",
                )
            })?;
            last_pool = Some((pool[i], cap));
            check_seq(|| loc(kv_col::SEQ), seq[i])?;
            if rid[i] > MAX_REQUEST_ID {
                return Err(reserved_id(loc(kv_col::REQUEST_ID), rid[i]));
            }
            if count[i] == 0 {
                return Err(Error::invalid(
                    loc(kv_col::SLOT_COUNT),
                    "slot_count is 0",
                    "an extent covers at least one slot; drop empty events",
                ));
            }
            check_extent(
                || loc(kv_col::SLOT_START),
                Extent::Slots,
                pool[i],
                start[i],
                count[i],
                cap,
            )?;
            let src_parts = (opt(&sp, &spn, i), opt(&ss, &ssn, i), opt(&sq, &sqn, i));
            let src = match src_parts {
                (None, None, None) => None,
                (Some(sp), Some(ss), Some(sq)) => {
                    if ops[i] != Op::Write {
                        return Err(Error::invalid(
                            loc(kv_col::SRC_POOL),
                            format!("src_pool is set on a `{}` event", ops[i]),
                            "src columns are for `write` (a copy) only; leave them null otherwise",
                        ));
                    }
                    let scap = self.capacity(sp).ok_or_else(|| {
                        Error::invalid(
                            loc(kv_col::SRC_POOL),
                            format!("unknown src_pool id {sp}"),
                            "every pool id must be listed in trace.json deployment.pools",
                        )
                    })?;
                    let cs = CopySrc {
                        pool: sp,
                        slot_start: ss,
                        seq: sq,
                    };
                    if let Err((col, what)) =
                        check_same_pool_copy(pool[i], Some(seq[i]), Some((start[i], count[i])), cs)
                    {
                        return Err(Error::invalid(loc(col), what, SAME_POOL_COPY_HINT));
                    }
                    check_extent(
                        || loc(kv_col::SRC_SLOT_START),
                        Extent::Source,
                        sp,
                        ss,
                        count[i],
                        scap,
                    )?;
                    check_seq(|| loc(kv_col::SRC_SEQ), sq)?;
                    Some(CopySrc {
                        pool: sp,
                        slot_start: ss,
                        seq: sq,
                    })
                }
                _ => {
                    let missing = if src_parts.0.is_none() {
                        kv_col::SRC_POOL
                    } else if src_parts.1.is_none() {
                        kv_col::SRC_SLOT_START
                    } else {
                        kv_col::SRC_SEQ
                    };
                    return Err(Error::invalid(
                        loc(missing),
                        "a copy needs src_pool, src_slot_start and src_seq together; this one is partial",
                        "set all three src columns on a copy, or none",
                    ));
                }
            };
            out.push(KvEvent {
                pool: pool[i],
                seq: seq[i],
                ts_ns: ts[i],
                request_id: rid[i],
                op: ops[i],
                slot_start: start[i],
                slot_count: count[i],
                token_pos: opt(&tp, &tpn, i),
                src,
            });
        }
        Ok(out)
    }
}

impl Iterator for KvFileReader {
    type Item = Result<KvChunk>;
    fn next(&mut self) -> Option<Self::Item> {
        let batch = match self.cur.batch()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let res = self.decode(&batch);
        Some(
            self.cur
                .settle(&batch, res)
                .map(|(first_row, events)| KvChunk {
                    file: self.cur.path.clone(),
                    first_row,
                    events,
                }),
        )
    }
}
