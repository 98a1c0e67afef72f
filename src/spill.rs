//! External sorting and merging with bounded memory: the one home of
//! "hold so many records, write a sorted run to disk, merge the runs back".
//!
//! - [`Record`]: a fixed-size record (its little-endian encoding).
//! - [`Place`]: where runs go: unnamed temporary files (they vanish with
//!   the process), or named files in a temporary folder made on first use
//!   and removed when the place is dropped (for callers that keep many
//!   runs and must not hold a file descriptor per run).
//! - [`Run`]: one run on disk, read by any number of [`RunReader`]s at once
//!   (positional reads: readers never share a file offset).
//! - [`Merge`]: the k-way merge of sorted [`Source`]s (runs, vectors, any
//!   cursor), ties broken by the source's position, so a merge is
//!   deterministic.
//! - [`Tiers`]: sorted runs kept in tiers: [`FAN`] runs of one tier are
//!   merged into one run of the next as they come, so the runs open while
//!   merging grow with the logarithm of the records.
//! - [`Sorter`]: a [`Tiers`] with an in-memory chunk in front: push records
//!   in any order, get them back sorted.
//!
//! Memory: one chunk of records plus a read buffer ([`READ_BUF`]) per run
//! merged; disk: the records' encoding, once per tier.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::marker::PhantomData;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};

/// Runs of one tier merged into one run of the next.
pub const FAN: usize = 16;

/// Read buffer of one run while streaming or merging.
pub const READ_BUF: usize = 64 * 1024;

/// A record of fixed size that can be written to a run and read back.
pub trait Record: Copy {
    /// Bytes of one encoded record.
    const SIZE: usize;
    /// Writes the record into `out` (`SIZE` bytes).
    fn put(&self, out: &mut [u8]);
    /// Reads a record from `b` (`SIZE` bytes).
    fn get(b: &[u8]) -> Self;
}

/// A sorted stream of records.
pub trait Source<R> {
    fn next_record(&mut self) -> Result<Option<R>>;
}

impl<R> Source<R> for std::vec::IntoIter<R> {
    fn next_record(&mut self) -> Result<Option<R>> {
        Ok(self.next())
    }
}

/// Where runs are written.
pub struct Place {
    root: Option<PathBuf>,
    prefix: &'static str,
    named: bool,
    dir: Option<tempfile::TempDir>,
    files: u64,
}

impl Place {
    /// Unnamed temporary files in `root` (default: the system's temporary
    /// folder); `label` names the place in errors (e.g. "seq check").
    pub fn unnamed(root: Option<&Path>, label: &'static str) -> Place {
        Place {
            root: root.map(Path::to_path_buf),
            prefix: label,
            named: false,
            dir: None,
            files: 0,
        }
    }

    /// Named files in a temporary folder `PREFIX...` under `root` (default:
    /// the system's), made on first use and removed with the place.
    pub fn named(root: Option<&Path>, prefix: &'static str) -> Place {
        Place {
            root: root.map(Path::to_path_buf),
            prefix,
            named: true,
            dir: None,
            files: 0,
        }
    }

    /// What errors name: the folder of the runs.
    fn where_(&self) -> PathBuf {
        match (&self.dir, &self.root) {
            (Some(d), _) => d.path().to_path_buf(),
            (None, Some(r)) => r.clone(),
            (None, None) => PathBuf::from(format!("$TMPDIR ({})", self.prefix)),
        }
    }

    /// A new file for a run: (its handle, its path if named, the path
    /// errors name).
    fn create(&mut self) -> Result<(File, Option<PathBuf>, PathBuf)> {
        if !self.named {
            let at = self.where_();
            let f = match &self.root {
                Some(r) => tempfile::tempfile_in(r),
                None => tempfile::tempfile(),
            }
            .map_err(|e| Error::io(&at, e))?;
            return Ok((f, None, at));
        }
        if self.dir.is_none() {
            let b = {
                let mut b = tempfile::Builder::new();
                b.prefix(self.prefix);
                b
            };
            let d = match &self.root {
                Some(r) => b.tempdir_in(r),
                None => b.tempdir(),
            }
            .map_err(|e| Error::io(&self.where_(), e))?;
            self.dir = Some(d);
        }
        let dir = self.dir.as_ref().expect("made above").path();
        let path = dir.join(format!("run-{:06}.bin", self.files));
        self.files += 1;
        let f = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok((f, Some(path.clone()), path))
    }
}

/// Where a run's bytes are.
#[derive(Debug, Clone)]
enum Store {
    /// An unnamed file, shared by its readers.
    Open(Arc<File>),
    /// A named file, opened by each reader.
    Named,
}

/// One run on disk: records in the order they were written.
#[derive(Debug)]
pub struct Run<R> {
    store: Store,
    /// The file's path (named) or its folder (unnamed), for errors.
    path: PathBuf,
    records: u64,
    _r: PhantomData<fn() -> R>,
}

impl<R> Clone for Run<R> {
    fn clone(&self) -> Self {
        Run {
            store: self.store.clone(),
            path: self.path.clone(),
            records: self.records,
            _r: PhantomData,
        }
    }
}

impl<R: Record> Run<R> {
    /// Writes `records` as a new run at `place`.
    pub fn write(place: &mut Place, records: impl IntoIterator<Item = R>) -> Result<Run<R>> {
        Self::try_write(place, records.into_iter().map(Ok))
    }

    /// As [`Run::write`], stopping at the first error of `records`.
    pub fn try_write(
        place: &mut Place,
        records: impl IntoIterator<Item = Result<R>>,
    ) -> Result<Run<R>> {
        let (f, named, path) = place.create()?;
        let io = |e| Error::io(&path, e);
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let mut b = vec![0u8; R::SIZE];
        let mut n = 0u64;
        for r in records {
            r?.put(&mut b);
            w.write_all(&b).map_err(io)?;
            n += 1;
        }
        let f = w.into_inner().map_err(|e| io(e.into_error()))?;
        let store = match named {
            Some(_) => Store::Named,
            None => Store::Open(Arc::new(f)),
        };
        Ok(Run {
            store,
            path,
            records: n,
            _r: PhantomData,
        })
    }

    /// Records in the run.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// A reader from the first record.
    pub fn reader(&self) -> Result<RunReader<R>> {
        self.reader_range(0, self.records)
    }

    fn file(&self) -> Result<Arc<File>> {
        match &self.store {
            Store::Open(f) => Ok(Arc::clone(f)),
            Store::Named => Ok(Arc::new(
                File::open(&self.path).map_err(|e| Error::io(&self.path, e))?,
            )),
        }
    }

    /// A reader of records `first..end` (clamped to the run).
    pub fn reader_range(&self, first: u64, end: u64) -> Result<RunReader<R>> {
        let end = end.min(self.records);
        Ok(RunReader {
            file: self.file()?,
            path: self.path.clone(),
            pos: first.min(end) * R::SIZE as u64,
            end: end * R::SIZE as u64,
            buf: Vec::new(),
            at: 0,
            _r: PhantomData,
        })
    }
}

/// Reads a run's records in order, through its own buffer.
pub struct RunReader<R> {
    file: Arc<File>,
    path: PathBuf,
    /// File offset of the byte after the buffer.
    pos: u64,
    end: u64,
    buf: Vec<u8>,
    at: usize,
    _r: PhantomData<fn() -> R>,
}

impl<R: Record> RunReader<R> {
    /// The next record, or `None` at the end of the run.
    pub fn next_record(&mut self) -> Result<Option<R>> {
        if self.at + R::SIZE > self.buf.len() {
            if self.pos >= self.end {
                return Ok(None);
            }
            let per = (READ_BUF / R::SIZE).max(1) * R::SIZE;
            let n = (per as u64).min(self.end - self.pos) as usize;
            self.buf.resize(n, 0);
            self.file
                .read_exact_at(&mut self.buf, self.pos)
                .map_err(|e| Error::io(&self.path, e))?;
            self.pos += n as u64;
            self.at = 0;
        }
        let r = R::get(&self.buf[self.at..self.at + R::SIZE]);
        self.at += R::SIZE;
        Ok(Some(r))
    }
}

impl<R: Record> Source<R> for RunReader<R> {
    fn next_record(&mut self) -> Result<Option<R>> {
        RunReader::next_record(self)
    }
}

impl<R: Record> Iterator for RunReader<R> {
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        self.next_record().transpose()
    }
}

/// The k-way merge of sorted sources: records in order, ties by the
/// source's position in the list.
pub struct Merge<R, S> {
    sources: Vec<S>,
    heap: BinaryHeap<Reverse<(R, usize)>>,
    failed: bool,
}

impl<R: Ord, S: Source<R>> Merge<R, S> {
    pub fn new(mut sources: Vec<S>) -> Result<Self> {
        let mut heap = BinaryHeap::with_capacity(sources.len());
        for (i, s) in sources.iter_mut().enumerate() {
            if let Some(r) = s.next_record()? {
                heap.push(Reverse((r, i)));
            }
        }
        Ok(Merge {
            sources,
            heap,
            failed: false,
        })
    }

    /// The smallest record left, without taking it.
    pub fn peek(&self) -> Option<&R> {
        self.heap.peek().map(|Reverse((r, _))| r)
    }

    /// The next record in order.
    pub fn next_record(&mut self) -> Result<Option<R>> {
        if self.failed {
            return Ok(None);
        }
        let Some(Reverse((r, i))) = self.heap.pop() else {
            return Ok(None);
        };
        match self.sources[i].next_record() {
            Ok(Some(n)) => self.heap.push(Reverse((n, i))),
            Ok(None) => {}
            Err(e) => {
                self.failed = true;
                return Err(e);
            }
        }
        Ok(Some(r))
    }
}

impl<R: Ord, S: Source<R>> Source<R> for Merge<R, S> {
    fn next_record(&mut self) -> Result<Option<R>> {
        Merge::next_record(self)
    }
}

impl<R: Ord, S: Source<R>> Iterator for Merge<R, S> {
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        self.next_record().transpose()
    }
}

/// A source of a sort's output: the chunk still in memory or a run.
pub enum Part<R> {
    Mem(std::vec::IntoIter<R>),
    Disk(RunReader<R>),
}

impl<R: Record> Source<R> for Part<R> {
    fn next_record(&mut self) -> Result<Option<R>> {
        match self {
            Part::Mem(it) => Ok(it.next()),
            Part::Disk(r) => r.next_record(),
        }
    }
}

/// Sorted runs in tiers: [`FAN`] runs of one tier become one run of the
/// next as soon as a tier holds that many.
pub struct Tiers<R> {
    /// (tier, run): tier 0 a run as added, tier t the merge of `FAN` runs
    /// of tier t - 1.
    runs: Vec<(u32, Run<R>)>,
}

impl<R> Default for Tiers<R> {
    fn default() -> Self {
        Tiers { runs: Vec::new() }
    }
}

impl<R: Record + Ord> Tiers<R> {
    /// Adds a sorted run; merges tiers that are full.
    pub fn add(&mut self, place: &mut Place, run: Run<R>) -> Result<()> {
        self.runs.push((0, run));
        loop {
            let mut per_tier = std::collections::BTreeMap::<u32, usize>::new();
            for (t, _) in &self.runs {
                *per_tier.entry(*t).or_default() += 1;
            }
            let Some((&tier, _)) = per_tier.iter().find(|(_, n)| **n >= FAN) else {
                return Ok(());
            };
            let (merged, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.runs)
                .into_iter()
                .partition(|(t, _)| *t == tier);
            self.runs = kept;
            let readers = merged
                .iter()
                .map(|(_, r)| r.reader())
                .collect::<Result<Vec<_>>>()?;
            let out = Run::try_write(place, Merge::new(readers)?)?;
            drop(merged);
            self.runs.push((tier + 1, out));
        }
    }

    /// The runs, oldest tier first within their order of addition.
    pub fn runs(&self) -> impl Iterator<Item = &Run<R>> {
        self.runs.iter().map(|(_, r)| r)
    }

    /// Runs held.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The highest tier held, plus one (0 when empty).
    pub fn depth(&self) -> usize {
        self.runs
            .iter()
            .map(|(t, _)| *t as usize + 1)
            .max()
            .unwrap_or(0)
    }
}

/// Records pushed in any order, handed back sorted: chunks of `chunk`
/// records sorted in memory and spilled to [`Tiers`] at `place`.
pub struct Sorter<R> {
    place: Place,
    chunk: usize,
    buf: Vec<R>,
    tiers: Tiers<R>,
    spilled: u64,
}

impl<R: Record + Ord> Sorter<R> {
    pub fn new(place: Place, chunk: usize) -> Self {
        Sorter {
            place,
            chunk: chunk.max(1),
            buf: Vec::new(),
            tiers: Tiers::default(),
            spilled: 0,
        }
    }

    pub fn push(&mut self, r: R) -> Result<()> {
        if self.buf.len() >= self.chunk {
            self.spill()?;
        }
        if self.buf.capacity() == 0 {
            // grown as records come, up to one chunk
            self.buf.reserve(self.chunk.min(4096));
        }
        self.buf.push(r);
        Ok(())
    }

    fn spill(&mut self) -> Result<()> {
        self.buf.sort_unstable();
        let v = std::mem::take(&mut self.buf);
        self.spilled += v.len() as u64;
        let run = Run::write(&mut self.place, v)?;
        self.tiers.add(&mut self.place, run)
    }

    /// Records written to disk so far (before tier merges).
    pub fn spilled(&self) -> u64 {
        self.spilled
    }

    /// Every record, ascending (the chunk in memory is the first source,
    /// then the runs). The place (and its named files) lives as long as
    /// the merge.
    pub fn finish(mut self) -> Result<Sorted<R>> {
        self.buf.sort_unstable();
        let mut parts = vec![Part::Mem(std::mem::take(&mut self.buf).into_iter())];
        for r in self.tiers.runs() {
            parts.push(Part::Disk(r.reader()?));
        }
        Ok(Sorted {
            merge: Merge::new(parts)?,
            _place: self.place,
        })
    }
}

/// A finished sort: its records in order.
pub struct Sorted<R> {
    merge: Merge<R, Part<R>>,
    _place: Place,
}

impl<R: Record + Ord> Iterator for Sorted<R> {
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        self.merge.next_record().transpose()
    }
}

/// Little-endian field access for [`Record`] implementations.
pub mod le {
    pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
    pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    pub fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }
    pub fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    pub fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
    }
}

impl Record for (u64, u64) {
    const SIZE: usize = 16;
    fn put(&self, b: &mut [u8]) {
        le::put_u64(b, 0, self.0);
        le::put_u64(b, 8, self.1);
    }
    fn get(b: &[u8]) -> Self {
        (le::u64_at(b, 0), le::u64_at(b, 8))
    }
}

impl Record for (u64, u32, u64) {
    const SIZE: usize = 20;
    fn put(&self, b: &mut [u8]) {
        le::put_u64(b, 0, self.0);
        le::put_u32(b, 8, self.1);
        le::put_u64(b, 12, self.2);
    }
    fn get(b: &[u8]) -> Self {
        (le::u64_at(b, 0), le::u32_at(b, 8), le::u64_at(b, 12))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrambled(n: u64) -> Vec<(u64, u64)> {
        (0..n).map(|i| ((i * 7919) % 1009, i)).collect()
    }

    #[test]
    fn a_sorter_hands_back_every_record_in_order_at_any_chunk() {
        let root = tempfile::tempdir().unwrap();
        for (chunk, named) in [
            (1, false),
            (2, true),
            (3, false),
            (7, true),
            (100_000, false),
        ] {
            let place = if named {
                Place::named(Some(root.path()), "kvtrail-test-")
            } else {
                Place::unnamed(Some(root.path()), "test")
            };
            let mut s = Sorter::new(place, chunk);
            let mut want = scrambled(2000);
            for &r in &want {
                s.push(r).unwrap();
            }
            let tiers = s.tiers.depth();
            assert!(
                s.tiers.len() <= tiers.max(1) * (FAN - 1),
                "chunk {chunk}: {} runs",
                s.tiers.len()
            );
            want.sort_unstable();
            let got: Vec<_> = s.finish().unwrap().map(Result::unwrap).collect();
            assert_eq!(got, want, "chunk {chunk}");
            // Unnamed runs and the named runs' folder are gone.
            assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
        }
    }

    #[test]
    fn readers_of_one_run_do_not_share_an_offset() {
        let mut place = Place::unnamed(None, "test");
        let run = Run::write(&mut place, (0..10_000u64).map(|i| (i, i * 2))).unwrap();
        let mut a = run.reader().unwrap();
        let mut b = run.reader_range(5_000, 5_003).unwrap();
        assert_eq!(a.next_record().unwrap(), Some((0, 0)));
        let mid: Vec<_> = b.by_ref().map(Result::unwrap).collect();
        assert_eq!(mid, vec![(5_000, 10_000), (5_001, 10_002), (5_002, 10_004)]);
        assert_eq!(a.next_record().unwrap(), Some((1, 2)));
        assert_eq!(a.count(), 9_998);
    }

    #[test]
    fn a_merge_breaks_ties_by_source_and_stops_at_an_error() {
        struct Failing(u8);
        impl Source<u64> for Failing {
            fn next_record(&mut self) -> Result<Option<u64>> {
                self.0 += 1;
                match self.0 {
                    1 => Ok(Some(5)),
                    _ => Err(Error::Other("broken run".into())),
                }
            }
        }
        let mut m = Merge::new(vec![Failing(0)]).unwrap();
        assert_eq!(m.peek(), Some(&5));
        assert!(m.next_record().is_err());
        assert_eq!(m.next_record().unwrap(), None);
        let m = Merge::new(vec![
            vec![(1u64, 'a'), (3, 'a')].into_iter(),
            vec![(1, 'a'), (2, 'b')].into_iter(),
        ])
        .unwrap();
        let got: Vec<_> = m.map(Result::unwrap).collect();
        assert_eq!(got, vec![(1, 'a'), (1, 'a'), (2, 'b'), (3, 'a')]);
    }
}
