//! Decoding ahead of the plan. The index pass (`input::Plan::build`)
//! reads every kv file's planning columns before the replay can start,
//! one file a core: a trace of fewer kv files than replay threads (one
//! large file: a PD trace) leaves cores idle. Then (`lineage::run_with`)
//! a thread of its own decodes the replay's rows of the first kv file, up
//! to a bound (`QUEUE_EVENTS` events, the shared decode's queue bound:
//! memory stays bounded, never the trace). The first reader of that file
//! from its first row (the shared decode of a copy-connected group, or a
//! pool's own reader) takes them, then reads on from where the decoding
//! stopped: the same chunks in the same order, and a damaged row fails at
//! the same row with the same error as a fresh reader's, so the replay's
//! output is byte-identical with or without it.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::Result;
use crate::schema::KvEvent;
use crate::trace::read::{KvChunk, KvFileReader, Trace};
use crate::trace::{Deployment, TraceRoot};

/// A kv file's reader with the chunks already decoded from it first.
pub struct Decoder {
    ahead: VecDeque<Result<KvChunk>>,
    reader: KvFileReader,
    /// The reader returned its last chunk (or an error) while decoding
    /// ahead: nothing follows the chunks held.
    ended: bool,
}

impl Decoder {
    /// A reader with nothing decoded ahead.
    pub fn fresh(reader: KvFileReader) -> Decoder {
        Decoder {
            ahead: VecDeque::new(),
            reader,
            ended: false,
        }
    }

    /// The next chunk: those decoded ahead first, then the reader's.
    pub fn next_chunk(&mut self) -> Option<Result<KvChunk>> {
        if let Some(c) = self.ahead.pop_front() {
            return Some(c);
        }
        if self.ended {
            return None;
        }
        self.reader.next()
    }

    /// Hands a used chunk's buffer back to the reader.
    pub fn recycle(&mut self, buf: Vec<KvEvent>) {
        self.reader.recycle(buf);
    }
}

/// The first kv file decoded ahead, until a reader of it takes it.
#[derive(Clone, Default)]
pub struct Ahead(Arc<Mutex<Option<(u32, Decoder)>>>);

impl Ahead {
    /// The decoded-ahead reader of file `fi`, once: the first reader of
    /// the file from its first row takes it.
    fn take(&self, fi: u32) -> Option<Decoder> {
        let mut slot = self.0.lock().ok()?;
        match slot.as_ref() {
            Some((f, _)) if *f == fi => slot.take().map(|(_, d)| d),
            _ => None,
        }
    }

    /// A reader of kv file `fi` (at `path`) from its first row: the
    /// decoded-ahead one when it is this file and nobody took it yet,
    /// else a fresh one.
    pub fn open(
        &self,
        fi: u32,
        root: &TraceRoot,
        path: &Path,
        deployment: &Deployment,
    ) -> Result<Decoder> {
        match self.take(fi) {
            Some(d) => Ok(d),
            None => KvFileReader::open(root, path, deployment).map(Decoder::fresh),
        }
    }
}

/// A decoding-ahead thread. Dropped unfinished (the plan failed), it is
/// told to stop and joined.
pub struct Started {
    fi: u32,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Option<Decoder>>>,
}

/// Starts decoding kv file `fi` of `trace` ahead, up to `max_events`
/// events. A file that fails to open is left to its readers (each meets
/// the error itself).
pub fn start(trace: &Trace, fi: u32, max_events: usize) -> Option<Started> {
    let path = trace.kv_files.get(fi as usize)?.clone();
    let root = trace.root.clone();
    let deployment = trace.manifest.deployment.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("kvtrail-ahead".into())
        .spawn(move || {
            let reader = KvFileReader::open(&root, &path, &deployment).ok()?;
            let mut d = Decoder::fresh(reader);
            let mut events = 0usize;
            while events < max_events && !flag.load(Ordering::Relaxed) {
                match d.reader.next() {
                    None => {
                        d.ended = true;
                        break;
                    }
                    Some(Ok(c)) => {
                        events += c.events.len();
                        d.ahead.push_back(Ok(c));
                    }
                    Some(Err(e)) => {
                        d.ahead.push_back(Err(e));
                        d.ended = true;
                        break;
                    }
                }
            }
            Some(d)
        })
        .ok()?;
    Some(Started {
        fi,
        stop,
        thread: Some(thread),
    })
}

impl Started {
    /// Waits for the thread (it stops at its bound) and hands its reader
    /// over.
    pub fn finish(mut self) -> Ahead {
        let d = self.thread.take().and_then(|t| t.join().ok()).flatten();
        Ahead(Arc::new(Mutex::new(d.map(|d| (self.fi, d)))))
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::{Recorder, RecorderOptions};
    use crate::schema::Op;
    use crate::trace::Deployment;

    /// A one-pool trace of `n` events.
    fn trace(dir: &Path, n: u32) -> Trace {
        let dep: Deployment = serde_json::from_str(
            r#"{"engine": "test", "context_window": 64,
                "pools": [{"id": 0, "role": "mixed", "capacity_tokens": 4096}]}"#,
        )
        .unwrap();
        let opts = RecorderOptions {
            started_ns: Some(1),
            ..Default::default()
        };
        let mut rec = Recorder::create(dir, dep, opts).unwrap();
        for i in 0..n {
            let op = if i % 2 == 0 { Op::Alloc } else { Op::Free };
            rec.kv(KvEvent {
                pool: 0,
                seq: 0,
                ts_ns: 1 + i as i64,
                request_id: 1 + (i / 2) as u64,
                op,
                slot_start: (i / 2) % 64,
                slot_count: 1,
                token_pos: None,
                src: None,
            })
            .unwrap();
        }
        rec.close().unwrap();
        Trace::open(dir).unwrap()
    }

    fn chunks(mut next: impl FnMut() -> Option<Result<KvChunk>>) -> Vec<(u64, Vec<KvEvent>)> {
        std::iter::from_fn(|| next().map(|c| c.unwrap()))
            .map(|c| (c.first_row, c.events))
            .collect()
    }

    /// Taken after decoding stopped at its bound, at the file's end, or
    /// not started at all: the same chunks as a fresh reader's, once.
    #[test]
    fn a_reader_taken_from_ahead_reads_as_a_fresh_one() {
        let d = tempfile::tempdir().unwrap();
        // Three reader chunks (64 Ki rows each, the last shorter).
        let t = trace(&d.path().join("t"), 150_000);
        let path = t.kv_files[0].clone();
        let dep = t.manifest.deployment.clone();
        let mut fresh = KvFileReader::open(&t.root, &path, &dep).unwrap();
        let want = chunks(|| fresh.next());
        assert_eq!(want.len(), 3);
        for bound in [1, 70_000, 1_000_000] {
            let ahead = start(&t, 0, bound).unwrap().finish();
            assert!(ahead.take(1).is_none(), "another file's reader");
            let mut d = ahead.open(0, &t.root, &path, &dep).unwrap();
            assert_eq!(chunks(|| d.next_chunk()), want, "bound {bound}");
            assert!(ahead.take(0).is_none(), "taken twice");
        }
        // Stopped before it decoded (the plan failed): nothing held.
        let s = start(&t, 0, 1_000_000).unwrap();
        drop(s);
    }
}
