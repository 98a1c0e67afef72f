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
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::error::{Error, Location, Result};
use crate::schema::{KvEvent, RequestRecord, kv_schema, requests_schema};
use crate::trace::manifest::FileEntry;

/// Builds a kv-table record batch from events.
pub fn kv_batch(events: &[KvEvent]) -> RecordBatch {
    let n = events.len();
    let pool: UInt16Array = events.iter().map(|e| e.pool).collect::<Vec<_>>().into();
    let seq: UInt64Array = events.iter().map(|e| e.seq).collect::<Vec<_>>().into();
    let ts: Int64Array = events.iter().map(|e| e.ts_ns).collect::<Vec<_>>().into();
    let rid: UInt64Array = events
        .iter()
        .map(|e| e.request_id)
        .collect::<Vec<_>>()
        .into();
    let op: StringArray = events.iter().map(|e| Some(e.op.as_str())).collect();
    let start: UInt32Array = events
        .iter()
        .map(|e| e.slot_start)
        .collect::<Vec<_>>()
        .into();
    let count: UInt32Array = events
        .iter()
        .map(|e| e.slot_count)
        .collect::<Vec<_>>()
        .into();
    let tpos: UInt32Array = events.iter().map(|e| e.token_pos).collect();
    let spool: UInt16Array = events.iter().map(|e| e.src.map(|s| s.pool)).collect();
    let sstart: UInt32Array = events.iter().map(|e| e.src.map(|s| s.slot_start)).collect();
    let sseq: UInt64Array = events.iter().map(|e| e.src.map(|s| s.seq)).collect();
    let cols: Vec<ArrayRef> = vec![
        Arc::new(pool),
        Arc::new(seq),
        Arc::new(ts),
        Arc::new(rid),
        Arc::new(op),
        Arc::new(start),
        Arc::new(count),
        Arc::new(tpos),
        Arc::new(spool),
        Arc::new(sstart),
        Arc::new(sseq),
    ];
    debug_assert!(cols.iter().all(|c| c.len() == n));
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
            let props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(
                    ZstdLevel::try_new(self.opts.zstd_level).unwrap_or_default(),
                ))
                .set_max_row_group_row_count(Some(usize::MAX))
                .set_created_by(format!("kvtrail {}", env!("CARGO_PKG_VERSION")))
                .build();
            let writer =
                ArrowWriter::try_new(HashingWriter::new(file), self.schema.clone(), Some(props))
                    .map_err(|e| Error::parquet(Location::file(&tmp), e))?;
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
        let part = self.open_part()?;
        part.writer
            .write(batch)
            .map_err(|e| Error::parquet(Location::file(&part.tmp), e))?;
        part.writer
            .flush()
            .map_err(|e| Error::parquet(Location::file(&part.tmp), e))?;
        part.rows += batch.num_rows() as u64;
        if part.writer.bytes_written() as u64 >= self.opts.rotate_bytes {
            return self.finish_part();
        }
        Ok(None)
    }

    /// Closes the open part file, if any, and returns its manifest entry.
    pub fn finish_part(&mut self) -> Result<Option<FileEntry>> {
        let Some(part) = self.open.take() else {
            return Ok(None);
        };
        let mut hw = part
            .writer
            .into_inner()
            .map_err(|e| Error::parquet(Location::file(&part.tmp), e))?;
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
        .map_err(|e| Error::parquet(Location::file(path), e))?;
    for b in batches {
        w.write(b)
            .map_err(|e| Error::parquet(Location::file(path), e))?;
    }
    let mut hw = w
        .into_inner()
        .map_err(|e| Error::parquet(Location::file(path), e))?;
    hw.flush().map_err(|e| Error::io(path, e))?;
    Ok(hw.hasher.finalize().to_hex().to_string())
}
