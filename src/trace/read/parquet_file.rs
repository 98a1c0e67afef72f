//! Opening a Parquet data file within kvtrail's limits (footer size,
//! row groups), projecting it to the columns a reader takes, and the
//! cursor every reader walks its file with.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Field, FieldRef, Schema};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::file::metadata::ParquetStatisticsPolicy;
use parquet::file::reader::ChunkReader;

use crate::error::{Error, Location, Result};
use crate::trace::guard::guard;
use crate::trace::hive::{self, HivePairs};
use crate::trace::parquet_error::parquet_error;
use crate::trace::root::TraceRoot;
use crate::trace::store::Source;

/// Rows per record batch when reading.
pub const READ_BATCH_ROWS: usize = 64 * 1024;

/// The most row groups kvtrail reads in one Parquet file. Each row group
/// costs its metadata (held while the file is open) and a column reader
/// per projected column as it is read, so a file of many tiny row groups
/// costs memory and time with the number of row groups, not of rows: an
/// 83 MB file of 50,000 one-row row groups took 0.6 GB and 13 s to scope.
/// Writers cut row groups of thousands to millions of rows (the Recorder
/// also starts a new part file at [`crate::trace::write::MAX_PART_ROW_GROUPS`]),
/// so real files stay far below this.
pub const MAX_ROW_GROUPS: usize = 10_000;

/// The largest Parquet footer (the file's metadata) kvtrail decodes:
/// 16 MiB, checked from the file's last 8 bytes before decoding. 10,000
/// row groups of the 11 kv columns take about 9 MiB.
pub const MAX_FOOTER_BYTES: u64 = 16 << 20;

/// Reader options: the column, encoding and size statistics of the footer
/// are not decoded (kvtrail checks every row itself and never uses them),
/// which is most of the metadata's memory.
fn reader_options() -> ArrowReaderOptions {
    ArrowReaderOptions::new()
        .with_column_stats_policy(ParquetStatisticsPolicy::SkipAll)
        .with_encoding_stats_policy(ParquetStatisticsPolicy::SkipAll)
        .with_size_stats_policy(ParquetStatisticsPolicy::SkipAll)
}

fn too_many(path: &Path, what: String) -> Error {
    Error::invalid(
        Location::file(path),
        what,
        "rewrite the file with fewer, larger row groups (e.g. pyarrow `write_table(..., row_group_size=1_000_000)` or DuckDB `COPY`); see docs/limits.md",
    )
}

/// Opens a Parquet data file and decodes its footer, within
/// [`MAX_FOOTER_BYTES`] and [`MAX_ROW_GROUPS`].
/// A read of a remote file that failed inside the Parquet reader comes
/// back as the remote read's own error (naming the object and what to do),
/// not as a damaged file.
fn remote_first(root: &TraceRoot, e: Error) -> Error {
    match e {
        Error::Parquet { .. } => root.read_failure().unwrap_or(e),
        e => e,
    }
}

fn open_parquet(root: &TraceRoot, path: &Path) -> Result<(Source, ArrowReaderMetadata)> {
    open_parquet_inner(root, path).map_err(|e| remote_first(root, e))
}

fn open_parquet_inner(root: &TraceRoot, path: &Path) -> Result<(Source, ArrowReaderMetadata)> {
    let file = root.open_file(path)?;
    let len = file.size().map_err(|e| Error::io(path, e))?;
    if len >= 12 {
        let tail = file
            .get_bytes(len - 8, 8)
            .map_err(|e| parquet_error(Location::file(path), e))?;
        let footer = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]) as u64;
        if &tail[4..] == b"PAR1" && footer > MAX_FOOTER_BYTES {
            return Err(too_many(
                path,
                format!(
                    "its Parquet footer (metadata) is {footer} bytes, more than the {MAX_FOOTER_BYTES} bytes kvtrail decodes"
                ),
            ));
        }
    }
    let meta = ArrowReaderMetadata::load(&file, reader_options())
        .map_err(|e| parquet_error(Location::file(path), e))?;
    let groups = meta.metadata().num_row_groups();
    if groups > MAX_ROW_GROUPS {
        return Err(too_many(
            path,
            format!(
                "has {groups} row groups, more than the {MAX_ROW_GROUPS} kvtrail reads in one file"
            ),
        ));
    }
    Ok((file, meta))
}

pub(crate) fn open_builder(
    root: &TraceRoot,
    path: &Path,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    guard(
        || Location::file(path),
        || {
            let (file, meta) = open_parquet(root, path)?;
            Ok(ParquetRecordBatchReaderBuilder::new_with_metadata(
                file, meta,
            ))
        },
    )
}

/// Like [`open_builder`], but asks the Parquet reader to hand string column
/// `dict_col` over as a dictionary (keys + the few distinct values) instead
/// of materializing one string per row: the op column of the kv table is
/// then decoded to codes with one parse per distinct value. Falls back to
/// the file's own types when the column is absent, not a string, or the
/// reader refuses the request.
pub(crate) fn open_builder_dict(
    root: &TraceRoot,
    path: &Path,
    dict_col: &str,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    guard(
        || Location::file(path),
        || open_builder_dict_inner(root, path, dict_col),
    )
}

fn open_builder_dict_inner(
    root: &TraceRoot,
    path: &Path,
    dict_col: &str,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    let (file, meta) = open_parquet(root, path)?;
    let schema = meta.schema().clone();
    if let Ok(i) = schema.index_of(dict_col) {
        let f = schema.field(i);
        if matches!(
            f.data_type(),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ) {
            let mut fields: Vec<FieldRef> = schema.fields().iter().cloned().collect();
            fields[i] = Arc::new(
                Field::new(
                    f.name(),
                    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
                    f.is_nullable(),
                )
                .with_metadata(f.metadata().clone()),
            );
            let supplied = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
            if let Ok(m2) = ArrowReaderMetadata::try_new(
                meta.metadata().clone(),
                reader_options().with_schema(supplied),
            ) {
                return Ok(ParquetRecordBatchReaderBuilder::new_with_metadata(file, m2));
            }
        }
    }
    Ok(ParquetRecordBatchReaderBuilder::new_with_metadata(
        file, meta,
    ))
}

/// Finds required and optional columns by name and projects to them.
/// A required column may instead come from a Hive folder (`hive`).
pub(crate) fn project(
    path: &Path,
    builder: ParquetRecordBatchReaderBuilder<Source>,
    required: &[&str],
    optional: &[&str],
    hive: &HivePairs,
) -> Result<ParquetRecordBatchReader> {
    let schema = builder.schema().clone();
    let mut roots = Vec::new();
    for name in required.iter().chain(optional) {
        match schema.fields().iter().position(|f| f.name() == name) {
            Some(i) => roots.push(i),
            None if required.contains(name) && !hive.iter().any(|p| p.key == *name) => {
                return Err(Error::invalid(
                    Location::file(path).column(name),
                    format!("required column `{name}` is missing"),
                    "write every non-null column of the v1 contract (docs/trace-format.md)",
                ));
            }
            None => {}
        }
    }
    guard(
        || Location::file(path),
        || {
            let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
            builder
                .with_projection(mask)
                .with_batch_size(READ_BATCH_ROWS)
                .build()
                .map_err(|e| parquet_error(Location::file(path), e))
        },
    )
}

/// Where a file reader is in its file: the Parquet reader, the rows
/// handed out so far, and whether it has stopped (at the end, or after an
/// error: a damaged file yields one error, then nothing).
pub(crate) struct Cursor {
    /// The trace the file belongs to (a failed remote read is its error).
    root: TraceRoot,
    pub(crate) path: PathBuf,
    /// Column values given by Hive folders of the path.
    hive: HivePairs,
    reader: ParquetRecordBatchReader,
    /// Rows handed out so far.
    pub(crate) rows: u64,
    done: bool,
}

impl Cursor {
    pub(crate) fn new(
        root: &TraceRoot,
        path: &Path,
        hive: HivePairs,
        reader: ParquetRecordBatchReader,
    ) -> Self {
        Cursor {
            root: root.clone(),
            path: path.to_path_buf(),
            hive,
            reader,
            rows: 0,
            done: false,
        }
    }

    /// A cursor whose first row is row `rows` of the file (a reader of
    /// some of its row groups).
    pub(crate) fn starting_at(mut self, rows: u64) -> Self {
        self.rows = rows;
        self
    }

    /// The next batch, Hive folder values filled in; a Parquet panic on a
    /// damaged page is an error at the current row.
    pub(crate) fn batch(&mut self) -> Option<Result<RecordBatch>> {
        if self.done {
            return None;
        }
        let (path, rows) = (&self.path, self.rows);
        let reader = &mut self.reader;
        let res = match guard(|| Location::file(path).row(rows), || Ok(reader.next())) {
            Ok(next) => next?
                .map_err(|e| parquet_error(Location::file(path).row(rows), e))
                .and_then(|b| hive::fill(b, path, &self.hive)),
            Err(e) => Err(e),
        }
        .map_err(|e| remote_first(&self.root, e));
        self.done = res.is_err();
        Some(res)
    }

    /// Ends the file (no more batches) when `stop`.
    pub(crate) fn stop_if(&mut self, stop: bool) {
        self.done |= stop;
    }

    /// After `batch` was decoded into `res`: checks it against the Hive
    /// folders, moves past its rows, stops on an error. Returns the batch's
    /// first row with the result.
    pub(crate) fn settle<T>(&mut self, batch: &RecordBatch, res: Result<T>) -> Result<(u64, T)> {
        let res = res.and_then(|v| {
            hive::check(batch, &self.path, self.rows, &self.hive)?;
            Ok(v)
        });
        let first_row = self.rows;
        self.rows += batch.num_rows() as u64;
        self.done |= res.is_err();
        res.map(|v| (first_row, v))
    }
}

/// Rows a Parquet file holds, from its footer alone (the sum over its row
/// groups, which is what the readers deliver); reads no data pages.
pub fn footer_rows(root: &TraceRoot, path: &Path) -> Result<u64> {
    let file = root.open_file(path)?;
    let meta = guard(
        || Location::file(path),
        || {
            parquet::file::metadata::ParquetMetaDataReader::new()
                .parse_and_finish(&file)
                .map_err(|e| parquet_error(Location::file(path), e))
        },
    )
    .map_err(|e| remote_first(root, e))?;
    Ok(meta
        .row_groups()
        .iter()
        .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
        .fold(0u64, u64::saturating_add))
}
