//! One object of a remote trace opened for reading: ranged reads through
//! a small block cache, each checked against the object's first read.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, GetRange};

use crate::error::{Error, Location, Result};
use crate::trace::store::errors::{changed, changed_bytes, request_error};
use crate::trace::store::limits::{
    BLOCK_BYTES, CACHE_BLOCKS, MAX_OBJECT_BYTES, STREAM_BYTES, block_on,
};
use crate::trace::store::remote::{Remote, Sealed, slot};

#[derive(Default)]
struct Cache {
    /// (block index, bytes, last use).
    blocks: Vec<(u64, Bytes, u64)>,
    clock: u64,
}

pub(super) struct Inner {
    remote: Arc<Remote>,
    /// The object's path in the trace.
    rel: String,
    url: String,
    location: ObjPath,
    size: u64,
    e_tag: Option<String>,
    version: Option<String>,
    cache: Mutex<Cache>,
    /// The object's local copy, when it cannot be pinned.
    spool: Option<Arc<File>>,
}

impl Inner {
    /// Bytes `start..end`: from the local copy of an unpinned object; of
    /// a pinned one, in ranged GETs of whole blocks, each checked against
    /// what the object's first read saw ([`Remote::seal`]).
    fn fetch(&self, start: u64, end: u64) -> Result<Bytes> {
        if start >= end {
            return Ok(Bytes::new());
        }
        if let Some(f) = &self.spool {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0; (end - start) as usize];
            f.read_exact_at(&mut buf, start)
                .map_err(|e| Error::io(Path::new(&self.url), e))?;
            return Ok(Bytes::from(buf));
        }
        let res = self.fetch_sealed(start, end);
        if let Err(e) = &res {
            self.remote.failed(e);
        }
        res
    }

    /// The object's [`Sealed`] blocks, read now if not yet.
    fn sealed(&self) -> Result<Arc<Sealed>> {
        let res = self.remote.seal(self);
        if let Err(e) = &res {
            self.remote.failed(e);
        }
        res
    }

    /// Bytes `start..end` of a pinned object, in GETs of at most
    /// [`STREAM_BYTES`] of whole blocks, each block checked.
    fn fetch_sealed(&self, start: u64, end: u64) -> Result<Bytes> {
        let sealed = self.remote.seal(self)?;
        if sealed.size != self.size {
            return Err(changed(&self.url));
        }
        let per = STREAM_BYTES / BLOCK_BYTES;
        let (b0, b1) = (start / BLOCK_BYTES, (end - 1) / BLOCK_BYTES);
        let mut pieces = Vec::new();
        let mut b = b0;
        while b <= b1 {
            let n = (b1 - b + 1).min(per);
            let lo = b * BLOCK_BYTES;
            let hi = ((b + n) * BLOCK_BYTES).min(self.size);
            let bytes = self.fetch_inner(lo, hi)?;
            for (i, block) in bytes.chunks(BLOCK_BYTES as usize).enumerate() {
                if sealed.blocks.get((b + i as u64) as usize)
                    != Some(blake3::hash(block).as_bytes())
                {
                    return Err(changed_bytes(&self.url));
                }
            }
            let from = (start.max(lo) - lo) as usize;
            let to = (end.min(hi) - lo) as usize;
            pieces.push(bytes.slice(from..to));
            b += n;
        }
        if pieces.len() == 1 {
            return Ok(pieces.pop().unwrap_or_default());
        }
        let mut out = Vec::with_capacity((end - start) as usize);
        for p in pieces {
            out.extend_from_slice(&p);
        }
        Ok(Bytes::from(out))
    }

    /// One ranged GET of `start..end`, pinned to the listed ETag/version.
    fn fetch_inner(&self, start: u64, end: u64) -> Result<Bytes> {
        let opts = GetOptions {
            if_match: self.e_tag.clone(),
            version: self.version.clone(),
            range: Some(GetRange::Bounded(start..end)),
            ..Default::default()
        };
        let store = self.remote.store.clone();
        let loc = self.location.clone();
        let url = self.url.clone();
        let (meta, bytes) = block_on(async move {
            let got = store
                .get_opts(&loc, opts)
                .await
                .map_err(|e| request_error(&url, e))?;
            let meta = got.meta.clone();
            let bytes = got.bytes().await.map_err(|e| request_error(&url, e))?;
            Ok::<_, Error>((meta, bytes))
        })??;
        // A server that ignores If-Match may still name the ETag it
        // served; what it served is checked block by block in any case.
        if let (Some(want), Some(got)) = (&self.e_tag, &meta.e_tag)
            && want != got
        {
            return Err(changed(&self.url));
        }
        if meta.size != self.size {
            return Err(changed(&self.url));
        }
        if bytes.len() as u64 != end - start {
            return Err(Error::invalid(
                Location::file(Path::new(&self.url)),
                format!(
                    "the object store sent {} bytes for bytes {start}..{end}",
                    bytes.len()
                ),
                "the object or the server is damaged: check the object's size against trace.json",
            ));
        }
        Ok(bytes)
    }

    /// Bytes `start..end` through the block cache.
    fn read_range(&self, start: u64, end: u64) -> Result<Bytes> {
        let end = end.min(self.size);
        if start >= end {
            return Ok(Bytes::new());
        }
        let (b0, b1) = (start / BLOCK_BYTES, (end - 1) / BLOCK_BYTES);
        if b1 - b0 >= CACHE_BLOCKS as u64 / 2 {
            // A long range (a whole column chunk): uncached, in requests
            // of at most STREAM_BYTES.
            return self.fetch(start, end);
        }
        let mut out = Vec::with_capacity((end - start) as usize);
        for b in b0..=b1 {
            let block = self.block(b)?;
            let bs = b * BLOCK_BYTES;
            let lo = start.max(bs) - bs;
            let hi = end.min(bs + block.len() as u64) - bs;
            out.extend_from_slice(&block[lo as usize..hi as usize]);
        }
        Ok(Bytes::from(out))
    }

    fn block(&self, b: u64) -> Result<Bytes> {
        {
            let mut c = self.cache.lock().map_err(|_| self.poisoned())?;
            c.clock += 1;
            let now = c.clock;
            if let Some(e) = c.blocks.iter_mut().find(|e| e.0 == b) {
                e.2 = now;
                return Ok(e.1.clone());
            }
        }
        let start = b * BLOCK_BYTES;
        let bytes = self.fetch(start, (start + BLOCK_BYTES).min(self.size))?;
        let mut c = self.cache.lock().map_err(|_| self.poisoned())?;
        let now = c.clock;
        if c.blocks.len() >= CACHE_BLOCKS
            && let Some(i) = c
                .blocks
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.2)
                .map(|(i, _)| i)
        {
            c.blocks.swap_remove(i);
        }
        c.blocks.push((b, bytes.clone(), now));
        Ok(bytes)
    }

    fn poisoned(&self) -> Error {
        Error::Other(format!("{}: a reader thread failed", self.url))
    }
}

/// An object of a remote trace, opened for ranged reads. `Read` streams
/// it front to back.
pub struct RemoteFile {
    inner: Arc<Inner>,
    /// Where the next streamed range starts, and what is left of the last.
    pos: u64,
    buf: Bytes,
}

impl RemoteFile {
    pub fn len(&self) -> u64 {
        self.inner.size
    }

    pub fn is_empty(&self) -> bool {
        self.inner.size == 0
    }

    /// Bytes `start..start+len` (fewer at the end of the object).
    pub fn read_at(&self, start: u64, len: u64) -> Result<Bytes> {
        self.inner.read_range(start, start.saturating_add(len))
    }

    /// A reader from `start`, through the block cache.
    pub fn reader_at(&self, start: u64) -> RangeReader {
        RangeReader {
            inner: self.inner.clone(),
            pos: start,
        }
    }
}

fn io_err(e: Error) -> io::Error {
    io::Error::other(e)
}

impl Read for RemoteFile {
    /// Front to back in [`STREAM_BYTES`] ranges, whatever the caller's
    /// buffer (a digest reads 64 KiB at a time).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.buf.is_empty() {
            if self.pos >= self.inner.size {
                return Ok(0);
            }
            let end = (self.pos + STREAM_BYTES).min(self.inner.size);
            self.buf = self.inner.fetch(self.pos, end).map_err(io_err)?;
            self.pos = end;
        }
        let n = buf.len().min(self.buf.len());
        buf[..n].copy_from_slice(&self.buf[..n]);
        let _ = self.buf.split_to(n);
        Ok(n)
    }
}

/// A reader over a remote file from an offset, through the block cache.
pub struct RangeReader {
    inner: Arc<Inner>,
    pos: u64,
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.pos >= self.inner.size {
            return Ok(0);
        }
        let b = self.pos / BLOCK_BYTES;
        let block = self.inner.block(b).map_err(io_err)?;
        let off = (self.pos - b * BLOCK_BYTES) as usize;
        let n = buf.len().min(block.len().saturating_sub(off));
        if n == 0 {
            return Ok(0);
        }
        buf[..n].copy_from_slice(&block[off..off + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Remote {
    /// Opens the object at `rel` for reading.
    pub(crate) fn open_file(self: &Arc<Self>, rel: &str) -> Result<RemoteFile> {
        let url = self.file_url(rel);
        let meta = self.meta(rel)?.ok_or_else(|| {
            Error::invalid(
                Location::file(Path::new(&url)),
                "does not exist in the object store",
                "check the URL (bucket or container, prefix, object name); a trace's prefix holds trace.json, requests/ and kv/",
            )
        })?;
        if meta.size > MAX_OBJECT_BYTES {
            return Err(Error::invalid(
                Location::file(Path::new(&url)),
                format!(
                    "is {} bytes long by the object store's answer, more than kvtrail reads ({MAX_OBJECT_BYTES})",
                    meta.size
                ),
                "no trace file is this large: the store or a proxy in front of it is damaged",
            ));
        }
        let pinned = meta.e_tag.is_some() || meta.version.is_some();
        let mut inner = Inner {
            remote: self.clone(),
            rel: rel.to_string(),
            url,
            location: meta.location.clone(),
            size: meta.size,
            e_tag: meta.e_tag,
            version: meta.version,
            cache: Mutex::default(),
            spool: None,
        };
        if !pinned {
            inner.spool = Some(self.spool(rel, &inner)?);
        }
        Ok(RemoteFile {
            inner: Arc::new(inner),
            pos: 0,
            buf: Bytes::new(),
        })
    }

    /// The local copy of an object that cannot be pinned to an ETag or
    /// version (see [`Remote::spools`]): downloaded in one GET on first
    /// use, its blake3 recorded as the object's digest. Callers for the
    /// same object wait for that download; other objects' go on.
    fn spool(&self, rel: &str, inner: &Inner) -> Result<Arc<File>> {
        slot(&self.spools, rel, &inner.url, || self.download(rel, inner))
    }

    /// Downloads an unpinned object into a temporary file (see
    /// [`Remote::spool`]).
    fn download(&self, rel: &str, inner: &Inner) -> Result<Arc<File>> {
        use std::io::Write;
        let tmp_err = |e: io::Error| {
            Error::invalid(
                Location::file(Path::new(&inner.url)),
                format!("cannot keep a local copy of the object: {e}"),
                "the server sends no ETag, so kvtrail reads each object once into a temporary file (TMPDIR): free space there, or serve the trace from object storage",
            )
        };
        let mut file = tempfile::tempfile().map_err(tmp_err)?;
        // One GET of the whole object, streamed to the file (a server that
        // sends no ETag often answers no Range request either).
        let store = self.store.clone();
        let loc = inner.location.clone();
        let url = inner.url.clone();
        let size = inner.size;
        let copied = block_on(async {
            let got = store
                .get_opts(&loc, GetOptions::default())
                .await
                .map_err(|e| request_error(&url, e))?;
            let mut stream = got.into_stream();
            let mut h = blake3::Hasher::new();
            let mut n = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| request_error(&url, e))?;
                n += chunk.len() as u64;
                if n > size {
                    break;
                }
                h.update(&chunk);
                file.write_all(&chunk).map_err(tmp_err)?;
            }
            if n != size {
                return Err(Error::invalid(
                    Location::file(Path::new(&url)),
                    format!(
                        "the server sent {n}{} bytes of an object of {size}",
                        if n > size { " or more" } else { "" }
                    ),
                    "the object changed while kvtrail read it, or the server is damaged: do not modify a trace while kvtrail reads it",
                ));
            }
            Ok::<_, Error>(h)
        });
        let h = match copied {
            Ok(Ok(h)) => h,
            Ok(Err(e)) | Err(e) => {
                self.failed(&e);
                return Err(e);
            }
        };
        let d = (h.finalize().to_hex().to_string(), inner.size);
        if let Ok(mut m) = self.digests.lock() {
            m.insert(rel.to_string(), d);
        }
        Ok(Arc::new(file))
    }

    /// What one front-to-back read of the pinned object `inner` saw (see
    /// [`Remote::sealed`]), read in [`STREAM_BYTES`] ranges on first use.
    fn seal(&self, inner: &Inner) -> Result<Arc<Sealed>> {
        slot(&self.sealed, &inner.rel, &inner.url, || {
            let mut whole = blake3::Hasher::new();
            // Grown as blocks arrive, not from the size the store claims.
            let mut blocks = Vec::new();
            let mut pos = 0;
            while pos < inner.size {
                let end = (pos + STREAM_BYTES).min(inner.size);
                let bytes = inner.fetch_inner(pos, end)?;
                whole.update(&bytes);
                blocks.extend(
                    bytes
                        .chunks(BLOCK_BYTES as usize)
                        .map(|b| *blake3::hash(b).as_bytes()),
                );
                pos = end;
            }
            let sealed = Sealed {
                digest: whole.finalize().to_hex().to_string(),
                size: inner.size,
                blocks,
            };
            if let Ok(mut m) = self.digests.lock() {
                m.insert(inner.rel.clone(), (sealed.digest.clone(), sealed.size));
            }
            Ok(Arc::new(sealed))
        })
    }

    /// blake3 and length of the object at `rel`, streamed front to back
    /// in ranged reads (once per object and process).
    pub(crate) fn digest(self: &Arc<Self>, rel: &str) -> Result<(String, u64)> {
        if let Some(d) = self.digests.lock().ok().and_then(|m| m.get(rel).cloned()) {
            return Ok(d);
        }
        let file = self.open_file(rel)?;
        // An object without an ETag was hashed as it was copied.
        if let Some(d) = self.digests.lock().ok().and_then(|m| m.get(rel).cloned()) {
            return Ok(d);
        }
        let sealed = file.inner.sealed()?;
        Ok((sealed.digest.clone(), sealed.size))
    }
}
