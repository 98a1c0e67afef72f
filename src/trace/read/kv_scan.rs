//! The planning columns of a kv file (pool, seq, slot_count, the copy
//! source), read without the rest of each row.

use std::path::Path;

use arrow_array::RecordBatch;

use crate::error::{Error, Location, Result};
use crate::schema::{CopySrc, kv_col};
use crate::trace::hive::{self};
use crate::trace::manifest::Deployment;
use crate::trace::read::column::{Col, opt};
use crate::trace::read::parquet_file::{Cursor, open_builder, project};
use crate::trace::read::values::{
    Capacities, Extent, MAX_SEQ, SAME_POOL_COPY_HINT, check_extent, check_same_pool_copy, check_seq,
};
use crate::trace::root::TraceRoot;

/// A light view of one batch of a kv file: only what replay needs to plan
/// its merge (seq order per pool) and its copies (which source states a
/// later copy will ask for). Columns are projected, so this is much cheaper
/// than decoding whole events.
#[derive(Debug, Clone, Default)]
pub struct KvScanBatch {
    /// Row (0-based, within the file) of the first entry.
    pub first_row: u64,
    pub pool: Vec<u16>,
    pub seq: Vec<u64>,
    /// Copies in this batch: (row within batch, source).
    pub copies: Vec<(u32, CopySrc, u32)>,
}

/// Streams the planning columns of one kv file (pool, seq, slot_count and
/// the src columns), batch by batch.
pub struct KvScanReader {
    cur: Cursor,
    /// The deployment's pools: a copy's source extent is checked here,
    /// since replay captures the source before the copy's row is decoded.
    capacity: Capacities,
}

impl KvScanReader {
    /// Opens the kv file at `path` of the trace at `root`.
    pub fn open(root: &TraceRoot, path: &Path, deployment: &Deployment) -> Result<Self> {
        Self::open_groups(root, path, deployment, None)
    }

    /// The row groups of the kv file at `path`: rows in each, in file
    /// order (from its footer).
    pub fn row_groups(root: &TraceRoot, path: &Path) -> Result<Vec<u64>> {
        let builder = open_builder(root, path)?;
        Ok(builder
            .metadata()
            .row_groups()
            .iter()
            .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
            .collect())
    }

    /// As `open`, reading only the row groups `groups` (None: all): rows
    /// are numbered within the whole file, so errors name the file's row.
    pub fn open_groups(
        root: &TraceRoot,
        path: &Path,
        deployment: &Deployment,
        groups: Option<std::ops::Range<usize>>,
    ) -> Result<Self> {
        let mut builder = open_builder(root, path)?;
        let mut first_row = 0u64;
        if let Some(g) = groups {
            let before = g.start.min(builder.metadata().num_row_groups());
            first_row = builder.metadata().row_groups()[..before]
                .iter()
                .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
                .fold(0u64, u64::saturating_add);
            let n = builder.metadata().num_row_groups();
            builder = builder.with_row_groups(g.filter(|&i| i < n).collect());
        }
        let required = [kv_col::POOL, kv_col::SEQ, kv_col::SLOT_COUNT];
        let optional = [kv_col::SRC_POOL, kv_col::SRC_SLOT_START, kv_col::SRC_SEQ];
        let hive = hive::pairs(path, &[&required[..], &optional[..]].concat())?;
        let reader = project(path, builder, &required, &optional, &hive)?;
        Ok(KvScanReader {
            cur: Cursor::new(root, path, hive, reader).starting_at(first_row),
            capacity: Capacities::of(deployment),
        })
    }

    fn decode(&self, batch: &RecordBatch) -> Result<KvScanBatch> {
        let p = &self.cur.path;
        let r0 = self.cur.rows;
        let c = |name| Col::get(batch, p, r0, name);
        let (cpool, cseq, ccount) = (c(kv_col::POOL), c(kv_col::SEQ), c(kv_col::SLOT_COUNT));
        for col in [&cpool, &cseq, &ccount] {
            col.check_no_nulls()?;
        }
        let pool = cpool.ints::<u16>("UInt16")?.into_owned();
        let seq = cseq.ints::<u64>("UInt64")?.into_owned();
        if let Some(i) = seq.iter().position(|&s| s > MAX_SEQ) {
            check_seq(|| cseq.loc(i), seq[i])?;
        }
        let mut copies = Vec::new();
        let csp = c(kv_col::SRC_POOL);
        let css = c(kv_col::SRC_SLOT_START);
        let csq = c(kv_col::SRC_SEQ);
        if let (Some(_), Some(_), Some(_)) = (csp.arr, css.arr, csq.arr) {
            let spn = csp.nulls();
            if spn.as_ref().is_none_or(|n| n.null_count() < n.len()) {
                let count = ccount.ints::<u32>("UInt32")?;
                let sp = Some(csp.ints::<u16>("UInt16")?);
                let ss = Some(css.ints::<u32>("UInt32")?);
                let sq = Some(csq.ints::<u64>("UInt64")?);
                let (ssn, sqn) = (css.nulls(), csq.nulls());
                for i in 0..batch.num_rows() {
                    if let (Some(a), Some(b), Some(s)) =
                        (opt(&sp, &spn, i), opt(&ss, &ssn, i), opt(&sq, &sqn, i))
                    {
                        let loc = |col| Location::file(p).row(r0 + i as u64).column(col);
                        check_seq(|| loc(kv_col::SRC_SEQ), s)?;
                        let src = CopySrc {
                            pool: a,
                            slot_start: b,
                            seq: s,
                        };
                        // Replay plans the capture from these columns
                        // before the copy's row is decoded: a copy inside
                        // one pool must read an earlier state of it.
                        if let Err((col, what)) =
                            check_same_pool_copy(pool[i], Some(seq[i]), None, src)
                        {
                            return Err(Error::invalid(loc(col), what, SAME_POOL_COPY_HINT));
                        }
                        // An unknown source pool is refused with the
                        // trace-wide checks (`check::finish`).
                        if let Some(cap) = self.capacity.get(a) {
                            check_extent(
                                || loc(kv_col::SRC_SLOT_START),
                                Extent::Source,
                                a,
                                b,
                                count[i],
                                cap,
                            )?;
                        }
                        copies.push((i as u32, src, count[i]));
                    }
                }
            }
        }
        Ok(KvScanBatch {
            first_row: r0,
            pool,
            seq,
            copies,
        })
    }
}

impl Iterator for KvScanReader {
    type Item = Result<KvScanBatch>;
    fn next(&mut self) -> Option<Self::Item> {
        let batch = match self.cur.batch()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let res = self.decode(&batch);
        Some(self.cur.settle(&batch, res).map(|(_, v)| v))
    }
}
