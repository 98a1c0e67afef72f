//! The writer thread: the only owner of the [`Recorder`]. Applies batches in
//! arrival order, joins the two halves of PD KV transfers into `write`
//! events with `src`, pairs the prefill and decode views of a request, and
//! enforces --max-bytes.
//!
//! Transfer join. The prefill worker reports `xfer_send` (its source pages,
//! where they go in the decode's destination list, whether it was the last
//! chunk); the writer stamps it with the prefill pool's current seq, which
//! is exact because that pool's events all come, in order, from the one
//! connection that holds it. The decode worker reports `xfer_commit` (its
//! destination pages) when the transfer succeeded; the writer then emits, on
//! the decode pool, one `write`-with-src per contiguous run of copied pages.
//! Pages decode preallocated but prefill never sent get no write: a later
//! read of them is what replay flags. If the commit arrives before the last
//! send, the decode connection's stream is parked (so its later reads stay
//! after the copy) for up to `copy_timeout`; then the copy is recorded as
//! one lost event (a hole), never guessed.
//!
//! Request pairing. A connection whose pools are all prefill pools reports
//! the prefill view of a request (it alone knows `prefilled_tokens`), an
//! all-decode connection the decode view (status and output the client
//! got). Rows with the same request_id are merged; a view without its
//! partner is written alone after `pair_timeout` or at close.
//!
//! [`Recorder`]: crate::capture::Recorder

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::wire::{EngineCopy, GuardDecision, LoadPolicy, Msg, PageRun, XferCommit, XferPull};

mod xfer;
use super::live::Live;
use super::shared::{Batch, RecordSummary, SealCost, Shared, View};
use super::stats::add;
use crate::capture::Recorder;
use crate::custody::seal::{PoolCounts, SealJob, Sealer};
use crate::error::{Error, Result};
use crate::lineage::backend::PoolMap;
use crate::schema::{KvEvent, RequestRecord};
use crate::trace::manifest::FileEntry;

struct Chunk {
    src_pool: u16,
    src_seq: u64,
    dst_index: u32,
    src_pages: Vec<PageRun>,
}

#[derive(Default)]
struct Room {
    chunks: Vec<Chunk>,
    last: bool,
    since: Option<Instant>,
    /// A send was dropped (--max-pending-bytes): the copy cannot be
    /// rebuilt and becomes a hole when its commit comes.
    broken: bool,
    /// Held bytes (estimated), counted in `W::held`.
    bytes: u64,
}

/// What a parked stream waits for.
enum Wait {
    /// A commit waits for its room's last send.
    Commit(Box<XferCommit>),
    /// A pull waits until the connection holding its source pool has marked
    /// past the pull's time (or ended).
    Pull(Box<XferPull>),
}

/// The feed of one pool: the connection that holds it and how far that
/// connection has promised its events are sent.
struct Feed {
    conn: Option<u64>,
    /// Every event of the pool stamped at or before this has arrived
    /// (`i64::MAX` once its connection ended cleanly).
    mark: i64,
    /// A pull waited for this feed until `--copy-timeout` and it had not
    /// marked since: later pulls from it are holes at once (a client that
    /// sends no marks holds up one pull, not every one).
    silent: bool,
}

/// How a connection's positions of one pool map to seqs: position k (the
/// k-th event the connection reported for the pool) is seq `base + k - 1`,
/// as long as only that connection changed the pool since its claim.
struct Positions {
    conn: u64,
    base: u64,
    /// Another connection's stream changed the pool after the claim (a
    /// parked stream of its former holder): positions no longer map.
    broken: bool,
}

/// Whether a pull can be stamped now.
enum Ready {
    Now,
    Wait,
    Never(String),
}

struct Parked {
    wait: Wait,
    /// The view of the parked connection's stream.
    view: View,
    since: Instant,
    queue: VecDeque<Msg>,
    /// Held bytes (estimated), counted in `W::held`.
    bytes: u64,
}

/// Estimated bytes of a map entry beyond its key and value (a table runs
/// up to half empty before it grows) and of a heap block beyond its bytes.
const ENTRY: u64 = 32;
const ALLOC: u64 = 16;

fn string_bytes(r: &RequestRecord) -> u64 {
    [&r.external_id, &r.finish_reason]
        .into_iter()
        .flatten()
        .chain([&r.tenant])
        .map(|s| s.capacity() as u64 + ALLOC)
        .sum()
}

/// Estimated bytes one pending request view holds. Measured: 113 000
/// unpaired views (two 128-byte strings each) filling the default 64 MiB
/// left the sidecar at 85 MB peak resident memory, 8 MiB at 20 MB.
fn view_bytes(r: &RequestRecord) -> u64 {
    (size_of::<(u64, usize)>() as u64) * 2
        + ENTRY
        + size_of::<(View, RequestRecord, Instant)>() as u64
        + ALLOC
        + string_bytes(r)
}

/// Estimated bytes one queued message holds.
fn msg_bytes(m: &Msg) -> u64 {
    let boxed = match m {
        Msg::Request(r) => size_of::<RequestRecord>() as u64 + string_bytes(r),
        Msg::XferSend(x) => {
            size_of::<super::wire::XferSend>() as u64 + 8 * x.src_pages.len() as u64
        }
        Msg::XferCommit(x) => size_of::<XferCommit>() as u64 + 8 * x.dst_pages.len() as u64,
        Msg::XferPull(x) => x.bytes(),
        Msg::Copy(x) => size_of::<EngineCopy>() as u64 + 12 * x.runs.len() as u64,
        Msg::Guard(g) => size_of::<GuardDecision>() as u64 + 8 * g.sources.len() as u64,
        Msg::Open { pools } => 2 * pools.len() as u64,
        Msg::KvRuns(evs) => size_of::<KvEvent>() as u64 * evs.len() as u64,
        Msg::Kv { .. }
        | Msg::Lost { .. }
        | Msg::Hole { .. }
        | Msg::Mark { .. }
        | Msg::GuardOk { .. }
        | Msg::Bye(_)
        | Msg::End { .. } => 0,
    };
    size_of::<Msg>() as u64 + boxed
}

struct W<'a> {
    /// Live detection, fed every event written, loss and request row.
    live: Option<Live>,
    rec: Recorder,
    sh: &'a Shared,
    rooms: HashMap<u64, Room>,
    parked: HashMap<u64, Parked>,
    /// Boxed, so the table's spare capacity costs a pointer per bucket and
    /// the estimate (`view_bytes`) stays close to what is resident.
    pending: HashMap<u64, Box<(View, RequestRecord, Instant)>>,
    /// Estimated bytes held by `pending`, `rooms` and `parked` (bounded by
    /// --max-pending-bytes).
    held: u64,
    stopped_at_max: bool,
    logged: u32,
    /// Per pool: next seq after the last event actually written. A pool
    /// whose recorder seq is beyond it at close lost its last events: no
    /// later event shows that hole, so the capture is marked incomplete.
    written_next: PoolMap<u64>,
    /// Per consumer pool: the load-failure policies its pulls reported
    /// (kept for trace.json's `capture.kv_load_failure_policy`).
    policies: std::collections::BTreeMap<u16, Vec<LoadPolicy>>,
    /// Per pool: (ts_ns, seq) of its latest content changes, at most
    /// [`RECENT`] each: every written event (plain, committed copy, pull)
    /// and every hole (at the time of the event before it: the lost events
    /// may be anywhere after it), so a pull is stamped with the source
    /// pool's last change at or before the load (`xfer_pull`'s ts_ns).
    recent: PoolMap<VecDeque<(i64, u64)>>,
    /// Per pool: who feeds it and how far (stamping pulls causally).
    feeds: HashMap<u16, Feed>,
    /// Deployment pools no connection has claimed yet that a pull waited
    /// for until `--copy-timeout`: later pulls from them are holes at once,
    /// until a connection claims them.
    unclaimed_silent: HashSet<u16>,
    /// Per live connection: the pools it holds.
    conns: HashMap<u64, Vec<u16>>,
    /// Per pool: where its holder's positions start (engine copies).
    positions: PoolMap<Positions>,
    /// Ids of the request rows written so far (a second row for one id is a
    /// conflict). About 16 bytes per request, like the request keys every
    /// analysis holds.
    written_ids: HashSet<u64>,
    /// Request ids reported by two requests (left unattributed at close).
    conflicts: BTreeSet<u64>,
    /// Seconds spent handing the sealer each interval's state, and
    /// encoding the rows buffered at that moment (work moved earlier).
    seal_s: f64,
    seal_flush_s: f64,
}

/// How many recent (ts_ns, seq) pairs the writer keeps per pool for
/// stamping pulls: a pull older than that window becomes a hole.
const RECENT: usize = 1 << 16;

/// Runs the writer to the end. A failure (an I/O error, or a panic, which
/// no input should cause) is never silent: it is logged at once and flagged
/// for the CLI, the trace stays marked incomplete, and the error is what
/// `Sidecar::shutdown` returns.
pub(crate) fn run(
    rec: Recorder,
    sealer: Option<Sealer>,
    rx: Receiver<Batch>,
    sh: Arc<Shared>,
    out: &Path,
    live: Option<Live>,
) -> Result<RecordSummary> {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        run_inner(rec, sealer, rx, &sh, out, live)
    }))
    .unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(Error::Other(format!("the writer thread panicked: {why}")))
    });
    if let Err(e) = &r {
        sh.writer_failed.store(true, Ordering::SeqCst);
        sh.log(&format!(
            "writer stopped: {}; nothing more is recorded and the capture stays incomplete",
            e.to_string().replace('\n', " ")
        ));
    }
    r
}

fn run_inner(
    rec: Recorder,
    mut sealer: Option<Sealer>,
    rx: Receiver<Batch>,
    sh: &Shared,
    out: &Path,
    live: Option<Live>,
) -> Result<RecordSummary> {
    let mut w = W {
        live,
        rec,
        sh,
        rooms: HashMap::new(),
        parked: HashMap::new(),
        pending: HashMap::new(),
        held: 0,
        stopped_at_max: false,
        logged: 0,
        written_next: PoolMap::default(),
        policies: Default::default(),
        recent: PoolMap::default(),
        feeds: HashMap::new(),
        unclaimed_silent: HashSet::new(),
        conns: HashMap::new(),
        positions: PoolMap::default(),
        written_ids: HashSet::new(),
        conflicts: BTreeSet::new(),
        seal_s: 0.0,
        seal_flush_s: 0.0,
    };
    let mut last_tick = Instant::now();
    let mut last_seal = Instant::now();
    let res: Result<()> = (|| {
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(b) if b.conn == u64::MAX => break,
                Ok(b) => w.batch(b)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if last_tick.elapsed() >= Duration::from_secs(1) {
                last_tick = Instant::now();
                w.tick(out, false)?;
            }
            if let Some(s) = &sealer
                && let Some(every) = sh.cfg.seal.as_ref().map(|c| c.every)
                && last_seal.elapsed() >= every
            {
                last_seal = Instant::now();
                w.seal(s)?;
            }
        }
        // Drain what is still queued (connections have finished).
        while let Ok(b) = rx.try_recv() {
            if b.conn != u64::MAX {
                w.batch(b)?;
            }
        }
        w.tick(out, true)
    })();
    if let Err(e) = res {
        // Close what can be closed; trace.json keeps `complete: false`.
        let _ = w.rec.close_unclean();
        return Err(e);
    }
    let live = w.live.take();
    w.finish(sealer.take(), live, out)
}

/// Ends live detection after the trace is closed (its findings are scoped
/// against the requests table just written) and before the final seal,
/// which then covers live-findings.json. Its failure is logged, never
/// the capture's. Returns the stats and the file's entry for the seal.
fn close_live(
    live: Option<Live>,
    out: &Path,
    sh: &Shared,
) -> (Option<super::live::LiveStats>, Option<FileEntry>) {
    let Some(l) = live else {
        return (None, None);
    };
    let failed = |e: String| {
        sh.log(&format!(
            "live detection: no live findings written: {}",
            e.replace('\n', " ")
        ));
    };
    match l.close(out) {
        Ok(s) => {
            let p = out.join(super::live::LIVE_FINDINGS);
            match std::fs::read(&p) {
                Ok(b) => (
                    Some(s),
                    Some(FileEntry {
                        path: super::live::LIVE_FINDINGS.into(),
                        rows: 0,
                        blake3: blake3::hash(&b).to_hex().to_string(),
                    }),
                ),
                Err(e) => {
                    failed(format!("{}: {e}", p.display()));
                    (Some(s), None)
                }
            }
        }
        Err(e) => {
            failed(e.to_string());
            (None, None)
        }
    }
}

impl W<'_> {
    fn log(&mut self, s: &str) {
        self.logged += 1;
        if self.logged <= 50 {
            self.sh.log(s);
        } else if self.logged == 51 {
            self.sh
                .log("writer: further problems are counted, not logged");
        }
    }

    /// One batch from a connection, in its view (prefill, decode or full).
    fn batch(&mut self, b: Batch) -> Result<()> {
        self.sh
            .stats
            .queue_depth
            .fetch_sub(b.msgs.len() as u64, Ordering::Relaxed);
        let view = b.view;
        for m in b.msgs {
            self.msg(b.conn, view, m)?;
        }
        if let Some(l) = &mut self.live {
            l.flush();
        }
        self.sh
            .stats
            .pending_bytes
            .store(self.held, Ordering::Relaxed);
        Ok(())
    }

    fn msg(&mut self, conn: u64, view: View, m: Msg) -> Result<()> {
        if self.parked.contains_key(&conn) {
            let b = msg_bytes(&m);
            if self.held.saturating_add(b) > self.sh.cfg.max_pending_bytes {
                // The stream waited long enough for memory's sake: the copy
                // becomes a hole and the stream goes on.
                self.log(&format!(
                    "--max-pending-bytes reached while connection #{conn} waits for a transfer's send"
                ));
                self.give_up(conn, "--max-pending-bytes reached while its stream waited")?;
                return self.msg(conn, view, m);
            }
            let p = self.parked.get_mut(&conn).expect("checked above");
            p.queue.push_back(m);
            p.bytes += b;
            self.held += b;
            return Ok(());
        }
        self.apply(conn, view, m)
    }

    /// Records `n` lost events of `pool` as a seq hole. Never fails: when
    /// the pool's seq space cannot take the hole, the events are counted as
    /// `lost_unrecorded` (the capture is then incomplete).
    fn lose(&mut self, pool: u16, n: u64) -> Result<()> {
        if let Some(l) = &mut self.live {
            l.lost(pool, n);
        }
        match self.rec.lose(pool, n) {
            Ok(()) => {
                // The hole is part of the pool's history: a later pull from
                // it stamps inside the hole, never before it.
                let ts = self
                    .recent
                    .get(&pool)
                    .and_then(|r| r.back())
                    .map_or(i64::MIN, |x| x.0);
                let next = self.rec.next_seq(pool)?;
                self.note(pool, ts, next - 1);
            }
            Err(e) => {
                add(&self.sh.stats.lost_unrecorded, n);
                self.log(&format!(
                    "{n} lost events of pool {pool} cannot be recorded as a hole: {}",
                    e.to_string().replace('\n', " ")
                ));
            }
        }
        Ok(())
    }

    /// Bookkeeping for an event just written at `seq`: counted, the pool's
    /// written end, and the stamping history. Every write path calls it.
    fn written(&mut self, ev: KvEvent, seq: u64) {
        let (pool, ts_ns) = (ev.pool, ev.ts_ns);
        if let Some(l) = &mut self.live {
            l.event(KvEvent { seq, ..ev });
        }
        self.sh.stats.kv_written.fetch_add(1, Ordering::Relaxed);
        self.written_next.insert(pool, seq + 1);
        self.note(pool, ts_ns, seq);
    }

    fn apply(&mut self, conn: u64, view: View, m: Msg) -> Result<()> {
        if let Some(pool) = m.pool()
            && let Some(p) = self.positions.get_mut(&pool)
            && p.conn != conn
        {
            p.broken = true;
        }
        let st = &self.sh.stats;
        match m {
            Msg::Kv { event, seq } => {
                if self.stopped_at_max {
                    add(&st.lost_max_bytes, 1);
                    if seq.is_none() {
                        self.lose(event.pool, 1)?;
                    }
                    return Ok(());
                }
                let r = match seq {
                    Some(_) => self.rec.kv_with_seq(event),
                    None => self.rec.kv(event).map(|_| ()),
                };
                match r {
                    Ok(()) => {
                        let next = self.rec.next_seq(event.pool)?;
                        self.written(event, next - 1);
                    }
                    Err(e) => {
                        st.rejected_contract.fetch_add(1, Ordering::Relaxed);
                        if seq.is_none() {
                            self.lose(event.pool, 1)?;
                        }
                        self.log(&format!(
                            "rejected event of pool {} (hole): {}",
                            event.pool,
                            e.to_string().replace('\n', " ")
                        ));
                    }
                }
            }
            // The connection splits these (one event per run); alike here.
            Msg::KvRuns(evs) => {
                for event in evs {
                    self.apply(conn, view, Msg::Kv { event, seq: None })?;
                }
            }
            Msg::Lost { pool, n } => {
                add(&st.lost_hook, n);
                self.lose(pool, n)?;
            }
            // Counted where it was dropped (queue, malformed line).
            Msg::Hole { pool, n } => self.lose(pool, n)?,
            Msg::Request(r) => self.request(view, *r)?,
            Msg::XferSend(s) => {
                let next = self.rec.next_seq(s.pool)?;
                if next == 0 {
                    self.log(&format!(
                        "xfer_send for room {} before any event of pool {}: no source state to refer to",
                        s.room, s.pool
                    ));
                }
                let max = self.sh.cfg.max_pending_bytes;
                let broken = self.rooms.get(&s.room).is_some_and(|r| r.broken);
                let chunk = if next > 0 && !broken {
                    size_of::<Chunk>() as u64 + 8 * s.src_pages.len() as u64
                } else {
                    0
                };
                let new_room = if self.rooms.contains_key(&s.room) {
                    0
                } else {
                    size_of::<(u64, Room)>() as u64 + ENTRY
                };
                if self.held.saturating_add(new_room + chunk) > max {
                    // Over budget: the copy cannot be rebuilt. A room already
                    // held is marked broken (its commit becomes a hole); a new
                    // one is not kept (its commit waits and becomes a hole).
                    self.log(&format!(
                        "--max-pending-bytes reached: xfer_send for room {} dropped; its copy will be a hole",
                        s.room
                    ));
                    if let Some(room) = self.rooms.get_mut(&s.room) {
                        room.broken = true;
                        room.chunks = Vec::new();
                        self.held -= room.bytes - (size_of::<(u64, Room)>() as u64 + ENTRY);
                        room.bytes = size_of::<(u64, Room)>() as u64 + ENTRY;
                        if s.last {
                            room.last = true;
                            self.unpark_room(s.room)?;
                        }
                    }
                    return Ok(());
                }
                self.held += new_room + chunk;
                let room = self.rooms.entry(s.room).or_default();
                room.since.get_or_insert_with(Instant::now);
                room.bytes += new_room + chunk;
                if next > 0 && !room.broken {
                    room.chunks.push(Chunk {
                        src_pool: s.pool,
                        src_seq: next - 1,
                        dst_index: s.dst_index,
                        src_pages: s.src_pages,
                    });
                }
                if s.last {
                    room.last = true;
                    self.unpark_room(s.room)?;
                }
            }
            Msg::XferPull(p) => self.pull(conn, view, p)?,
            Msg::Copy(c) => self.engine_copy(conn, &c)?,
            Msg::Mark { ts_ns } => {
                let pools = self.conns.get(&conn).cloned().unwrap_or_default();
                for p in &pools {
                    if let Some(f) = self.feeds.get_mut(p) {
                        f.mark = f.mark.max(ts_ns);
                        f.silent = false;
                    }
                }
                self.wake(&pools)?;
            }
            // Not in the trace: counted and alerted by live detection.
            Msg::Guard(g) => {
                if let Some(l) = &mut self.live {
                    l.guard(*g);
                }
            }
            Msg::GuardOk { n } => {
                if let Some(l) = &mut self.live {
                    l.guard_ok(n);
                }
            }
            // Kept by the connection, which hands it over with `End`.
            Msg::Bye(_) => {}
            Msg::Open { pools } => {
                for &p in &pools {
                    let base = self.rec.next_seq(p)?;
                    self.positions.insert(
                        p,
                        Positions {
                            conn,
                            base,
                            broken: false,
                        },
                    );
                    self.feeds.insert(
                        p,
                        Feed {
                            conn: Some(conn),
                            mark: i64::MIN,
                            silent: false,
                        },
                    );
                    self.unclaimed_silent.remove(&p);
                }
                self.conns.insert(conn, pools);
            }
            Msg::End { bye, at_stop } => self.end(conn, bye, at_stop)?,
            Msg::XferCommit(c) => {
                let ready = self.rooms.get(&c.room).is_some_and(|r| r.last);
                if ready {
                    self.past_commit(c.pool, |w| w.commit(&c))?;
                } else {
                    let bytes = size_of::<XferCommit>() as u64 + 8 * c.dst_pages.len() as u64;
                    self.park(conn, view, Wait::Commit(c), bytes)?;
                }
            }
        }
        Ok(())
    }

    /// Parks `conn`'s stream behind `wait` (`bytes`: what the waiting
    /// message holds), within --max-pending-bytes.
    fn park(&mut self, conn: u64, view: View, wait: Wait, bytes: u64) -> Result<()> {
        let bytes = bytes + size_of::<(u64, Parked)>() as u64 + ENTRY;
        self.held += bytes;
        self.parked.insert(
            conn,
            Parked {
                wait,
                view,
                since: Instant::now(),
                queue: VecDeque::new(),
                bytes,
            },
        );
        if self.held > self.sh.cfg.max_pending_bytes {
            self.give_up(conn, "--max-pending-bytes reached")?;
        }
        Ok(())
    }

    /// Runs `f`, which writes a transfer commit's events (or its holes)
    /// into `pool`, and moves the pool holder's positions past the seqs
    /// they took: the hook counts no position for a commit (the writer
    /// builds its events from the room's sends), and the committing
    /// stream waits for it, so the holder's later positions of the pool
    /// (a HiCache offload's `src_pos` on a decode pool) come after them.
    fn past_commit(&mut self, pool: u16, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let before = self.rec.next_seq(pool)?;
        f(self)?;
        let taken = self.rec.next_seq(pool)? - before;
        if let Some(p) = self.positions.get_mut(&pool) {
            p.base += taken;
        }
        Ok(())
    }

    /// Resolves the parked commits of `room`, replaying their streams.
    fn unpark_room(&mut self, room: u64) -> Result<()> {
        let conns: Vec<u64> = self
            .parked
            .iter()
            .filter(|(_, p)| matches!(&p.wait, Wait::Commit(c) if c.room == room))
            .map(|(c, _)| *c)
            .collect();
        for conn in conns {
            let p = self.parked.remove(&conn).expect("listed above");
            self.held -= p.bytes;
            if let Wait::Commit(c) = &p.wait {
                self.past_commit(c.pool, |w| w.commit(c))?;
            }
            self.replay(conn, p.view, p.queue)?;
        }
        Ok(())
    }

    /// A connection ended: its pools' feeds are final. A clean end (a
    /// `bye` whose counts add up) means every event was sent; otherwise
    /// what it had not sent is unknown (counted: the capture is incomplete)
    /// and pulls waiting on its pools past its last mark become holes.
    fn end(&mut self, conn: u64, bye: Option<super::wire::Bye>, at_stop: bool) -> Result<()> {
        let st = &self.sh.stats;
        let clean = match bye {
            // The sidecar's stop ended an idle connection: the capture ends
            // with what it had sent, nothing of it is missing; but it never
            // marked past its last mark, so loads waiting on it stay unknown.
            None if at_stop => false,
            None => {
                add(&st.connections_unclosed, 1);
                self.log(&format!(
                    "connection #{conn} ended without its closing `bye` line: events it had queued may be missing (capture incomplete)"
                ));
                false
            }
            Some(b) if b.unaccounted() > 0 => {
                add(&st.events_unaccounted, b.unaccounted());
                self.log(&format!(
                    "connection #{conn} closed with {} queued events neither sent nor reported lost (capture incomplete)",
                    b.unaccounted()
                ));
                false
            }
            Some(_) => true,
        };
        let pools = self.conns.remove(&conn).unwrap_or_default();
        for p in &pools {
            if let Some(f) = self.feeds.get_mut(p)
                && f.conn == Some(conn)
            {
                f.conn = None;
                if clean {
                    f.mark = i64::MAX;
                }
            }
        }
        self.wake(&pools)
    }

    /// Whether a pull from `src` by connection `conn` at `ts` can be
    /// stamped: the source pool's history must hold every change at or
    /// before `ts`.
    fn ready(&self, conn: u64, src: u16, ts: i64) -> Ready {
        match self.feeds.get(&src) {
            // Not claimed yet: its engine's hook may connect after the
            // consumer's (the order engines start in is no one's promise),
            // so the pull waits for it as for a mark, up to --copy-timeout.
            None if self.sh.deployment.pool(src).is_none() => {
                Ready::Never(format!("pool {src} is not in the deployment"))
            }
            None if self.unclaimed_silent.contains(&src) => Ready::Never(format!(
                "no connection has claimed pool {src} within --copy-timeout before"
            )),
            None => Ready::Wait,
            // One stream: everything before the pull has arrived.
            Some(f) if f.conn == Some(conn) => Ready::Now,
            Some(f) if f.mark >= ts => Ready::Now,
            Some(f) if f.conn.is_none() => Ready::Never(format!(
                "the connection feeding pool {src} ended without a clean `bye` before the load's time"
            )),
            Some(f) if f.silent => Ready::Never(format!(
                "the connection feeding pool {src} has not marked past the load's time within --copy-timeout before"
            )),
            Some(_) => Ready::Wait,
        }
    }

    /// Resolves parked pulls whose source is one of `pools` and is ready.
    fn wake(&mut self, pools: &[u16]) -> Result<()> {
        if self.parked.is_empty() {
            return Ok(());
        }
        let conns: Vec<u64> = self
            .parked
            .iter()
            .filter(|(c, p)| match &p.wait {
                Wait::Pull(x) => {
                    pools.contains(&x.src_pool)
                        && !matches!(self.ready(**c, x.src_pool, x.ts_ns), Ready::Wait)
                }
                Wait::Commit(_) => false,
            })
            .map(|(c, _)| *c)
            .collect();
        for conn in conns {
            let p = self.parked.remove(&conn).expect("listed above");
            self.held -= p.bytes;
            if let Wait::Pull(x) = &p.wait {
                match self.ready(conn, x.src_pool, x.ts_ns) {
                    Ready::Never(why) => self.unstamped(x, &why)?,
                    _ => self.stamp(x)?,
                }
            }
            self.replay(conn, p.view, p.queue)?;
        }
        Ok(())
    }

    fn replay(&mut self, conn: u64, view: View, mut q: VecDeque<Msg>) -> Result<()> {
        while let Some(m) = q.pop_front() {
            if self.parked.contains_key(&conn) {
                // Parked again by a later commit: keep the rest in order
                // (each message through `msg`, so the budget holds).
                self.msg(conn, view, m)?;
                while let Some(m) = q.pop_front() {
                    self.msg(conn, view, m)?;
                }
                break;
            }
            self.apply(conn, view, m)?;
        }
        Ok(())
    }

    /// A commit whose send never came (`why`): one lost event, then the
    /// stream.
    fn give_up(&mut self, conn: u64, why: &str) -> Result<()> {
        let p = self.parked.remove(&conn).expect("parked");
        self.held -= p.bytes;
        match &p.wait {
            Wait::Commit(c) => {
                add(&self.sh.stats.copies_unresolved, 1);
                self.past_commit(c.pool, |w| w.lose(c.pool, 1))?;
                self.log(&format!(
                    "transfer into pool {} for request {} (room {}): {why}; recorded as a lost event",
                    c.pool, c.request_id, c.room
                ));
            }
            Wait::Pull(x) => {
                match self.feeds.get_mut(&x.src_pool) {
                    Some(f) => f.silent = true,
                    None => {
                        self.unclaimed_silent.insert(x.src_pool);
                    }
                }
                let why = format!(
                    "pool {} never reported past the load's time ({why})",
                    x.src_pool
                );
                self.unstamped(x, &why)?;
            }
        }
        self.replay(conn, p.view, p.queue)
    }

    fn request(&mut self, view: View, r: RequestRecord) -> Result<()> {
        let st = &self.sh.stats;
        if self.stopped_at_max {
            add(&st.lost_max_bytes, 1);
            return Ok(());
        }
        if self.conflicts.contains(&r.request_id) {
            return Ok(());
        }
        let row = match view {
            View::Full => r,
            _ => match self.pending.remove(&r.request_id).map(|b| *b) {
                None => {
                    let b = view_bytes(&r);
                    if self.held.saturating_add(b) > self.sh.cfg.max_pending_bytes {
                        // Memory for unpaired views is spent: this view is
                        // lost (counted; the capture is incomplete). Its
                        // partner, if it comes, is written alone.
                        add(&st.lost_requests, 1);
                        self.log(&format!(
                            "request {}: --max-pending-bytes ({}) held by views waiting for their partner; this {view:?} view is dropped",
                            r.request_id, self.sh.cfg.max_pending_bytes
                        ));
                        return Ok(());
                    }
                    self.held += b;
                    self.pending
                        .insert(r.request_id, Box::new((view, r, Instant::now())));
                    return Ok(());
                }
                Some((v, other, _)) if v == view => {
                    // Two requests under one id (a reused client id): no row
                    // may speak for both.
                    self.held -= view_bytes(&other);
                    self.conflict(r.request_id, &format!("a second {view:?} view"));
                    return Ok(());
                }
                Some((_, other, _)) => {
                    self.held -= view_bytes(&other);
                    match view {
                        View::Decode => merge(r, other),
                        _ => merge(other, r),
                    }
                }
            },
        };
        self.write_request(row)
    }

    /// Two requests reported one request_id: the id is left unattributed
    /// (its rows removed at close, its KV events kept as events of a
    /// request with no row), counted and named in trace.json; the capture
    /// is incomplete and stays analysable.
    fn conflict(&mut self, id: u64, what: &str) {
        if self.conflicts.insert(id) {
            add(&self.sh.stats.request_conflicts, 1);
            self.rec.unattribute(id);
            self.log(&format!(
                "request {id}: {what} (two requests reported one request_id); the request is left unattributed and the capture incomplete"
            ));
        }
    }

    fn write_request(&mut self, row: RequestRecord) -> Result<()> {
        let id = row.request_id;
        if self.conflicts.contains(&id) {
            return Ok(());
        }
        if self.written_ids.contains(&id) {
            self.conflict(id, "a second request row");
            return Ok(());
        }
        let row_copy = self.live.as_ref().map(|_| row.clone());
        match self.rec.request(row) {
            Ok(()) => {
                if let (Some(l), Some(r)) = (&mut self.live, &row_copy) {
                    l.request(r);
                }
                self.written_ids.insert(id);
                self.sh
                    .stats
                    .requests_written
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.sh
                    .stats
                    .rejected_unattributed
                    .fetch_add(1, Ordering::Relaxed);
                self.log(&format!(
                    "request {id} rejected: {}",
                    e.to_string().replace('\n', " ")
                ));
            }
        }
        Ok(())
    }

    /// Once a second (and at the end): flush, timeouts, disk budget.
    fn tick(&mut self, out: &Path, end: bool) -> Result<()> {
        let copy_to = self.sh.cfg.copy_timeout;
        let late: Vec<u64> = self
            .parked
            .iter()
            .filter(|(_, p)| end || p.since.elapsed() >= copy_to)
            .map(|(c, _)| *c)
            .collect();
        for c in late {
            let why = match self.parked.get(&c).map(|p| &p.wait) {
                Some(Wait::Pull(_)) if end => "the capture ended first",
                Some(Wait::Pull(_)) => "--copy-timeout passed",
                _ => "the prefill side never reported it",
            };
            self.give_up(c, why)?;
        }
        let pair_to = self.sh.cfg.pair_timeout;
        let mut alone: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, b)| end || b.2.elapsed() >= pair_to)
            .map(|(id, _)| *id)
            .collect();
        alone.sort_unstable();
        for id in alone {
            let (_, r, _) = *self.pending.remove(&id).expect("listed");
            self.held -= view_bytes(&r);
            self.write_request(r)?;
        }
        let mut freed = 0;
        self.rooms.retain(|_, r| {
            let keep = !end && r.since.is_none_or(|t| t.elapsed() < pair_to);
            if !keep {
                freed += r.bytes;
            }
            keep
        });
        self.held -= freed;
        self.sh
            .stats
            .pending_bytes
            .store(self.held, Ordering::Relaxed);
        self.rec.flush()?;
        let bytes = dir_bytes(out);
        self.sh.stats.bytes_on_disk.store(bytes, Ordering::Relaxed);
        if let Some(max) = self.sh.cfg.max_bytes
            && bytes >= max
            && !self.stopped_at_max
        {
            self.stopped_at_max = true;
            self.log(&format!(
                "--max-bytes reached ({bytes} bytes on disk): further events are counted as lost and the capture will be marked incomplete"
            ));
        }
        Ok(())
    }

    /// What a seal covers now (the recorder flushed to a row-group
    /// boundary), with the sidecar's connection counts.
    fn seal_job(&mut self) -> Result<SealJob> {
        let st = self.rec.seal_state()?;
        let s = self.sh.stats.snapshot();
        let connections = [
            ("total", s.connections_total),
            ("live", s.connections_live),
            ("refused", s.refused_connections),
            ("rejected_hello", s.rejected_hello),
            ("dropped_before_hello", s.dropped_before_hello),
            ("unclosed", s.connections_unclosed),
            ("cut", s.connections_cut),
        ];
        Ok(SealJob {
            at_ns: crate::custody::seal::writer::wall_ns(),
            files: st.files,
            open: st.open,
            pools: st
                .pools
                .iter()
                .map(|p| PoolCounts {
                    pool: p.pool,
                    events: p.events,
                    next_seq: Some(p.next_seq),
                    lost: Some(p.lost),
                    holes: Some(p.holes),
                })
                .collect(),
            connections: Some(connections.map(|(k, v)| (k.to_string(), v)).into()),
        })
    }

    /// Hands the sealer what is written now; the capture never waits for it.
    fn seal(&mut self, sealer: &Sealer) -> Result<()> {
        // Rows buffered now go out as a row group first: work the writer
        // does for them anyway, done earlier (counted apart).
        let t = Instant::now();
        self.rec.flush()?;
        let flushed = t.elapsed();
        let job = self.seal_job()?;
        self.seal_flush_s += flushed.as_secs_f64();
        self.seal_s += (t.elapsed() - flushed).as_secs_f64();
        if !sealer.seal(job) && self.sh.cfg.seal.is_some() {
            self.log("the sealing thread stopped; its error ends the capture at shutdown");
        }
        Ok(())
    }

    fn finish(
        mut self,
        sealer: Option<Sealer>,
        live: Option<Live>,
        out: &Path,
    ) -> Result<RecordSummary> {
        // The pools' counts at close (close flushes the same rows).
        let t = Instant::now();
        let last_job = match &sealer {
            Some(_) => Some(self.seal_job()?),
            None => None,
        };
        let (writer_s, flush_s) = (self.seal_s + t.elapsed().as_secs_f64(), self.seal_flush_s);
        let mut rec = self.rec;
        let s = self.sh.stats.snapshot();
        let mut trailing = serde_json::Map::new();
        for (pool, _) in rec.pool_counts() {
            let next = rec.next_seq(pool)?;
            let written = self.written_next.get(&pool).copied().unwrap_or(0);
            if next > written {
                trailing.insert(pool.to_string(), (next - written).into());
            }
        }
        let unattributed = s.evidence_missing() || self.stopped_at_max || !trailing.is_empty();
        if !self.policies.is_empty() {
            let m: serde_json::Map<String, serde_json::Value> = self
                .policies
                .iter()
                .map(|(p, v)| (p.to_string(), serde_json::json!(v)))
                .collect();
            rec.set_capture_extra("kv_load_failure_policy", m.into());
        }
        rec.set_capture_extra(
            "record",
            serde_json::to_value(&s).unwrap_or(serde_json::Value::Null),
        );
        if !trailing.is_empty() {
            // Lost after the pool's last written event: invisible as a hole.
            rec.set_capture_extra("trailing_lost_events", trailing.into());
        }
        if !self.conflicts.is_empty() {
            let ids: Vec<u64> = self.conflicts.iter().take(20).copied().collect();
            rec.set_capture_extra(
                "request_conflicts",
                serde_json::json!({"count": self.conflicts.len(), "request_ids": ids}),
            );
        }
        // No KV event and no hole: nothing was captured, which is no
        // evidence, never a clean capture (a hook that never connected, or
        // sent to another socket).
        let nothing =
            rec.pool_counts().iter().all(|&(_, n)| n == 0) && rec.stats().lost_events == 0;
        if nothing {
            rec.set_capture_extra("no_kv_events", true.into());
            self.sh.log(
                "no KV event was recorded: the trace holds no evidence and is marked incomplete",
            );
        }
        let unattributed = unattributed || nothing;
        let manifest = if unattributed {
            rec.close_unclean()?
        } else {
            rec.close()?
        };
        let (live, live_file) = close_live(live, out, self.sh);
        let seal_cost = match (sealer, last_job) {
            (Some(s), Some(mut job)) => {
                job.files = manifest.files.clone().unwrap_or_default();
                job.files.extend(live_file);
                job.open = Vec::new();
                job.at_ns = crate::custody::seal::writer::wall_ns();
                let t = Instant::now();
                let sealed = s.finish(job)?;
                Some((
                    sealed.seals,
                    SealCost {
                        sealer_cpu_s: sealed.cpu_s,
                        writer_s,
                        flush_s,
                        final_wait_s: t.elapsed().as_secs_f64(),
                    },
                ))
            }
            _ => None,
        };
        Ok(RecordSummary {
            stats: self.sh.stats.snapshot(),
            complete: manifest.capture.complete,
            files: manifest.files.as_ref().map_or(0, Vec::len),
            seals: seal_cost.map_or(0, |c| c.0),
            seal_cost: seal_cost.map(|c| c.1),
            live,
        })
    }
}

/// The decode view (what the client got) completed by the prefill's.
fn merge(decode: RequestRecord, prefill: RequestRecord) -> RequestRecord {
    RequestRecord {
        prompt_tokens: decode.prompt_tokens.max(prefill.prompt_tokens),
        arrival_ns: decode.arrival_ns.min(prefill.arrival_ns),
        prefilled_tokens: decode.prefilled_tokens.or(prefill.prefilled_tokens),
        prefill_pool: decode.prefill_pool.or(prefill.prefill_pool),
        external_id: decode.external_id.or(prefill.external_id),
        prompt_hash: decode.prompt_hash.or(prefill.prompt_hash),
        tenant: if decode.tenant.is_empty() {
            prefill.tenant
        } else {
            decode.tenant
        },
        ..decode
    }
}

fn dir_bytes(p: &Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => total += dir_bytes(&e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
