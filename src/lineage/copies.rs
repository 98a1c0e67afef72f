//! The copy index: for every source pool, the copies that will read it,
//! sorted by src_seq, so the source can capture each copy's content just
//! before it moves past that seq.
//!
//! The index is built during the index pass and kept in memory up to a
//! bound; past it, sorted chunks are spilled to a temporary directory and
//! merged back while replaying, so memory never grows with the number of
//! copies in the trace.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use super::input::CopyReq;
use crate::error::{Error, Result};

/// Copies kept in memory before the index spills (2 MB).
pub const COPY_CHUNK: usize = 1 << 16;

const REC: usize = 32;

fn encode(c: &CopyReq) -> [u8; REC] {
    let mut b = [0u8; REC];
    b[0..8].copy_from_slice(&c.src_seq.to_le_bytes());
    b[8..10].copy_from_slice(&c.dst_pool.to_le_bytes());
    b[16..24].copy_from_slice(&c.dst_seq.to_le_bytes());
    b[24..28].copy_from_slice(&c.src_start.to_le_bytes());
    b[28..32].copy_from_slice(&c.count.to_le_bytes());
    b
}

fn decode(b: &[u8; REC]) -> CopyReq {
    let u64_ = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let u32_ = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    CopyReq {
        src_seq: u64_(0),
        dst_pool: u16::from_le_bytes([b[8], b[9]]),
        dst_seq: u64_(16),
        src_start: u32_(24),
        count: u32_(28),
    }
}

/// Collects copies, spilling sorted chunks past `limit` entries.
pub struct CopySpiller {
    root: Option<PathBuf>,
    dir: Option<tempfile::TempDir>,
    limit: usize,
    mem: BTreeMap<u16, Vec<CopyReq>>,
    /// Copy edges (src pool, dst pool) seen, spilled or not.
    edges: std::collections::BTreeSet<(u16, u16)>,
    n: usize,
    runs: BTreeMap<u16, Vec<PathBuf>>,
    files: usize,
    pub spilled: u64,
}

impl CopySpiller {
    pub fn new(root: Option<&Path>, limit: usize) -> Self {
        CopySpiller {
            root: root.map(Path::to_path_buf),
            dir: None,
            limit: limit.max(1),
            mem: BTreeMap::new(),
            edges: Default::default(),
            n: 0,
            runs: BTreeMap::new(),
            files: 0,
            spilled: 0,
        }
    }

    pub fn push(&mut self, src_pool: u16, c: CopyReq) -> Result<()> {
        self.edges.insert((src_pool, c.dst_pool));
        self.mem.entry(src_pool).or_default().push(c);
        self.n += 1;
        if self.n >= self.limit {
            self.spill()?;
        }
        Ok(())
    }

    fn spill(&mut self) -> Result<()> {
        if self.dir.is_none() {
            self.dir = Some(super::input::temp_dir(
                self.root.as_deref(),
                "kvtrail-copies-",
            )?);
        }
        let dir = self.dir.as_ref().expect("dir").path().to_path_buf();
        for (pool, v) in std::mem::take(&mut self.mem) {
            if v.is_empty() {
                continue;
            }
            let mut v = v;
            v.sort_unstable();
            let path = dir.join(format!("copies-{:06}.bin", self.files));
            self.files += 1;
            let f = File::create(&path).map_err(|e| Error::io(&path, e))?;
            let mut w = BufWriter::with_capacity(1 << 20, f);
            for c in &v {
                w.write_all(&encode(c)).map_err(|e| Error::io(&path, e))?;
            }
            w.flush().map_err(|e| Error::io(&path, e))?;
            self.spilled += v.len() as u64;
            self.runs.entry(pool).or_default().push(path);
        }
        self.n = 0;
        Ok(())
    }

    /// Ends collection: what stays in memory is sorted.
    pub fn finish(mut self) -> CopyPlan {
        for v in self.mem.values_mut() {
            v.sort_unstable();
        }
        CopyPlan {
            mem: self.mem,
            edges: self.edges,
            dst_filter: None,
            runs: self.runs,
            spilled: self.spilled,
            _dir: self.dir,
        }
    }
}

/// The finished copy index.
pub struct CopyPlan {
    mem: BTreeMap<u16, Vec<CopyReq>>,
    edges: std::collections::BTreeSet<(u16, u16)>,
    /// When set (a shard), only copies into these pools are streamed.
    dst_filter: Option<std::collections::BTreeSet<u16>>,
    runs: BTreeMap<u16, Vec<PathBuf>>,
    pub spilled: u64,
    _dir: Option<tempfile::TempDir>,
}

impl CopyPlan {
    /// Every (src pool, dst pool) pair some copy connects.
    pub fn edges(&self) -> impl Iterator<Item = (u16, u16)> + '_ {
        self.edges.iter().copied()
    }

    /// Keeps only copies between `pools` (a shard's replayed pools); copies
    /// spilled to disk are filtered as they are streamed.
    pub fn restrict(&mut self, pools: &std::collections::BTreeSet<u16>) {
        self.mem.retain(|p, _| pools.contains(p));
        self.runs.retain(|p, _| pools.contains(p));
        for v in self.mem.values_mut() {
            v.retain(|c| pools.contains(&c.dst_pool));
        }
        self.edges
            .retain(|(s, d)| pools.contains(s) && pools.contains(d));
        self.dst_filter = Some(pools.clone());
    }

    /// The copies reading `pool`, in src_seq order.
    pub fn stream(&self, pool: u16) -> Result<CopyStream> {
        let mut runs = Vec::new();
        for p in self.runs.get(&pool).into_iter().flatten() {
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            let mut r = RunReader {
                path: p.clone(),
                reader: BufReader::with_capacity(64 * 1024, f),
                head: None,
            };
            r.advance()?;
            runs.push(r);
        }
        let mut s = CopyStream {
            dst_filter: self.dst_filter.clone(),
            mem: self.mem.get(&pool).cloned().unwrap_or_default(),
            pos: 0,
            runs,
            head: None,
        };
        s.pick();
        Ok(s)
    }

    /// All copies in memory (for tests and small traces).
    pub fn in_memory(&self) -> usize {
        self.mem.values().map(Vec::len).sum()
    }
}

struct RunReader {
    path: PathBuf,
    reader: BufReader<File>,
    head: Option<CopyReq>,
}

impl RunReader {
    fn advance(&mut self) -> Result<()> {
        let mut b = [0u8; REC];
        self.head = match self.reader.read_exact(&mut b) {
            Ok(()) => Some(decode(&b)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => None,
            Err(e) => return Err(Error::io(&self.path, e)),
        };
        Ok(())
    }
}

/// The copies reading one pool, merged in src_seq order.
pub struct CopyStream {
    dst_filter: Option<std::collections::BTreeSet<u16>>,
    mem: Vec<CopyReq>,
    pos: usize,
    runs: Vec<RunReader>,
    /// The smallest head: None = in memory, Some(i) = run i.
    head: Option<(CopyReq, Option<usize>)>,
}

impl CopyStream {
    fn pick(&mut self) {
        // Skip spilled copies into pools a shard does not replay.
        if let Some(f) = &self.dst_filter {
            for r in self.runs.iter_mut() {
                while let Some(h) = r.head
                    && !f.contains(&h.dst_pool)
                {
                    if r.advance().is_err() {
                        break;
                    }
                }
            }
        }
        let mut best: Option<(CopyReq, Option<usize>)> = self.mem.get(self.pos).map(|c| (*c, None));
        for (i, r) in self.runs.iter().enumerate() {
            if let Some(h) = r.head
                && best.is_none_or(|b| h < b.0)
            {
                best = Some((h, Some(i)));
            }
        }
        self.head = best;
    }

    /// The next copy, if any.
    pub fn peek(&self) -> Option<CopyReq> {
        self.head.map(|h| h.0)
    }

    /// Moves past the copy `peek` returned.
    pub fn pop(&mut self) -> Result<()> {
        match self.head {
            None => return Ok(()),
            Some((_, None)) => self.pos += 1,
            Some((_, Some(i))) => self.runs[i].advance()?,
        }
        self.pick();
        Ok(())
    }
}
