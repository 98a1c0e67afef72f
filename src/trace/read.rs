//! Streaming readers for the requests and kv tables.
//!
//! Files are found at any depth under `requests/` and `kv/` (Hive folders
//! included), read batch by batch (never a whole trace at once), with any
//! compression, plain or dictionary strings and extra columns ignored. Every
//! row is checked against the contract; a violation is an error naming the
//! file, the row (0-based within the file) and the column.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_buffer::NullBuffer;
use arrow_schema::{DataType, Field, FieldRef, Schema, TimeUnit};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::file::metadata::ParquetStatisticsPolicy;
use parquet::file::reader::ChunkReader;

use crate::error::{Error, Location, Result};
use crate::schema::{CopySrc, KvEvent, Op, RequestRecord, kv_col, req_col};
use crate::trace::files;
use crate::trace::guard::guard;
use crate::trace::hive::{self, HivePairs};
use crate::trace::manifest::{Deployment, Manifest};
use crate::trace::store::Source;

pub use crate::trace::index::scan_requests;

/// Rows per record batch when reading.
pub const READ_BATCH_ROWS: usize = 64 * 1024;

/// An opened trace: its manifest and data files (paths sorted).
#[derive(Debug, Clone)]
pub struct Trace {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub request_files: Vec<PathBuf>,
    pub kv_files: Vec<PathBuf>,
}

impl Trace {
    /// Opens a trace directory: reads trace.json and lists data files.
    /// Anything under `requests/` or `kv/` that leads out of the trace or is
    /// not a regular file is an error naming it (see [`crate::trace::files`]).
    pub fn open(dir: &Path) -> Result<Trace> {
        let (trace, refused) = Trace::scan(dir)?;
        match refused.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(trace),
        }
    }

    /// Like [`Trace::open`], but hands the refused entries back instead of
    /// failing on the first (`verify` lists them all as problems).
    pub fn scan(dir: &Path) -> Result<(Trace, Vec<Error>)> {
        let root = files::root(dir)?;
        let manifest = Manifest::load(dir)?;
        files::discover(dir, manifest.files.as_deref())?;
        let requests = files::walk(&root, &dir.join("requests"));
        let kv = files::walk(&root, &dir.join("kv"));
        let trace = Trace {
            dir: dir.to_path_buf(),
            manifest,
            request_files: requests.data_files(),
            kv_files: kv.data_files(),
        };
        let refused = requests.refused.into_iter().chain(kv.refused).collect();
        Ok((trace, refused))
    }

    pub fn deployment(&self) -> &Deployment {
        &self.manifest.deployment
    }

    /// Path of a data file relative to the trace root, with `/` separators.
    pub fn rel(&self, path: &Path) -> String {
        rel_path(&self.dir, path)
    }

    /// Streams the requests table, file by file, batch by batch.
    pub fn requests(&self) -> impl Iterator<Item = Result<Vec<RequestRecord>>> + '_ {
        self.request_files
            .iter()
            .flat_map(move |f| match RequestFileReader::open(f) {
                Ok(r) => Box::new(r) as Box<dyn Iterator<Item = Result<Vec<RequestRecord>>>>,
                Err(e) => Box::new(std::iter::once(Err(e))),
            })
    }

    /// Opens one kv file for streaming.
    pub fn kv_file(&self, path: &Path) -> Result<KvFileReader> {
        KvFileReader::open(path, &self.manifest.deployment)
    }

    /// Streams every kv event of the trace, file by file (no global order).
    pub fn kv_chunks(&self) -> impl Iterator<Item = Result<KvChunk>> + '_ {
        self.kv_files
            .iter()
            .flat_map(move |f| match self.kv_file(f) {
                Ok(r) => Box::new(r) as Box<dyn Iterator<Item = Result<KvChunk>>>,
                Err(e) => Box::new(std::iter::once(Err(e))),
            })
    }
}

/// Relative path with forward slashes.
pub fn rel_path(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Every `*.parquet` file under `dir` (`requests/` or `kv/` of a trace) at
/// any depth, sorted, except hidden names (`.`/`_`: `_SUCCESS`, `.crc`,
/// `_temporary/`). A missing directory is an empty table. An entry that
/// leads out of the trace (`dir`'s parent) or is not a regular file is an
/// error naming it.
pub fn list_parquet(dir: &Path) -> Result<Vec<PathBuf>> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let root = files::root(parent)?;
    let mut walk = files::walk(&root, dir);
    if !walk.refused.is_empty() {
        return Err(walk.refused.swap_remove(0));
    }
    Ok(walk.data_files())
}

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
fn remote_first(path: &Path, e: Error) -> Error {
    match e {
        Error::Parquet { .. } => files::remote_failure(path).unwrap_or(e),
        e => e,
    }
}

fn open_parquet(path: &Path) -> Result<(Source, ArrowReaderMetadata)> {
    open_parquet_inner(path).map_err(|e| remote_first(path, e))
}

fn open_parquet_inner(path: &Path) -> Result<(Source, ArrowReaderMetadata)> {
    let file = files::open_regular(path)?;
    let len = file.size().map_err(|e| Error::io(path, e))?;
    if len >= 12 {
        let tail = file
            .get_bytes(len - 8, 8)
            .map_err(|e| Error::parquet(Location::file(path), e))?;
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
        .map_err(|e| Error::parquet(Location::file(path), e))?;
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

fn open_builder(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    guard(
        || Location::file(path),
        || {
            let (file, meta) = open_parquet(path)?;
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
fn open_builder_dict(
    path: &Path,
    dict_col: &str,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    guard(
        || Location::file(path),
        || open_builder_dict_inner(path, dict_col),
    )
}

fn open_builder_dict_inner(
    path: &Path,
    dict_col: &str,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    let (file, meta) = open_parquet(path)?;
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
fn project(
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
                .map_err(|e| Error::parquet(Location::file(path), e))
        },
    )
}

/// A column of a batch with its location, for typed extraction.
struct Col<'a> {
    path: &'a Path,
    name: &'static str,
    row0: u64,
    arr: Option<&'a ArrayRef>,
    /// For a column the file lacks, filled in from a Hive folder: the
    /// folder's name and its value (None: Hive's null).
    folder: Option<(String, Option<String>)>,
}

impl<'a> Col<'a> {
    fn get(batch: &'a RecordBatch, path: &'a Path, row0: u64, name: &'static str) -> Col<'a> {
        let folder = batch.schema_ref().field_with_name(name).ok().and_then(|f| {
            let m = f.metadata();
            Some((
                m.get(hive::FOLDER_META)?.clone(),
                m.get(hive::VALUE_META).cloned(),
            ))
        });
        Col {
            path,
            name,
            row0,
            arr: batch.column_by_name(name),
            folder,
        }
    }

    /// A column filled in from a Hive folder holds the folder's value in
    /// every row, so any error in it is the folder's: it names the folder
    /// and the value instead of a row and the column's type.
    fn blame_folder<T>(&self, res: Result<T>, expected: &str) -> Result<T> {
        match (&res, &self.folder) {
            (Err(_), Some((folder, value))) => {
                let value = match value {
                    Some(v) => format!("{v:?}"),
                    None => "null".to_string(),
                };
                Err(Error::invalid(
                    Location::file(self.path).column(self.name),
                    format!(
                        "the file lies in folder `{folder}`, which gives column `{}` the value {value}: not a {expected}",
                        self.name
                    ),
                    format!(
                        "rename the folder to `{}=` and a value of the contract's type (docs/trace-format.md), or write the column into the file",
                        self.name
                    ),
                ))
            }
            _ => res,
        }
    }

    fn loc(&self, row: usize) -> Location {
        Location::file(self.path)
            .row(self.row0 + row as u64)
            .column(self.name)
    }

    fn type_error(&self, expected: &str) -> Error {
        let dt = self
            .arr
            .map(|a| a.data_type().to_string())
            .unwrap_or_default();
        Error::invalid(
            Location::file(self.path).column(self.name),
            format!("column `{}` has type {dt}, expected {expected}", self.name),
            "write the column with the type the v1 contract gives (docs/trace-format.md)",
        )
    }

    /// Errors on the first null if the column is declared non-null.
    fn check_no_nulls(&self) -> Result<()> {
        self.blame_folder(
            self.check_no_nulls_inner(),
            "value (the column is non-null)",
        )
    }

    fn check_no_nulls_inner(&self) -> Result<()> {
        if let Some(a) = self.arr
            && let Some(nb) = a.logical_nulls()
            && nb.null_count() > 0
        {
            let row = (0..a.len()).find(|&i| nb.is_null(i)).unwrap_or(0);
            return Err(Error::invalid(
                self.loc(row),
                format!("null in non-null column `{}`", self.name),
                "every row needs a value in this column (docs/trace-format.md)",
            ));
        }
        Ok(())
    }

    fn nulls(&self) -> Option<NullBuffer> {
        self.arr.and_then(|a| a.logical_nulls())
    }

    /// Integer values converted to `T`, rejecting values out of range.
    /// Any integer type is accepted if the values fit (writers differ in
    /// integer widths); other types are an error.
    fn ints<T>(&self, expected: &str) -> Result<Cow<'a, [T]>>
    where
        T: ArrowNativeTypeExt,
    {
        self.blame_folder(self.ints_inner(expected), expected)
    }

    fn ints_inner<T>(&self, expected: &str) -> Result<Cow<'a, [T]>>
    where
        T: ArrowNativeTypeExt,
    {
        let a = self.arr.expect("column present");
        if let Some(s) = T::borrow(a) {
            return Ok(Cow::Borrowed(s));
        }
        let nulls = a.logical_nulls();
        macro_rules! conv {
            ($ty:ty) => {{
                let v = a.as_primitive::<$ty>().values();
                let mut out = Vec::with_capacity(v.len());
                for (i, x) in v.iter().enumerate() {
                    let valid = nulls.as_ref().map(|n| n.is_valid(i)).unwrap_or(true);
                    match T::from_i128(*x as i128) {
                        Some(t) => out.push(t),
                        None if !valid => out.push(T::default()),
                        None => {
                            return Err(Error::invalid(
                                self.loc(i),
                                format!(
                                    "value {x} does not fit column `{}` ({expected})",
                                    self.name
                                ),
                                "write values in the range of the contract's type",
                            ));
                        }
                    }
                }
                Ok(Cow::Owned(out))
            }};
        }
        match a.data_type() {
            // A column with no value at all (pyarrow writes an all-None
            // column as type null): nulls, checked by the caller.
            DataType::Null => Ok(Cow::Owned(vec![T::default(); a.len()])),
            // Dictionary-encoded integers (a pandas Categorical): the values.
            DataType::Dictionary(_, v) if v.is_integer() => {
                let plain = arrow_cast::cast(a, v).map_err(|e| self.type_error(&e.to_string()))?;
                let col = Col {
                    path: self.path,
                    name: self.name,
                    row0: self.row0,
                    arr: Some(&plain),
                    folder: None,
                };
                Ok(Cow::Owned(col.ints::<T>(expected)?.into_owned()))
            }
            // Epoch timestamps (pandas datetime64, `timestamp[ns]`) for the
            // Int64 nanosecond columns: the same numbers, scaled to ns.
            DataType::Timestamp(unit, _) if expected == "Int64" => {
                let scale: i128 = match unit {
                    TimeUnit::Second => 1_000_000_000,
                    TimeUnit::Millisecond => 1_000_000,
                    TimeUnit::Microsecond => 1_000,
                    TimeUnit::Nanosecond => 1,
                };
                let raw: &[i64] = match unit {
                    TimeUnit::Second => a.as_primitive::<TimestampSecondType>().values(),
                    TimeUnit::Millisecond => a.as_primitive::<TimestampMillisecondType>().values(),
                    TimeUnit::Microsecond => a.as_primitive::<TimestampMicrosecondType>().values(),
                    TimeUnit::Nanosecond => a.as_primitive::<TimestampNanosecondType>().values(),
                };
                let mut out = Vec::with_capacity(raw.len());
                for (i, x) in raw.iter().enumerate() {
                    let valid = nulls.as_ref().map(|n| n.is_valid(i)).unwrap_or(true);
                    match T::from_i128(*x as i128 * scale) {
                        Some(t) => out.push(t),
                        None if !valid => out.push(T::default()),
                        None => {
                            return Err(Error::invalid(
                                self.loc(i),
                                format!(
                                    "timestamp {x} ({unit:?}) does not fit column `{}` in nanoseconds",
                                    self.name
                                ),
                                "write Unix epoch nanoseconds as Int64",
                            ));
                        }
                    }
                }
                Ok(Cow::Owned(out))
            }
            // Decimal(p, 0): how writers without unsigned 64-bit integers
            // (Spark) keep ids above 2^63.
            DataType::Decimal128(_, 0) => conv!(Decimal128Type),
            DataType::Int8 => conv!(Int8Type),
            DataType::Int16 => conv!(Int16Type),
            DataType::Int32 => conv!(Int32Type),
            DataType::Int64 => conv!(Int64Type),
            DataType::UInt8 => conv!(UInt8Type),
            DataType::UInt16 => conv!(UInt16Type),
            DataType::UInt32 => conv!(UInt32Type),
            DataType::UInt64 => conv!(UInt64Type),
            _ => Err(self.type_error(expected)),
        }
    }

    /// String column (Utf8, LargeUtf8, Utf8View or a dictionary of them).
    fn strings(&self) -> Result<Vec<Option<String>>> {
        self.blame_folder(self.strings_inner(), "Utf8")
    }

    fn strings_inner(&self) -> Result<Vec<Option<String>>> {
        let a = self.arr.expect("column present");
        // A folder's value is text as written (`tenant=007/` is "007"),
        // though the folder column is an integer when it parses as one.
        if let Some((_, value)) = &self.folder {
            return Ok(vec![value.clone(); a.len()]);
        }
        let is_str = |dt: &DataType| {
            matches!(
                dt,
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
            )
        };
        if a.data_type() == &DataType::Null {
            return Ok(vec![None; a.len()]);
        }
        let ok = match a.data_type() {
            DataType::Dictionary(_, v) => is_str(v),
            dt => is_str(dt),
        };
        if !ok {
            return Err(self.type_error("Utf8"));
        }
        let c =
            arrow_cast::cast(a, &DataType::Utf8).map_err(|e| self.type_error(&e.to_string()))?;
        let s = c.as_string::<i32>();
        Ok(s.iter().map(|v| v.map(str::to_string)).collect())
    }

    /// The op column as codes: dictionary values are parsed once.
    fn ops(&self) -> Result<Vec<Op>> {
        self.blame_folder(self.ops_inner(), "op")
    }

    fn ops_inner(&self) -> Result<Vec<Op>> {
        let a = self.arr.expect("column present");
        let bad = |row: usize, v: &str| {
            Error::invalid(
                self.loc(row),
                format!("unknown op {v:?}"),
                "op must be one of alloc, write, read, free, share, scrub (lower case)",
            )
        };
        if let Some(dict) = a.as_any_dictionary_opt() {
            let values = Col {
                path: self.path,
                name: self.name,
                row0: self.row0,
                arr: Some(dict.values()),
                folder: None,
            }
            .strings()?;
            let codes: Vec<Option<Op>> = values
                .iter()
                .map(|v| v.as_deref().and_then(Op::parse))
                .collect();
            let keys = dict.normalized_keys();
            let mut out = Vec::with_capacity(keys.len());
            for (i, k) in keys.iter().enumerate() {
                match codes.get(*k).copied().flatten() {
                    Some(op) => out.push(op),
                    None => {
                        return Err(bad(
                            i,
                            values.get(*k).and_then(|v| v.as_deref()).unwrap_or(""),
                        ));
                    }
                }
            }
            return Ok(out);
        }
        // Plain strings: parse in place, without one String per row.
        let mut out = Vec::with_capacity(a.len());
        let mut push = |i: usize, s: Option<&str>| -> Result<()> {
            let s = s.unwrap_or("");
            out.push(Op::parse(s).ok_or_else(|| bad(i, s))?);
            Ok(())
        };
        match a.data_type() {
            DataType::Utf8 => {
                for (i, s) in a.as_string::<i32>().iter().enumerate() {
                    push(i, s)?;
                }
            }
            DataType::LargeUtf8 => {
                for (i, s) in a.as_string::<i64>().iter().enumerate() {
                    push(i, s)?;
                }
            }
            DataType::Utf8View => {
                for (i, s) in a.as_string_view().iter().enumerate() {
                    push(i, s)?;
                }
            }
            // no rows, or all null (refused before this by the null check)
            DataType::Null => out.resize(a.len(), Op::Alloc),
            _ => return Err(self.type_error("Utf8")),
        }
        Ok(out)
    }

    /// FixedSizeBinary(32) (or Binary of 32-byte values).
    fn hashes(&self) -> Result<Vec<Option<[u8; 32]>>> {
        self.blame_folder(self.hashes_inner(), "FixedSizeBinary(32)")
    }

    fn hashes_inner(&self) -> Result<Vec<Option<[u8; 32]>>> {
        let a = self.arr.expect("column present");
        let mut out = Vec::with_capacity(a.len());
        let mut push = |i: usize, v: Option<&[u8]>| -> Result<()> {
            match v {
                None => out.push(None),
                Some(b) => out.push(Some(b.try_into().map_err(|_| {
                    Error::invalid(
                        self.loc(i),
                        format!("hash has {} bytes, expected 32", b.len()),
                        "hashes are blake3 digests: 32 bytes",
                    )
                })?)),
            }
            Ok(())
        };
        match a.data_type() {
            DataType::FixedSizeBinary(_) => {
                for (i, v) in a.as_fixed_size_binary().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::Binary => {
                for (i, v) in a.as_binary::<i32>().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::LargeBinary => {
                for (i, v) in a.as_binary::<i64>().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::Null => out.resize(a.len(), None),
            _ => return Err(self.type_error("FixedSizeBinary(32)")),
        }
        Ok(out)
    }
}

/// Native integer types we convert columns into.
pub trait ArrowNativeTypeExt: Copy + Default + 'static {
    fn from_i128(v: i128) -> Option<Self>;
    fn borrow(a: &ArrayRef) -> Option<&[Self]>;
}

macro_rules! native {
    ($t:ty, $arrow:ty) => {
        impl ArrowNativeTypeExt for $t {
            fn from_i128(v: i128) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn borrow(a: &ArrayRef) -> Option<&[Self]> {
                a.as_primitive_opt::<$arrow>().map(|p| &p.values()[..])
            }
        }
    };
}
native!(u16, UInt16Type);
native!(u32, UInt32Type);
native!(u64, UInt64Type);
native!(i64, Int64Type);

fn opt<T: Copy>(vals: &Option<Cow<[T]>>, nulls: &Option<NullBuffer>, i: usize) -> Option<T> {
    let v = vals.as_ref()?;
    if let Some(n) = nulls
        && n.is_null(i)
    {
        return None;
    }
    Some(v[i])
}

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
    /// capacity_tokens by pool id (0: not in the deployment), a flat table
    /// so the per-row lookup is one index.
    capacity: Vec<u64>,
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
    pub fn open(path: &Path, deployment: &Deployment) -> Result<Self> {
        let builder = open_builder_dict(path, kv_col::OP)?;
        let hive = hive::pairs(path, &[&KV_REQUIRED[..], &KV_OPTIONAL[..]].concat())?;
        let reader = project(path, builder, &KV_REQUIRED, &KV_OPTIONAL, &hive)?;
        Ok(KvFileReader {
            cur: Cursor::new(path, hive, reader),
            capacity: {
                let max = deployment.pools.iter().map(|p| p.id).max().unwrap_or(0);
                let mut cap = vec![0u64; max as usize + 1];
                for p in &deployment.pools {
                    cap[p.id as usize] = p.capacity_tokens;
                }
                cap
            },
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
        match self.capacity.get(pool as usize) {
            Some(&c) if c > 0 => Some(c),
            _ => None,
        }
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
            let end = start[i] as u64 + count[i] as u64;
            if end > cap {
                return Err(Error::invalid(
                    loc(kv_col::SLOT_START),
                    format!(
                        "extent {}..{} lies outside pool {} (capacity_tokens {cap})",
                        start[i], end, pool[i]
                    ),
                    "slots are numbered 0..capacity_tokens of their pool",
                ));
            }
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
                    if sp == pool[i] {
                        return Err(Error::invalid(
                            loc(kv_col::SRC_POOL),
                            format!("copy from pool {sp} into itself"),
                            "copies go between pools (a DAG: prefill pools before decode pools)",
                        ));
                    }
                    if ss as u64 + count[i] as u64 > scap {
                        return Err(Error::invalid(
                            loc(kv_col::SRC_SLOT_START),
                            format!(
                                "source extent {ss}..{} lies outside pool {sp}",
                                ss as u64 + count[i] as u64
                            ),
                            "slots are numbered 0..capacity_tokens of their pool",
                        ));
                    }
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

/// Where a file reader is in its file: the Parquet reader, the rows
/// handed out so far, and whether it has stopped (at the end, or after an
/// error: a damaged file yields one error, then nothing).
struct Cursor {
    path: PathBuf,
    /// Column values given by Hive folders of the path.
    hive: HivePairs,
    reader: ParquetRecordBatchReader,
    rows: u64,
    done: bool,
}

impl Cursor {
    fn new(path: &Path, hive: HivePairs, reader: ParquetRecordBatchReader) -> Self {
        Cursor {
            path: path.to_path_buf(),
            hive,
            reader,
            rows: 0,
            done: false,
        }
    }

    /// The next batch, Hive folder values filled in; a Parquet panic on a
    /// damaged page is an error at the current row.
    fn batch(&mut self) -> Option<Result<RecordBatch>> {
        if self.done {
            return None;
        }
        let (path, rows) = (&self.path, self.rows);
        let reader = &mut self.reader;
        let res = match guard(|| Location::file(path).row(rows), || Ok(reader.next())) {
            Ok(next) => next?
                .map_err(|e| Error::parquet(Location::file(path).row(rows), e))
                .and_then(|b| hive::fill(b, path, &self.hive)),
            Err(e) => Err(e),
        }
        .map_err(|e| remote_first(path, e));
        self.done = res.is_err();
        Some(res)
    }

    /// After `batch` was decoded into `res`: checks it against the Hive
    /// folders, moves past its rows, stops on an error. Returns the batch's
    /// first row with the result.
    fn settle<T>(&mut self, batch: &RecordBatch, res: Result<T>) -> Result<(u64, T)> {
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
    pub fn open(path: &Path) -> Result<Self> {
        let builder = open_builder(path)?;
        let hive = hive::pairs(path, &[&REQ_REQUIRED[..6], &REQ_OPTIONAL[..]].concat())?;
        let reader = project(path, builder, &REQ_REQUIRED[..6], &REQ_OPTIONAL, &hive)?;
        Ok(RequestFileReader {
            cur: Cursor::new(path, hive, reader),
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
        let tenant = cten.strings()?;
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
        let ext = cext.arr.map(|_| cext.strings()).transpose()?;
        let fin = cfin.arr.map(|_| cfin.ints::<i64>("Int64")).transpose()?;
        let pf = cpf.arr.map(|_| cpf.ints::<u32>("UInt32")).transpose()?;
        let fr = cfr.arr.map(|_| cfr.strings()).transpose()?;
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
                external_id: ext.as_ref().and_then(|v| v[i].clone()),
                tenant: tenant[i].clone().unwrap_or_default(),
                arrival_ns: arr[i],
                finish_ns: opt(&fin, &finn, i),
                prompt_tokens: pt[i],
                prefilled_tokens: opt(&pf, &pfn, i),
                output_tokens: ot[i],
                http_status: st[i],
                finish_reason: fr.as_ref().and_then(|v| v[i].clone()),
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

/// A light view of one batch of a kv file: only what replay needs to plan
/// its merge (seq order per pool) and its copies (which source states a
/// later copy will ask for). Columns are projected, so this is much cheaper
/// than decoding whole events.
#[derive(Debug, Clone, Default)]
pub struct KvIndexBatch {
    /// Row (0-based, within the file) of the first entry.
    pub first_row: u64,
    pub pool: Vec<u16>,
    pub seq: Vec<u64>,
    /// Copies in this batch: (row within batch, source).
    pub copies: Vec<(u32, CopySrc, u32)>,
}

/// Streams the planning columns of one kv file (pool, seq, slot_count and
/// the src columns), batch by batch.
pub struct KvIndexReader {
    cur: Cursor,
}

impl KvIndexReader {
    pub fn open(path: &Path) -> Result<Self> {
        let builder = open_builder(path)?;
        let required = [kv_col::POOL, kv_col::SEQ, kv_col::SLOT_COUNT];
        let optional = [kv_col::SRC_POOL, kv_col::SRC_SLOT_START, kv_col::SRC_SEQ];
        let hive = hive::pairs(path, &[&required[..], &optional[..]].concat())?;
        let reader = project(path, builder, &required, &optional, &hive)?;
        Ok(KvIndexReader {
            cur: Cursor::new(path, hive, reader),
        })
    }

    fn decode(&self, batch: &RecordBatch) -> Result<KvIndexBatch> {
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
                        check_seq(
                            || Location::file(p).row(r0 + i as u64).column(kv_col::SRC_SEQ),
                            s,
                        )?;
                        copies.push((
                            i as u32,
                            CopySrc {
                                pool: a,
                                slot_start: b,
                                seq: s,
                            },
                            count[i],
                        ));
                    }
                }
            }
        }
        Ok(KvIndexBatch {
            first_row: r0,
            pool,
            seq,
            copies,
        })
    }
}

impl Iterator for KvIndexReader {
    type Item = Result<KvIndexBatch>;
    fn next(&mut self) -> Option<Self::Item> {
        let batch = match self.cur.batch()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let res = self.decode(&batch);
        Some(self.cur.settle(&batch, res).map(|(_, v)| v))
    }
}

/// The highest request id this version replays: the two ids above it are
/// the replay's per-slot markers for never-written and scrubbed content
/// (`lineage::state::NEVER`, `SCRUBBED`), so a trace using them would be
/// misread. They are refused, never silently misclassified.
pub const MAX_REQUEST_ID: u64 = u64::MAX - 2;

/// The reader's request-id rule (shared with the JSONL line parser, so a
/// capture never writes a row the readers refuse).
pub fn check_request_id(loc: impl FnOnce() -> Location, id: u64) -> Result<()> {
    if id > MAX_REQUEST_ID {
        return Err(reserved_id(loc(), id));
    }
    Ok(())
}

fn reserved_id(loc: Location, id: u64) -> Error {
    Error::invalid(
        loc,
        format!("request_id {id} is one of the two highest UInt64 values, which kvtrail reserves"),
        "map request ids to values below 18446744073709551614 (e.g. number them from 1) and keep the original id in external_id",
    )
}

/// The largest seq (and `src_seq`) this version reads. seq is the 0-based
/// position of an event in its pool's stream, so 2^64-1 would be a pool's
/// 2^64th event, which no capture reaches; replay keeps "seq + 1" per slot
/// and uses 2^64-1 as the end of a stream. A src_seq can only be legal if
/// its source pool has an event with that seq. Both are refused, never
/// misread.
pub const MAX_SEQ: u64 = u64::MAX - 1;

pub fn check_seq(loc: impl FnOnce() -> Location, seq: u64) -> Result<()> {
    if seq > MAX_SEQ {
        let loc = loc();
        let col = loc.column.clone().unwrap_or_default();
        return Err(Error::invalid(
            loc,
            format!("{col} {seq} (2^64-1) is reserved: no pool reaches its 2^64th event"),
            "seqs number a pool's events from 0; write the event's position in its pool's stream",
        ));
    }
    Ok(())
}

/// Rows a Parquet file holds, from its footer alone (the sum over its row
/// groups, which is what the readers deliver); reads no data pages.
pub fn footer_rows(path: &Path) -> Result<u64> {
    let file = super::files::open_regular(path)?;
    let meta = guard(
        || Location::file(path),
        || {
            parquet::file::metadata::ParquetMetaDataReader::new()
                .parse_and_finish(&file)
                .map_err(|e| Error::parquet(Location::file(path), e))
        },
    )
    .map_err(|e| remote_first(path, e))?;
    Ok(meta
        .row_groups()
        .iter()
        .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
        .fold(0u64, u64::saturating_add))
}
