//! Sorted key files: Parquet files of `(key, value)` pairs of non-negative
//! 64-bit integers, sorted by key then value, in small row groups with
//! min/max statistics, plus string metadata. A look-up reads the footer
//! and only the row groups whose key range holds the key (row-group
//! pruning), so its cost does not grow with the file. `report::lookup_files`
//! keeps scope's request look-up index in one (keys: hashed external
//! ids, output hashes and tenants; values: byte offsets into requests.csv).
//!
//! The writer takes pairs already in order and refuses any that are not;
//! the reader trusts no statistic: every row it returns has exactly the
//! asked key, and a file whose row groups are not in key order, or whose
//! rows contradict their statistics, is an error naming the file.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::{KeyValue, ParquetMetaData};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::statistics::Statistics;

use crate::error::{Error, Location, Result};
use crate::trace::chunked::ChunkedFile;
use crate::trace::guard::guard;
use crate::trace::parquet_error::parquet_error;

/// Rows per row group: one look-up decodes about this many pairs.
pub const ROW_GROUP_ROWS: usize = 8 * 1024;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("key", DataType::Int64, false),
        Field::new("value", DataType::Int64, false),
    ]))
}

/// Writes a sorted key file, pair by pair.
pub struct SortedWriter {
    path: PathBuf,
    w: ArrowWriter<std::io::BufWriter<File>>,
    keys: Vec<i64>,
    values: Vec<i64>,
    last: Option<(u64, u64)>,
    rows: u64,
}

impl SortedWriter {
    /// A writer into `file` (already created, owner-only, by the caller) at
    /// `path` (for messages); `metadata` goes into the footer.
    pub fn new(file: File, path: &Path, metadata: &[(&str, String)]) -> Result<Self> {
        let kv = metadata
            .iter()
            .map(|(k, v)| KeyValue::new(k.to_string(), v.clone()))
            .collect();
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .set_created_by(format!("kvtrail {}", env!("CARGO_PKG_VERSION")))
            .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
            .set_statistics_enabled(EnabledStatistics::Chunk)
            .set_key_value_metadata(Some(kv))
            .build();
        let w = ArrowWriter::try_new(std::io::BufWriter::new(file), schema(), Some(props))
            .map_err(|e| parquet_error(Location::file(path), e))?;
        Ok(SortedWriter {
            path: path.to_path_buf(),
            w,
            keys: Vec::with_capacity(ROW_GROUP_ROWS),
            values: Vec::with_capacity(ROW_GROUP_ROWS),
            last: None,
            rows: 0,
        })
    }

    /// Appends one pair; pairs must come sorted by key, then value, and
    /// both must be below 2^63.
    pub fn push(&mut self, key: u64, value: u64) -> Result<()> {
        if key > i64::MAX as u64 || value > i64::MAX as u64 {
            return Err(Error::Other(format!(
                "{}: key file pair ({key}, {value}) above 2^63",
                self.path.display()
            )));
        }
        if self.last.is_some_and(|l| l > (key, value)) {
            return Err(Error::Other(format!(
                "{}: key file pairs out of order at ({key}, {value})",
                self.path.display()
            )));
        }
        self.last = Some((key, value));
        self.keys.push(key as i64);
        self.values.push(value as i64);
        self.rows += 1;
        if self.keys.len() == ROW_GROUP_ROWS {
            self.flush_batch()?;
        }
        Ok(())
    }

    fn flush_batch(&mut self) -> Result<()> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let k = Int64Array::from(std::mem::take(&mut self.keys));
        let v = Int64Array::from(std::mem::take(&mut self.values));
        let b = RecordBatch::try_new(schema(), vec![Arc::new(k), Arc::new(v)])
            .expect("two non-null Int64 columns of one length");
        self.w
            .write(&b)
            .map_err(|e| parquet_error(Location::file(&self.path), e))?;
        self.keys = Vec::with_capacity(ROW_GROUP_ROWS);
        self.values = Vec::with_capacity(ROW_GROUP_ROWS);
        Ok(())
    }

    /// Writes the footer; returns the number of pairs.
    pub fn finish(mut self) -> Result<u64> {
        self.flush_batch()?;
        let mut bw = self
            .w
            .into_inner()
            .map_err(|e| parquet_error(Location::file(&self.path), e))?;
        bw.flush().map_err(|e| Error::io(&self.path, e))?;
        bw.get_ref()
            .sync_all()
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(self.rows)
    }
}

/// A sorted key file opened for look-ups: its footer, with every row
/// group's key range checked to be in order.
pub struct SortedReader {
    path: PathBuf,
    file: ChunkedFile,
    meta: Arc<ParquetMetaData>,
    /// (min, max) key of each row group.
    ranges: Vec<(i64, i64)>,
}

impl SortedReader {
    /// Opens a key file and reads its footer (bounded), checking the
    /// layout: two non-null Int64 columns `key`, `value`, every row group
    /// with min/max statistics on `key`, in key order.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_file(ChunkedFile::open(path, &path.to_string_lossy())?)
    }

    /// `open` over a file already opened (e.g. checked chunk by chunk
    /// against a folder's evidence.json as it is read).
    pub fn from_file(file: ChunkedFile) -> Result<Self> {
        let path = &file.path().to_path_buf();
        let loc = || Location::file(path);
        let bad = |what: String| {
            Error::invalid(
                Location::file(path),
                what,
                "the look-up index is written by `kvtrail scope --out`; run `kvtrail verify` on the folder and re-run scope",
            )
        };
        let meta = guard(loc, || {
            let mut r = parquet::file::metadata::ParquetMetaDataReader::new();
            r.try_parse(&file)
                .map_err(|e| parquet_error(Location::file(path), e))?;
            r.finish()
                .map_err(|e| parquet_error(Location::file(path), e))
        })?;
        let cols = meta.file_metadata().schema_descr().columns().to_vec();
        if cols.len() != 2 || cols[0].name() != "key" || cols[1].name() != "value" {
            return Err(bad("not a key file (columns must be `key`, `value`)".into()));
        }
        let mut ranges = Vec::with_capacity(meta.num_row_groups());
        for (i, rg) in meta.row_groups().iter().enumerate() {
            let range = match rg.column(0).statistics() {
                Some(Statistics::Int64(s)) => s.min_opt().copied().zip(s.max_opt().copied()),
                _ => None,
            };
            let Some((lo, hi)) = range else {
                return Err(bad(format!("row group {i} has no key statistics")));
            };
            if lo > hi || ranges.last().is_some_and(|&(_, prev)| prev > lo) {
                return Err(bad(format!("row group {i} is not in key order")));
            }
            ranges.push((lo, hi));
        }
        Ok(SortedReader {
            path: path.to_path_buf(),
            file,
            meta: Arc::new(meta),
            ranges,
        })
    }

    /// The string metadata stored under `key`.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.meta
            .file_metadata()
            .key_value_metadata()?
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_deref())
    }

    /// Number of pairs in the file.
    pub fn rows(&self) -> u64 {
        self.meta.file_metadata().num_rows().max(0) as u64
    }

    /// Number of row groups.
    pub fn row_groups(&self) -> usize {
        self.ranges.len()
    }

    /// The values of every pair with this key, in value order, reading
    /// only the row groups whose key range holds it.
    pub fn find(&self, key: u64) -> Result<Vec<u64>> {
        let Ok(k) = i64::try_from(key) else {
            return Ok(Vec::new());
        };
        // Row groups are in key order: the ones holding k are contiguous.
        let first = self.ranges.partition_point(|&(_, hi)| hi < k);
        let groups: Vec<usize> = (first..self.ranges.len())
            .take_while(|&i| self.ranges[i].0 <= k)
            .collect();
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        let path = &self.path;
        let loc = || Location::file(path);
        let bad = |what: String| {
            Error::invalid(
                Location::file(path),
                what,
                "the look-up index is written by `kvtrail scope --out`; run `kvtrail verify` on the folder and re-run scope",
            )
        };
        guard(loc, || {
            let file = self.file.clone();
            let opts = parquet::arrow::arrow_reader::ArrowReaderOptions::new();
            let meta =
                parquet::arrow::arrow_reader::ArrowReaderMetadata::try_new(self.meta.clone(), opts)
                    .map_err(|e| parquet_error(loc(), e))?;
            let rd = ParquetRecordBatchReaderBuilder::new_with_metadata(file, meta)
                .with_row_groups(groups.clone())
                .with_batch_size(ROW_GROUP_ROWS)
                .build()
                .map_err(|e| parquet_error(loc(), e))?;
            let mut out = Vec::new();
            let mut prev: Option<(i64, i64)> = None;
            let (lo, hi) = (
                self.ranges[groups[0]].0,
                self.ranges[groups[groups.len() - 1]].1,
            );
            for b in rd {
                let b = b.map_err(|e| parquet_error(loc(), e))?;
                let col = |i: usize| {
                    b.column(i)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .filter(|a| a.null_count() == 0)
                        .ok_or_else(|| bad(format!("column {i} is not a non-null Int64")))
                };
                let (ks, vs) = (col(0)?, col(1)?);
                for (kk, v) in ks.values().iter().zip(vs.values()) {
                    if *kk < lo || *kk > hi || prev.is_some_and(|p| p > (*kk, *v)) || *v < 0 {
                        return Err(bad(
                            "rows are not sorted or contradict the row-group statistics".into(),
                        ));
                    }
                    prev = Some((*kk, *v));
                    if *kk == k {
                        out.push(*v as u64);
                    }
                }
            }
            Ok(out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_value_of_a_key_across_row_groups_and_refuses_disorder() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.parquet");
        let f = File::create(&p).unwrap();
        let mut w = SortedWriter::new(f, &p, &[("a", "1".into())]).unwrap();
        // Key 7 spans three row groups; keys 0..2*ROW_GROUP_ROWS otherwise.
        let mut pairs: Vec<(u64, u64)> =
            (0..2 * ROW_GROUP_ROWS as u64).map(|i| (i * 3, i)).collect();
        pairs.extend((0..2 * ROW_GROUP_ROWS as u64 + 5).map(|v| (7, v)));
        pairs.sort_unstable();
        for &(k, v) in &pairs {
            w.push(k, v).unwrap();
        }
        assert!(w.push(1, 0).is_err(), "out of order");
        assert_eq!(w.finish().unwrap(), pairs.len() as u64);
        let r = SortedReader::open(&p).unwrap();
        assert_eq!(r.metadata("a"), Some("1"));
        assert_eq!(r.rows(), pairs.len() as u64);
        assert!(r.row_groups() >= 4);
        let sevens = r.find(7).unwrap();
        assert_eq!(
            sevens,
            (0..2 * ROW_GROUP_ROWS as u64 + 5).collect::<Vec<_>>()
        );
        assert_eq!(r.find(6).unwrap(), vec![2]);
        assert!(r.find(8).unwrap().is_empty());
        assert!(r.find(u64::MAX).unwrap().is_empty());
        // A file that is not one is an error, not a panic.
        std::fs::write(&p, b"PAR1 not parquet PAR1").unwrap();
        assert!(SortedReader::open(&p).is_err());
    }
}
