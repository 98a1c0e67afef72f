//! Chunk digests: the blake3 of every fixed-size piece of a large file,
//! and a reader that checks each piece it serves against them. An output
//! folder's evidence.json records them for its large files
//! (`custody::FileDigest::chunks`), so a command that reads a few rows of
//! a 2 GB requests.csv (a look-up) checks the bytes it reads, not the whole
//! folder.
//!
//! The chunk size is a function of the file's size (`chunk_bytes_for`: at
//! least 1 MiB, a power of two, at most 4096 chunks per file), so a record
//! cannot choose it. Chunk `i` is bytes `i*chunk .. (i+1)*chunk` (the last
//! one shorter); a power-of-two chunk at a multiple of its size is a
//! subtree of the file's BLAKE3 hash tree, and its digest
//! (`ChunkDigest::Subtree`) is that subtree's chaining value
//! (`blake3::hazmat`). The file's blake3 follows from its chunk digests
//! (`root_of`), so a record whose chunk digests do not make up the file's
//! recorded blake3 contradicts itself, and a reader that checks the
//! record's chunks against its blake3 (`binds`) and the chunks it reads
//! against the record checks what `kvtrail verify` checks, byte for byte,
//! as far as it reads. Records of earlier versions hold the plain blake3 of
//! each chunk (`ChunkDigest::Plain`), which is bound to nothing: their
//! files are checked whole.
//!
//! `ChunkedFile` reads a local file at offsets. With digests, every chunk
//! a read touches is read whole, hashed and compared before any of its
//! bytes are handed out, and the bytes handed out are the ones that were
//! hashed (a file changed after the check cannot slip bytes in); a chunk
//! that does not match fails the read with `InvalidData` and is recorded in
//! the file's mismatch log. Without digests it is a plain reader. It is a
//! cheap handle (clones share the file and the cache of checked chunks) and
//! serves the Parquet reader (`ChunkReader`) and the CSV reader (`cursor`:
//! `Read + Seek`).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use parquet::file::reader::{ChunkReader, Length};

use crate::error::{Error, Location, Result};

/// Files at least this large get chunk digests.
pub const CHUNKED_FROM: u64 = 4 << 20;
/// The smallest chunk.
pub const MIN_CHUNK_BYTES: u64 = 1 << 20;
/// At most this many chunks per file (larger files get larger chunks).
pub const MAX_CHUNKS: u64 = 4096;
/// Checked chunks kept in memory per file (a look-up touches a few).
const CACHED_CHUNKS: usize = 4;

/// The chunk size for a file of `bytes` bytes: a power of two, at least
/// [`MIN_CHUNK_BYTES`], so that the file has at most [`MAX_CHUNKS`] chunks.
pub fn chunk_bytes_for(bytes: u64) -> u64 {
    bytes
        .div_ceil(MAX_CHUNKS)
        .max(MIN_CHUNK_BYTES)
        .checked_next_power_of_two()
        .unwrap_or(1 << 63)
}

/// How many chunks a file of `bytes` bytes has.
pub fn chunk_count(bytes: u64) -> u64 {
    bytes.div_ceil(chunk_bytes_for(bytes))
}

/// What a record's chunk digests are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkDigest {
    /// The chaining value of the chunk as a subtree of the file's BLAKE3
    /// tree: the file's blake3 follows from them (`root_of`). What kvtrail
    /// writes (evidence.json: `"digest": "blake3-subtree"`).
    Subtree,
    /// The plain blake3 of the chunk's bytes (records without `digest`,
    /// written by earlier versions): bound to nothing.
    Plain,
}

impl ChunkDigest {
    /// The name evidence.json records (`chunks.digest`; absent for `Plain`).
    pub const SUBTREE: &'static str = "blake3-subtree";

    /// The digest of `bytes`, chunk `i` of a file of chunks of `chunk`
    /// bytes (not empty; `i * chunk` a multiple of 1 KiB).
    pub fn of(self, i: u64, chunk: u64, bytes: &[u8]) -> [u8; 32] {
        match self {
            ChunkDigest::Plain => *hash(bytes).as_bytes(),
            ChunkDigest::Subtree => {
                use blake3::hazmat::HasherExt as _;
                let mut h = blake3::Hasher::new();
                h.set_input_offset(i * chunk);
                h.update_rayon(bytes);
                h.finalize_non_root()
            }
        }
    }
}

/// The blake3 of a file of `len` bytes whose chunks (of
/// `chunk_bytes_for(len)` bytes) have the subtree digests `cvs`; None when
/// `cvs` is not one per chunk or the file has fewer than two chunks (the
/// tree then has no parent node).
pub fn root_of(cvs: &[[u8; 32]], len: u64) -> Option<blake3::Hash> {
    root_with(cvs, chunk_bytes_for(len), len)
}

/// `root_of` for chunks of `chunk` bytes (a power of two, at least 1 KiB).
fn root_with(cvs: &[[u8; 32]], chunk: u64, len: u64) -> Option<blake3::Hash> {
    use blake3::hazmat::{Mode, merge_subtrees_root};
    if cvs.len() < 2 || cvs.len() as u64 != len.div_ceil(chunk) {
        return None;
    }
    let (l, r) = split(cvs, chunk, len);
    Some(merge_subtrees_root(&l, &r, Mode::Hash))
}

/// The chaining values of the left and right subtrees of `len` bytes
/// whose chunks have the digests `cvs` (two or more).
fn split(cvs: &[[u8; 32]], chunk: u64, len: u64) -> ([u8; 32], [u8; 32]) {
    // The left subtree: the largest power of two of whole chunks that
    // leaves at least one byte to the right (BLAKE3's tree shape).
    let left = blake3::hazmat::left_subtree_len(len);
    let k = (left / chunk) as usize;
    (
        subtree(&cvs[..k], chunk, left),
        subtree(&cvs[k..], chunk, len - left),
    )
}

fn subtree(cvs: &[[u8; 32]], chunk: u64, len: u64) -> [u8; 32] {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let (l, r) = split(cvs, chunk, len);
    blake3::hazmat::merge_subtrees_non_root(&l, &r, blake3::hazmat::Mode::Hash)
}

/// Whether the chunk digests `digests` (hex, subtree digests) make up the
/// file digest `blake3` (hex) of a file of `bytes` bytes: the check that a
/// record of chunk digests does not contradict itself.
pub fn binds(digests: &[String], bytes: u64, blake3: &str) -> bool {
    let cvs: Option<Vec<[u8; 32]>> = digests
        .iter()
        .map(|d| blake3::Hash::from_hex(d).ok().map(|h| *h.as_bytes()))
        .collect();
    let want = blake3::Hash::from_hex(blake3).ok();
    match (cvs.and_then(|c| root_of(&c, bytes)), want) {
        (Some(have), Some(want)) => have == want,
        _ => false,
    }
}

/// A file's blake3 and size, plus its chunk digests of kind `kind` when it
/// is at least [`CHUNKED_FROM`] bytes: one pass over the file.
pub fn digest_file(path: &Path, kind: ChunkDigest) -> Result<(String, u64, Option<Vec<String>>)> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < CHUNKED_FROM {
        let mut h = blake3::Hasher::new();
        h.update_reader(&mut f).map_err(|e| Error::io(path, e))?;
        let n = f.stream_position().map_err(|e| Error::io(path, e))?;
        return Ok((h.finalize().to_hex().to_string(), n, None));
    }
    let chunk = chunk_bytes_for(len);
    let mut buf = vec![0u8; chunk as usize];
    let mut whole = blake3::Hasher::new();
    let mut chunks = Vec::new();
    let mut total = 0u64;
    loop {
        let n = read_full(&mut f, &mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        if kind == ChunkDigest::Plain {
            whole.update_rayon(&buf[..n]);
        }
        chunks.push(kind.of(chunks.len() as u64, chunk, &buf[..n]));
        total += n as u64;
        if n < chunk as usize {
            break;
        }
    }
    if total != len {
        return Err(Error::invalid(
            Location::file(path),
            format!("the file changed size while it was hashed ({len} then {total} bytes)"),
            "nothing may write into a folder while kvtrail reads it; run the command again",
        ));
    }
    let whole = match kind {
        ChunkDigest::Plain => whole.finalize(),
        ChunkDigest::Subtree => root_of(&chunks, total).expect("a file of 4 MiB has 4 chunks"),
    };
    let hex = chunks
        .iter()
        .map(|c| blake3::Hash::from(*c).to_hex().to_string());
    Ok((whole.to_hex().to_string(), total, Some(hex.collect())))
}

fn hash(b: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    h.update_rayon(b);
    h.finalize()
}

/// Reads until `buf` is full or the file ends; the number of bytes read.
pub(crate) fn read_full(f: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Where mismatching chunks are written down (shared by every file of a
/// folder, so the folder can tell that something it read was changed).
pub type MismatchLog = Arc<Mutex<Vec<String>>>;

struct Digests {
    chunk: u64,
    kind: ChunkDigest,
    blake3: Vec<[u8; 32]>,
    /// The last checked chunks: (index, bytes).
    cache: Mutex<Vec<(u64, Arc<[u8]>)>>,
    log: MismatchLog,
}

struct Inner {
    path: PathBuf,
    /// The name shown in messages (the path inside its folder).
    name: String,
    file: Mutex<File>,
    len: u64,
    digests: Option<Digests>,
}

/// A local file read at offsets, optionally checked against chunk digests.
#[derive(Clone)]
pub struct ChunkedFile(Arc<Inner>);

impl std::fmt::Debug for ChunkedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedFile")
            .field("path", &self.0.path)
            .field("len", &self.0.len)
            .field("checked", &self.0.digests.is_some())
            .finish()
    }
}

impl ChunkedFile {
    /// A plain reader (no digests: the file was checked some other way).
    pub fn open(path: &Path, name: &str) -> Result<ChunkedFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        Ok(ChunkedFile(Arc::new(Inner {
            path: path.to_path_buf(),
            name: name.to_string(),
            file: Mutex::new(file),
            len,
            digests: None,
        })))
    }

    /// A reader that checks every chunk it serves against `digests` (hex,
    /// one per chunk of a `bytes`-byte file, of kind `kind`, as
    /// `digest_file` writes them). The file must have exactly `bytes`
    /// bytes; a digest that is not hex, or a list of the wrong length, is an
    /// error.
    pub fn open_checked(
        path: &Path,
        name: &str,
        bytes: u64,
        kind: ChunkDigest,
        digests: &[String],
        log: MismatchLog,
    ) -> Result<ChunkedFile> {
        let mut blake3 = Vec::with_capacity(digests.len());
        for d in digests {
            let h = blake3::Hash::from_hex(d).map_err(|_| {
                Error::Other(format!("{name}: chunk digest {d:?} is not 64 hex digits"))
            })?;
            blake3.push(*h.as_bytes());
        }
        if blake3.len() as u64 != chunk_count(bytes) {
            return Err(Error::Other(format!(
                "{name}: {} chunk digests for {bytes} bytes, expected {}",
                blake3.len(),
                chunk_count(bytes)
            )));
        }
        let f = Self::open(path, name)?;
        let inner = Arc::into_inner(f.0).expect("a new handle is the only one");
        if inner.len != bytes {
            let (len, name) = (inner.len, inner.name.clone());
            let why = format!("{len} bytes where evidence.json records {bytes}");
            log.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{name}: {why}"));
            return Err(Error::Other(format!("{name}: {why}")));
        }
        Ok(ChunkedFile(Arc::new(Inner {
            digests: Some(Digests {
                chunk: chunk_bytes_for(bytes),
                kind,
                blake3,
                cache: Mutex::new(Vec::new()),
                log,
            }),
            ..inner
        })))
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The path the file was opened at.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// Reads the whole file (every chunk checked).
    pub fn read_all(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.cursor(0)
            .read_to_end(&mut out)
            .map_err(|e| Error::io(&self.0.path, e))?;
        Ok(out)
    }

    /// A `Read + Seek` view from `pos`.
    pub fn cursor(&self, pos: u64) -> Cursor {
        Cursor {
            file: self.clone(),
            pos,
        }
    }

    /// Bytes from `off` into `buf` (fewer at a chunk's or the file's end).
    pub fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        if off >= self.0.len || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min((self.0.len - off) as usize);
        let Some(d) = &self.0.digests else {
            let mut f = self.0.file.lock().unwrap_or_else(|p| p.into_inner());
            f.seek(SeekFrom::Start(off))?;
            return f.read(&mut buf[..want]);
        };
        let i = off / d.chunk;
        let bytes = self.checked_chunk(d, i)?;
        let at = (off - i * d.chunk) as usize;
        let n = want.min(bytes.len() - at);
        buf[..n].copy_from_slice(&bytes[at..at + n]);
        Ok(n)
    }

    /// Chunk `i`, read whole and compared with its digest (or from the
    /// cache of chunks already compared).
    fn checked_chunk(&self, d: &Digests, i: u64) -> io::Result<Arc<[u8]>> {
        let mut cache = d.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, b)) = cache.iter().find(|(k, _)| *k == i) {
            return Ok(b.clone());
        }
        let start = i * d.chunk;
        let len = d.chunk.min(self.0.len - start) as usize;
        let mut buf = vec![0u8; len];
        let n = {
            let mut f = self.0.file.lock().unwrap_or_else(|p| p.into_inner());
            f.seek(SeekFrom::Start(start))?;
            read_full(&mut *f, &mut buf)?
        };
        if n != len || d.kind.of(i, d.chunk, &buf) != d.blake3[i as usize] {
            let why = format!(
                "{}: bytes {start}..{} (chunk {i}) do not match evidence.json",
                self.0.name,
                start + len as u64
            );
            d.log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(why.clone());
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
        let b: Arc<[u8]> = buf.into();
        if cache.len() == CACHED_CHUNKS {
            cache.remove(0);
        }
        cache.push((i, b.clone()));
        Ok(b)
    }
}

/// A position in a [`ChunkedFile`]: `Read + Seek` for the CSV reader.
pub struct Cursor {
    file: ChunkedFile,
    pos: u64,
}

impl Read for Cursor {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(self.pos, buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Cursor {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let p = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.file.len().checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = p.ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "seek before the file's start")
        })?;
        Ok(self.pos)
    }
}

impl Length for ChunkedFile {
    fn len(&self) -> u64 {
        self.0.len
    }
}

impl ChunkReader for ChunkedFile {
    type T = Cursor;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Cursor> {
        Ok(self.cursor(start))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let mut buf = vec![0u8; length];
        let n = read_full(&mut self.cursor(start), &mut buf)
            .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
        if n < length {
            return Err(parquet::errors::ParquetError::EOF(format!(
                "expected to read {length} bytes at offset {start}, got {n}"
            )));
        }
        Ok(buf.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_powers_of_two_with_at_most_max_chunks() {
        for (bytes, chunk) in [
            (0, MIN_CHUNK_BYTES),
            (CHUNKED_FROM, MIN_CHUNK_BYTES),
            (4096 << 20, 1 << 20),
            ((4096 << 20) + 1, 2 << 20),
            (10 << 30, 4 << 20),
            (u64::MAX, 1 << 52),
        ] {
            assert_eq!(chunk_bytes_for(bytes), chunk, "{bytes}");
            assert!(chunk_count(bytes) <= MAX_CHUNKS, "{bytes}");
        }
    }

    fn file_of(len: usize) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("f");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        (tmp, p, data)
    }

    #[test]
    fn subtree_digests_make_up_blake3_for_every_chunk_count_and_tail() {
        let data: Vec<u8> = (0..70 * 2048 + 7)
            .map(|i| (i * 31 + i / 977) as u8)
            .collect();
        for chunk in [1024u64, 2048] {
            for n in 2..70usize {
                for tail in [1usize, 17, chunk as usize] {
                    let len = (n - 1) * chunk as usize + tail;
                    let bytes = &data[..len];
                    let cvs: Vec<[u8; 32]> = bytes
                        .chunks(chunk as usize)
                        .enumerate()
                        .map(|(i, c)| ChunkDigest::Subtree.of(i as u64, chunk, c))
                        .collect();
                    assert_eq!(
                        root_with(&cvs, chunk, len as u64),
                        Some(blake3::hash(bytes)),
                        "chunk {chunk}, {n} chunks, tail {tail}"
                    );
                    // Any chunk digest changed: another root.
                    let mut other = cvs.clone();
                    other[n / 2][0] ^= 1;
                    assert_ne!(
                        root_with(&other, chunk, len as u64),
                        Some(blake3::hash(bytes))
                    );
                }
            }
        }
        assert_eq!(root_with(&[[0; 32]], 1024, 1000), None);
        assert_eq!(root_with(&[[0; 32]; 3], 1024, 5000), None);
    }

    #[test]
    fn digests_cover_the_file_and_match_b3_of_each_range() {
        let (_t, p, data) = file_of(CHUNKED_FROM as usize + 12_345);
        let whole_b3 = blake3::hash(&data).to_hex().to_string();
        let (whole, n, plain) = digest_file(&p, ChunkDigest::Plain).unwrap();
        assert_eq!(whole, whole_b3);
        assert_eq!(n, data.len() as u64);
        let plain = plain.unwrap();
        assert_eq!(plain.len(), 5);
        for (i, c) in data.chunks(MIN_CHUNK_BYTES as usize).enumerate() {
            assert_eq!(plain[i], blake3::hash(c).to_hex().to_string());
        }
        assert!(
            !binds(&plain, n, &whole),
            "plain digests are bound to nothing"
        );
        let (whole, n, cvs) = digest_file(&p, ChunkDigest::Subtree).unwrap();
        assert_eq!((whole.as_str(), n), (whole_b3.as_str(), data.len() as u64));
        let cvs = cvs.unwrap();
        assert_eq!(cvs.len(), 5);
        assert!(binds(&cvs, n, &whole));
        let mut edited = cvs.clone();
        edited[2] = "ab".repeat(32);
        assert!(!binds(&edited, n, &whole));
        assert!(!binds(&cvs, n, &"ab".repeat(32)));
        assert!(!binds(&cvs[1..], n, &whole));
        let (_t, small, data) = file_of(1000);
        for kind in [ChunkDigest::Plain, ChunkDigest::Subtree] {
            let (whole, n, chunks) = digest_file(&small, kind).unwrap();
            assert_eq!(
                (whole, n, chunks),
                (blake3::hash(&data).to_hex().to_string(), 1000, None)
            );
        }
    }

    #[test]
    fn a_checked_read_serves_matching_bytes_and_refuses_a_changed_chunk() {
        for kind in [ChunkDigest::Subtree, ChunkDigest::Plain] {
            let (_t, p, data) = file_of(CHUNKED_FROM as usize + 100);
            let (_, n, chunks) = digest_file(&p, kind).unwrap();
            let chunks = chunks.unwrap();
            let log = MismatchLog::default();
            let f = ChunkedFile::open_checked(&p, "f", n, kind, &chunks, log.clone()).unwrap();
            // A read across a chunk boundary, through the cursor.
            let mut c = f.cursor(MIN_CHUNK_BYTES - 3);
            let mut buf = [0u8; 10];
            read_full(&mut c, &mut buf).unwrap();
            let at = MIN_CHUNK_BYTES as usize - 3;
            assert_eq!(&buf, &data[at..at + 10]);
            assert_eq!(f.get_bytes(5, 4).unwrap().as_ref(), &data[5..9]);
            let end = f.get_bytes(n - 3, 3).unwrap();
            assert_eq!(end.as_ref(), &data[data.len() - 3..]);
            assert!(log.lock().unwrap().is_empty());
            // One byte of chunk 3 changed: chunks 0..3 still read, chunk 3 fails.
            let mut edited = data.clone();
            edited[3 * MIN_CHUNK_BYTES as usize + 17] ^= 1;
            std::fs::write(&p, &edited).unwrap();
            let f = ChunkedFile::open_checked(&p, "f", n, kind, &chunks, log.clone()).unwrap();
            assert_eq!(f.get_bytes(100, 4).unwrap().as_ref(), &data[100..104]);
            let e = f
                .get_bytes(3 * MIN_CHUNK_BYTES + 1, 4)
                .unwrap_err()
                .to_string();
            assert!(e.contains("chunk 3") && e.contains("do not match"), "{e}");
            assert_eq!(log.lock().unwrap().len(), 1);
            // Another size than recorded, or a wrong number of digests.
            let open = |bytes, d: &[String]| {
                ChunkedFile::open_checked(&p, "f", bytes, kind, d, log.clone()).is_err()
            };
            assert!(open(n - 1, &chunks));
            assert!(open(n, &chunks[1..]));
            let mut bad = chunks.clone();
            bad[0] = "zz".into();
            assert!(open(n, &bad));
        }
        // Subtree digests are not plain ones: a record's kind matters.
        let (_t, p, _) = file_of(CHUNKED_FROM as usize + 100);
        let (_, n, plain) = digest_file(&p, ChunkDigest::Plain).unwrap();
        let log = MismatchLog::default();
        let f = ChunkedFile::open_checked(&p, "f", n, ChunkDigest::Subtree, &plain.unwrap(), log)
            .unwrap();
        assert!(f.get_bytes(0, 4).is_err());
    }
}
