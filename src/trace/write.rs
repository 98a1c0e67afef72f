//! Writing trace tables to Parquet: record batches, part files with
//! rotation, and blake3 digests computed while the bytes go out.
//!
//! A part file is written as `NAME.parquet.inprogress` and renamed to
//! `NAME.parquet` only once its footer is on disk, so a crash never leaves a
//! `*.parquet` file that readers cannot open.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{FixedSizeBinaryBuilder, StringBuilder};
use arrow_array::{
    ArrayRef, Int64Array, RecordBatch, StringArray, UInt16Array, UInt32Array, UInt64Array,
};
use arrow_buffer::{BooleanBufferBuilder, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::error::{Error, Location, Result};
use crate::schema::{KvEvent, Op, RequestRecord, kv_col, kv_schema, req_col, requests_schema};
use crate::trace::manifest::FileEntry;
use crate::trace::parquet_error::parquet_error;

/// A nullable column filled in one pass: values plus a validity bitmap
/// that is only materialized when a null was seen.
struct NullableCol<T> {
    values: Vec<T>,
    valid: BooleanBufferBuilder,
    nulls: usize,
}

impl<T: Default + Copy> NullableCol<T> {
    fn with_capacity(n: usize) -> Self {
        NullableCol {
            values: Vec::with_capacity(n),
            valid: BooleanBufferBuilder::new(n),
            nulls: 0,
        }
    }
    #[inline]
    fn push(&mut self, v: Option<T>) {
        match v {
            Some(v) => {
                self.values.push(v);
                self.valid.append(true);
            }
            None => {
                self.values.push(T::default());
                self.valid.append(false);
                self.nulls += 1;
            }
        }
    }
    fn finish(mut self) -> (ScalarBuffer<T>, Option<NullBuffer>)
    where
        T: arrow_buffer::ArrowNativeType,
    {
        let nulls = (self.nulls > 0).then(|| NullBuffer::new(self.valid.finish()));
        (ScalarBuffer::from(self.values), nulls)
    }
}

/// Builds a kv-table record batch from events (one pass over the events:
/// this is on the capture hot path). Buffering rows and converting once per
/// row group measured faster than pushing each event into eleven column
/// builders.
pub fn kv_batch(events: &[KvEvent]) -> RecordBatch {
    let n = events.len();
    let mut pool = Vec::with_capacity(n);
    let mut seq = Vec::with_capacity(n);
    let mut ts = Vec::with_capacity(n);
    let mut rid = Vec::with_capacity(n);
    let mut op_keys: Vec<u8> = Vec::with_capacity(n);
    let mut start = Vec::with_capacity(n);
    let mut count = Vec::with_capacity(n);
    let mut tpos = NullableCol::<u32>::with_capacity(n);
    let mut spool = NullableCol::<u16>::with_capacity(n);
    let mut sstart = NullableCol::<u32>::with_capacity(n);
    let mut sseq = NullableCol::<u64>::with_capacity(n);
    for e in events {
        pool.push(e.pool);
        seq.push(e.seq);
        ts.push(e.ts_ns);
        rid.push(e.request_id);
        op_keys.push(e.op as u8);
        start.push(e.slot_start);
        count.push(e.slot_count);
        tpos.push(e.token_pos);
        spool.push(e.src.map(|s| s.pool));
        sstart.push(e.src.map(|s| s.slot_start));
        sseq.push(e.src.map(|s| s.seq));
    }
    // op as plain Utf8 (the contract's type), built from the codes with
    // exact-size buffers rather than one append per row.
    let mut offsets: Vec<i32> = Vec::with_capacity(n + 1);
    let mut bytes: Vec<u8> = Vec::with_capacity(n * 5);
    offsets.push(0);
    for &k in &op_keys {
        bytes.extend_from_slice(Op::ALL[k as usize].as_str().as_bytes());
        offsets.push(bytes.len() as i32);
    }
    let op = StringArray::new(
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        bytes.into(),
        None,
    );
    let (tp_v, tp_n) = tpos.finish();
    let (sp_v, sp_n) = spool.finish();
    let (ss_v, ss_n) = sstart.finish();
    let (sq_v, sq_n) = sseq.finish();
    let cols: Vec<ArrayRef> = vec![
        Arc::new(UInt16Array::from(pool)),
        Arc::new(UInt64Array::from(seq)),
        Arc::new(Int64Array::from(ts)),
        Arc::new(UInt64Array::from(rid)),
        Arc::new(op),
        Arc::new(UInt32Array::from(start)),
        Arc::new(UInt32Array::from(count)),
        Arc::new(UInt32Array::new(tp_v, tp_n)),
        Arc::new(UInt16Array::new(sp_v, sp_n)),
        Arc::new(UInt32Array::new(ss_v, ss_n)),
        Arc::new(UInt64Array::new(sq_v, sq_n)),
    ];
    RecordBatch::try_new(kv_schema(), cols).expect("kv batch matches its schema")
}

/// Builds a requests-table record batch.
pub fn requests_batch(reqs: &[RequestRecord]) -> RecordBatch {
    let rid: UInt64Array = reqs.iter().map(|r| r.request_id).collect::<Vec<_>>().into();
    let ext: StringArray = reqs.iter().map(|r| r.external_id.as_deref()).collect();
    let tenant: StringArray = reqs.iter().map(|r| Some(r.tenant.as_str())).collect();
    let arr: Int64Array = reqs.iter().map(|r| r.arrival_ns).collect::<Vec<_>>().into();
    let fin: Int64Array = reqs.iter().map(|r| r.finish_ns).collect();
    let pt: UInt32Array = reqs
        .iter()
        .map(|r| r.prompt_tokens)
        .collect::<Vec<_>>()
        .into();
    let pf: UInt32Array = reqs.iter().map(|r| r.prefilled_tokens).collect();
    let ot: UInt32Array = reqs
        .iter()
        .map(|r| r.output_tokens)
        .collect::<Vec<_>>()
        .into();
    let st: UInt16Array = reqs
        .iter()
        .map(|r| r.http_status)
        .collect::<Vec<_>>()
        .into();
    let mut fr = StringBuilder::new();
    for r in reqs {
        fr.append_option(r.finish_reason.as_deref());
    }
    let pp: UInt16Array = reqs.iter().map(|r| r.prefill_pool).collect();
    let dp: UInt16Array = reqs.iter().map(|r| r.decode_pool).collect();
    let mut ph = FixedSizeBinaryBuilder::with_capacity(reqs.len(), 32);
    let mut oh = FixedSizeBinaryBuilder::with_capacity(reqs.len(), 32);
    for r in reqs {
        match &r.prompt_hash {
            Some(h) => ph.append_value(h).expect("32 bytes"),
            None => ph.append_null(),
        }
        match &r.output_hash {
            Some(h) => oh.append_value(h).expect("32 bytes"),
            None => oh.append_null(),
        }
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(rid),
        Arc::new(ext),
        Arc::new(tenant),
        Arc::new(arr),
        Arc::new(fin),
        Arc::new(pt),
        Arc::new(pf),
        Arc::new(ot),
        Arc::new(st),
        Arc::new(fr.finish()),
        Arc::new(pp),
        Arc::new(dp),
        Arc::new(ph.finish()),
        Arc::new(oh.finish()),
    ];
    RecordBatch::try_new(requests_schema(), cols).expect("requests batch matches its schema")
}

/// A `Write` that hashes and counts every byte on its way to the file.
pub struct HashingWriter {
    inner: BufWriter<File>,
    hasher: blake3::Hasher,
    bytes: u64,
}

impl HashingWriter {
    pub fn new(file: File) -> Self {
        HashingWriter {
            inner: BufWriter::with_capacity(1 << 20, file),
            hasher: blake3::Hasher::new(),
            bytes: 0,
        }
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Options shared by all part writers of a trace.
#[derive(Debug, Clone)]
pub struct PartOptions {
    /// Rotate to a new part file once the current one has this many bytes.
    pub rotate_bytes: u64,
    /// zstd level (1 is fast and still small).
    pub zstd_level: i32,
}

impl Default for PartOptions {
    fn default() -> Self {
        PartOptions {
            rotate_bytes: 128 << 20,
            zstd_level: 1,
        }
    }
}

struct OpenPart {
    rel: String,
    tmp: PathBuf,
    fin: PathBuf,
    writer: ArrowWriter<HashingWriter>,
    rows: u64,
}

/// Row groups after which a part file is closed even below
/// `rotate_bytes`: a capture that flushes small batches once a second (the
/// `record` sidecar on a quiet engine) would otherwise write files of tens
/// of thousands of tiny row groups, which readers pay for per row group
/// (see [`crate::trace::read::MAX_ROW_GROUPS`]).
pub const MAX_PART_ROW_GROUPS: usize = 4_096;

/// An open part file at a row-group boundary ([`PartWriter::sync_open`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenPartState {
    /// The path the file will have once finished, relative to the root.
    pub path: String,
    /// Where it is written now (`*.parquet.inprogress`).
    pub writing: PathBuf,
    pub bytes: u64,
    pub rows: u64,
    pub row_groups: usize,
}

/// Writes one table stream (e.g. `kv/pool=1`) as rotated part files.
pub struct PartWriter {
    root: PathBuf,
    rel_dir: String,
    schema: SchemaRef,
    opts: PartOptions,
    next_index: u32,
    open: Option<OpenPart>,
}

impl PartWriter {
    /// `rel_dir` is relative to the trace root, e.g. `kv/pool=0`.
    pub fn new(root: &Path, rel_dir: &str, schema: SchemaRef, opts: PartOptions) -> Self {
        PartWriter {
            root: root.to_path_buf(),
            rel_dir: rel_dir.to_string(),
            schema,
            opts,
            next_index: 0,
            open: None,
        }
    }

    fn open_part(&mut self) -> Result<&mut OpenPart> {
        if self.open.is_none() {
            let dir = self.root.join(&self.rel_dir);
            std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            let name = format!("part-{:05}.parquet", self.next_index);
            self.next_index += 1;
            let fin = dir.join(&name);
            let tmp = dir.join(format!("{name}.inprogress"));
            let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
            let props = part_properties(self.opts.zstd_level)
                .set_max_row_group_row_count(Some(usize::MAX))
                .set_created_by(format!("kvtrail {}", env!("CARGO_PKG_VERSION")))
                .build();
            let writer =
                ArrowWriter::try_new(HashingWriter::new(file), self.schema.clone(), Some(props))
                    .map_err(|e| parquet_error(Location::file(&tmp), e))?;
            self.open = Some(OpenPart {
                rel: format!("{}/{}", self.rel_dir, name),
                tmp,
                fin,
                writer,
                rows: 0,
            });
        }
        Ok(self.open.as_mut().expect("just opened"))
    }

    /// Writes one batch as one row group. Returns the entry of a part file
    /// that was completed because it reached the rotation size.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<Option<FileEntry>> {
        if batch.num_rows() == 0 {
            return Ok(None);
        }
        let rotate_bytes = self.opts.rotate_bytes;
        let part = self.open_part()?;
        part.writer
            .write(batch)
            .map_err(|e| parquet_error(Location::file(&part.tmp), e))?;
        part.writer
            .flush()
            .map_err(|e| parquet_error(Location::file(&part.tmp), e))?;
        part.rows += batch.num_rows() as u64;
        if part.writer.bytes_written() as u64 >= rotate_bytes
            || part.writer.flushed_row_groups().len() >= MAX_PART_ROW_GROUPS
        {
            return self.finish_part();
        }
        Ok(None)
    }

    /// The open part file, with every row group written so far flushed to
    /// disk: its final path (relative to the root), the path it is written
    /// under now, and its bytes, rows and row groups. The bytes are a prefix
    /// of the finished file (row groups are appended, the footer comes at
    /// the end), which is what seals cover while a part is open.
    pub fn sync_open(&mut self) -> Result<Option<OpenPartState>> {
        let Some(part) = self.open.as_mut() else {
            return Ok(None);
        };
        let row_groups = part.writer.flushed_row_groups().len();
        let hw = part.writer.inner_mut();
        hw.flush().map_err(|e| Error::io(&part.tmp, e))?;
        Ok(Some(OpenPartState {
            path: part.rel.clone(),
            writing: part.tmp.clone(),
            bytes: hw.bytes,
            rows: part.rows,
            row_groups,
        }))
    }

    /// Closes the open part file, if any, and returns its manifest entry.
    pub fn finish_part(&mut self) -> Result<Option<FileEntry>> {
        let Some(part) = self.open.take() else {
            return Ok(None);
        };
        let mut hw = part
            .writer
            .into_inner()
            .map_err(|e| parquet_error(Location::file(&part.tmp), e))?;
        hw.flush().map_err(|e| Error::io(&part.tmp, e))?;
        let digest = hw.hasher.finalize().to_hex().to_string();
        let file = hw
            .inner
            .into_inner()
            .map_err(|e| Error::io(&part.tmp, e.into_error()))?;
        file.sync_data().map_err(|e| Error::io(&part.tmp, e))?;
        drop(file);
        std::fs::rename(&part.tmp, &part.fin).map_err(|e| Error::io(&part.fin, e))?;
        Ok(Some(FileEntry {
            path: part.rel,
            rows: part.rows,
            blake3: digest,
        }))
    }
}

/// Writer settings for trace tables, tuned for capture speed: dictionary
/// encoding only for low-cardinality columns (op, pool, tenant, ...), where
/// it pays; delta encoding for the monotonic seq and timestamp columns;
/// min/max statistics (per column chunk) only for seq and timestamps, the
/// columns a reader may prune row groups by (other statistics cost ~10% of
/// capture time and serve no reader).
fn part_properties(zstd_level: i32) -> parquet::file::properties::WriterPropertiesBuilder {
    let mut b = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(zstd_level).unwrap_or_default(),
        ))
        .set_dictionary_enabled(false)
        .set_statistics_enabled(EnabledStatistics::None);
    for col in [
        kv_col::OP,
        kv_col::POOL,
        kv_col::SRC_POOL,
        req_col::TENANT,
        req_col::FINISH_REASON,
        req_col::HTTP_STATUS,
        req_col::PREFILL_POOL,
        req_col::DECODE_POOL,
    ] {
        b = b.set_column_dictionary_enabled(ColumnPath::from(col), true);
    }
    for col in [kv_col::SEQ, kv_col::TS_NS, req_col::ARRIVAL_NS] {
        b = b.set_column_encoding(ColumnPath::from(col), Encoding::DELTA_BINARY_PACKED);
        b = b.set_column_statistics_enabled(ColumnPath::from(col), EnabledStatistics::Chunk);
    }
    b
}

/// Every batch of a Parquet file this process wrote (the recorder's
/// rewrite of its own requests files at close).
pub fn read_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| parquet_error(Location::file(path), e))?;
    reader
        .map(|b| {
            b.map_err(|e| {
                parquet_error(Location::file(path), parquet::errors::ParquetError::from(e))
            })
        })
        .collect()
}

/// Writes a whole table to one Parquet file with default settings
/// (used by tests and exporters); returns the bytes' blake3.
pub fn write_single_file(path: &Path, batches: &[RecordBatch]) -> Result<String> {
    let schema = batches
        .first()
        .map(|b| b.schema())
        .ok_or_else(|| Error::Other("no batches to write".into()))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_created_by(format!("kvtrail {}", env!("CARGO_PKG_VERSION")))
        .build();
    let mut w = ArrowWriter::try_new(HashingWriter::new(file), schema, Some(props))
        .map_err(|e| parquet_error(Location::file(path), e))?;
    for b in batches {
        w.write(b)
            .map_err(|e| parquet_error(Location::file(path), e))?;
    }
    let mut hw = w
        .into_inner()
        .map_err(|e| parquet_error(Location::file(path), e))?;
    hw.flush().map_err(|e| Error::io(path, e))?;
    Ok(hw.hasher.finalize().to_hex().to_string())
}
