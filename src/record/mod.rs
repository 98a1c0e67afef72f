//! `kvtrail record`: the capture sidecar. Engine processes (each prefill and
//! decode worker) stream events to it over a Unix socket or loopback TCP;
//! one writer thread turns them into a v1 trace through the [`Recorder`].
//!
//! Threads: one acceptor, one thread per connection (parse, check, batch),
//! one writer (the only owner of the Recorder). Between connections and the
//! writer sits one bounded queue; a connection never waits on it while its
//! stream is live: when it is full, events are dropped and recorded as
//! explicit seq holes (`conn`), never silently.
//!
//! A security boundary: a Unix socket is created owner-only (0600), TCP
//! must be loopback unless `allow_remote`, every line is size-bounded, and
//! each connection may only send events for the pools it declared in its
//! hello (a pool is held by at most one live connection). Nothing a client
//! does holds the sidecar: the hello has a deadline, the stop a grace
//! period, live connections a cap, and what waits for a partner a memory
//! budget; what they drop is counted and makes the capture incomplete
//! (docs/limits.md lists every bound). The protocol is in
//! `wire`, the transfer join and request pairing in `writer`, the operator's
//! view in docs/capture-sglang.md.
//!
//! [`Recorder`]: crate::capture::Recorder

pub mod conn;
pub mod wire;
pub mod writer;

use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::capture::RecorderOptions;
use crate::error::{Error, Location, Result};
use crate::trace::manifest::Deployment;

/// Where the sidecar listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl Listen {
    /// `unix:PATH`, `tcp:HOST:PORT`, a bare `HOST:PORT` (TCP) or a bare
    /// path (Unix socket, the default). Non-loopback TCP addresses are
    /// refused unless `allow_remote`.
    pub fn parse(s: &str, allow_remote: bool) -> Result<Listen> {
        let bad = |what: String, hint: &str| {
            Error::invalid(Location::default().column("--listen"), what, hint)
        };
        let l = if let Some(p) = s.strip_prefix("unix:") {
            Listen::Unix(PathBuf::from(p))
        } else if let Some(a) = s.strip_prefix("tcp:") {
            Listen::Tcp(a.parse().map_err(|e| {
                bad(
                    format!("{a:?} is not HOST:PORT ({e})"),
                    "e.g. tcp:127.0.0.1:7071",
                )
            })?)
        } else if let Ok(a) = s.parse::<SocketAddr>() {
            Listen::Tcp(a)
        } else {
            Listen::Unix(PathBuf::from(s))
        };
        if let Listen::Unix(p) = &l
            && p.as_os_str().is_empty()
        {
            return Err(bad(
                "empty socket path".into(),
                "e.g. unix:/run/kvtrail.sock",
            ));
        }
        if let Listen::Tcp(a) = &l
            && !a.ip().is_loopback()
            && !allow_remote
        {
            return Err(bad(
                format!("{} is not a loopback address", a.ip()),
                "the sidecar accepts unauthenticated event streams: listen on a Unix socket or 127.0.0.1, or pass --allow-remote on a trusted network",
            ));
        }
        Ok(l)
    }
}

/// How the sidecar runs.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    pub listen: Listen,
    pub recorder: RecorderOptions,
    /// Stop writing once the trace holds this many bytes on disk; the rest
    /// is recorded as loss and the capture marked incomplete.
    pub max_bytes: Option<u64>,
    /// Longest accepted line; longer lines are skipped unread.
    pub max_line_bytes: usize,
    /// Batches (of up to 1024 messages) between connections and the writer.
    pub queue_batches: usize,
    /// How long a decode-side transfer commit waits for the prefill's send.
    pub copy_timeout: Duration,
    /// How long a request's prefill (or decode) view waits for the other.
    pub pair_timeout: Duration,
    /// Live connections at most (one thread each); more are refused.
    pub max_connections: u64,
    /// How long a new connection may take to send its hello line; then it
    /// is closed and counted (`dropped_before_hello`).
    pub hello_timeout: Duration,
    /// After the stop, how long connections may still send; then the ones
    /// still open are cut and counted (`connections_cut`).
    pub shutdown_grace: Duration,
    /// Memory held for what waits for its partner (request views, transfer
    /// halves, decode streams parked behind a commit), estimated; beyond it
    /// the newest is dropped and counted (or the parked copy given up).
    pub max_pending_bytes: u64,
}

impl RecordConfig {
    pub fn new(listen: Listen) -> Self {
        RecordConfig {
            listen,
            recorder: RecorderOptions::default(),
            max_bytes: None,
            max_line_bytes: crate::capture::jsonl::MAX_LINE_BYTES,
            queue_batches: 256,
            copy_timeout: Duration::from_secs(10),
            pair_timeout: Duration::from_secs(900),
            max_connections: 256,
            hello_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
            max_pending_bytes: 64 << 20,
        }
    }
}

/// Counters, read live for the health line and returned at the end.
#[derive(Debug, Default)]
pub struct Stats {
    pub connections_total: AtomicU64,
    pub connections_live: AtomicU64,
    pub kv_written: AtomicU64,
    pub requests_written: AtomicU64,
    /// Messages in the queue to the writer.
    pub queue_depth: AtomicU64,
    /// Events dropped because the writer fell behind (holes).
    pub lost_queue: AtomicU64,
    /// Events the hooks reported lost (`lost` lines; holes).
    pub lost_hook: AtomicU64,
    /// Events not written because --max-bytes was reached.
    pub lost_max_bytes: AtomicU64,
    /// Transfer commits whose prefill side never arrived (holes).
    pub copies_unresolved: AtomicU64,
    pub rejected_hello: AtomicU64,
    /// Well-formed hellos refused (a pool held by another live connection,
    /// or not in the deployment): a process meant to record those pools and
    /// its events are not in the trace, so the capture is incomplete.
    pub refused_claims: AtomicU64,
    /// Malformed events of a known pool (each a hole in that pool).
    pub rejected_malformed: AtomicU64,
    /// Events for pools the connection did not declare.
    pub rejected_forged: AtomicU64,
    /// Events the recorder refused (extent outside the pool, seq order).
    pub rejected_contract: AtomicU64,
    /// Lines that could not be tied to a pool (bad JSON, oversized).
    pub rejected_unattributed: AtomicU64,
    pub bytes_on_disk: AtomicU64,
    /// Connections refused because --max-connections were live: any of them
    /// may have been an engine, so the capture is incomplete.
    pub refused_connections: AtomicU64,
    /// Connections closed because no hello came within the handshake
    /// deadline (or the shutdown cut them first); the capture is incomplete.
    pub dropped_before_hello: AtomicU64,
    /// Connections still sending when the shutdown grace ran out, cut with
    /// what they had not sent yet; the capture is incomplete.
    pub connections_cut: AtomicU64,
    /// Of the events counted lost or rejected above, those that could not
    /// be recorded as a seq hole (the pool's seq space is used up); the
    /// capture is incomplete.
    pub lost_unrecorded: AtomicU64,
    /// Request views not written because --max-pending-bytes was held by
    /// views waiting for their partner; the capture is incomplete.
    pub lost_requests: AtomicU64,
    /// Bytes (estimated) now held for views, transfer halves and parked
    /// streams waiting for their partner.
    pub pending_bytes: AtomicU64,
    /// Pull-based copies (`xfer_pull` runs) written as `write` with `src`.
    pub pulls_written: AtomicU64,
    /// Loads the consumer engine reported partial (some blocks failed).
    pub pulls_partial: AtomicU64,
    /// Loads the consumer engine reported failed (nothing copied).
    pub pulls_failed: AtomicU64,
    /// Connections that ended without a `bye` line (the engine exited or
    /// crashed with events still queued, or a client that does not say
    /// goodbye): what they had not sent is unknown, so the capture is
    /// incomplete.
    pub connections_unclosed: AtomicU64,
    /// Events a `bye` line left unaccounted for (queued, neither sent nor
    /// reported lost); the capture is incomplete.
    pub events_unaccounted: AtomicU64,
    /// Request ids reported by two requests that disagree (a reused client
    /// id): the request is left unattributed and the capture incomplete.
    pub request_conflicts: AtomicU64,
}

/// Adds to a counter, stopping at u64::MAX instead of wrapping (counts on
/// the wire come from untrusted clients).
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

/// A plain copy of [`Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub connections_total: u64,
    pub connections_live: u64,
    pub kv_written: u64,
    pub requests_written: u64,
    pub queue_depth: u64,
    pub lost_queue: u64,
    pub lost_hook: u64,
    pub lost_max_bytes: u64,
    pub copies_unresolved: u64,
    pub rejected_hello: u64,
    pub refused_claims: u64,
    pub rejected_malformed: u64,
    pub rejected_forged: u64,
    pub rejected_contract: u64,
    pub rejected_unattributed: u64,
    pub bytes_on_disk: u64,
    pub refused_connections: u64,
    pub dropped_before_hello: u64,
    pub connections_cut: u64,
    pub lost_unrecorded: u64,
    pub lost_requests: u64,
    pub pending_bytes: u64,
    pub pulls_written: u64,
    pub pulls_partial: u64,
    pub pulls_failed: u64,
    pub connections_unclosed: u64,
    pub events_unaccounted: u64,
    pub request_conflicts: u64,
}

impl StatsSnapshot {
    /// KV events lost, by every cause, each counted once (saturating).
    /// `lost_unrecorded` is not added: it says which of them (or of the
    /// rejected events) could not become holes.
    pub fn lost_events(&self) -> u64 {
        [
            self.lost_queue,
            self.lost_hook,
            self.lost_max_bytes,
            self.copies_unresolved,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Lines and hellos rejected, by every cause (saturating).
    pub fn rejected(&self) -> u64 {
        [
            self.rejected_malformed,
            self.rejected_forged,
            self.rejected_contract,
            self.rejected_unattributed,
            self.rejected_hello,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Whether these counters show evidence that is neither in the trace
    /// nor a seq hole in it: then the capture cannot be complete. The one
    /// place this rule lives (the writer closes the trace by it).
    pub fn evidence_missing(&self) -> bool {
        self.rejected_unattributed > 0
            || self.refused_claims > 0
            || self.refused_connections > 0
            || self.dropped_before_hello > 0
            || self.connections_cut > 0
            || self.lost_unrecorded > 0
            || self.lost_requests > 0
            || self.lost_max_bytes > 0
            || self.connections_unclosed > 0
            || self.events_unaccounted > 0
            || self.request_conflicts > 0
    }
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            connections_total: g(&self.connections_total),
            connections_live: g(&self.connections_live),
            kv_written: g(&self.kv_written),
            requests_written: g(&self.requests_written),
            queue_depth: g(&self.queue_depth),
            lost_queue: g(&self.lost_queue),
            lost_hook: g(&self.lost_hook),
            lost_max_bytes: g(&self.lost_max_bytes),
            copies_unresolved: g(&self.copies_unresolved),
            rejected_hello: g(&self.rejected_hello),
            refused_claims: g(&self.refused_claims),
            rejected_malformed: g(&self.rejected_malformed),
            rejected_forged: g(&self.rejected_forged),
            rejected_contract: g(&self.rejected_contract),
            rejected_unattributed: g(&self.rejected_unattributed),
            bytes_on_disk: g(&self.bytes_on_disk),
            refused_connections: g(&self.refused_connections),
            dropped_before_hello: g(&self.dropped_before_hello),
            connections_cut: g(&self.connections_cut),
            lost_unrecorded: g(&self.lost_unrecorded),
            lost_requests: g(&self.lost_requests),
            pending_bytes: g(&self.pending_bytes),
            pulls_written: g(&self.pulls_written),
            pulls_partial: g(&self.pulls_partial),
            pulls_failed: g(&self.pulls_failed),
            connections_unclosed: g(&self.connections_unclosed),
            events_unaccounted: g(&self.events_unaccounted),
            request_conflicts: g(&self.request_conflicts),
        }
    }
}

/// Where the sidecar's log lines go (the CLI prints them to stderr).
pub trait RecordLog: Send + Sync {
    fn log(&self, line: &str);
}

/// Discards log lines.
pub struct NoLog;
impl RecordLog for NoLog {
    fn log(&self, _: &str) {}
}

/// Which side of a PD request a connection reports (from its pools' roles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    Prefill,
    Decode,
    Full,
}

/// Messages from one connection, in order.
pub(crate) struct Batch {
    pub conn: u64,
    /// The connection's view, carried with each batch (so nothing per
    /// connection outlives it in a shared table).
    pub view: View,
    pub msgs: Vec<wire::Msg>,
}

pub(crate) struct Shared {
    pub cfg: RecordConfig,
    pub deployment: Deployment,
    pub stop: AtomicBool,
    /// When the stop came (set before `stop`).
    pub stop_at: OnceLock<Instant>,
    /// The writer ended with an error (logged when it happened).
    pub writer_failed: AtomicBool,
    pub stats: Arc<Stats>,
    /// pool -> the live connection holding it.
    pub claims: Mutex<HashMap<u16, String>>,
    pub tx: SyncSender<Batch>,
    pub log: Arc<dyn RecordLog>,
}

impl Shared {
    pub fn log(&self, line: &str) {
        self.log.log(line);
    }
    /// Whether the stop came more than `shutdown_grace` ago: connections
    /// still open are cut.
    pub fn past_grace(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
            && self
                .stop_at
                .get()
                .is_some_and(|t| t.elapsed() >= self.cfg.shutdown_grace)
    }
}

/// What a finished capture did.
#[derive(Debug, Clone)]
pub struct RecordSummary {
    pub stats: StatsSnapshot,
    pub complete: bool,
    pub files: usize,
}

/// A running sidecar. Stop it with [`Sidecar::shutdown`]; check
/// [`Sidecar::writer_failed`] while it runs.
pub struct Sidecar {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    writer: Option<JoinHandle<Result<RecordSummary>>>,
    listen: Listen,
    socket_path: Option<PathBuf>,
}

impl Sidecar {
    /// Creates the trace at `out`, binds the listener and starts the
    /// threads.
    pub fn start(
        cfg: RecordConfig,
        deployment: Deployment,
        out: &Path,
        log: Arc<dyn RecordLog>,
    ) -> Result<Sidecar> {
        let rec = crate::capture::Recorder::create(out, deployment.clone(), cfg.recorder.clone())?;
        let (listener, listen, socket_path) = bind(&cfg.listen)?;
        let (tx, rx): (SyncSender<Batch>, Receiver<Batch>) = sync_channel(cfg.queue_batches.max(1));
        let stats = Arc::new(Stats::default());
        let shared = Arc::new(Shared {
            cfg,
            deployment,
            stop: AtomicBool::new(false),
            stop_at: OnceLock::new(),
            writer_failed: AtomicBool::new(false),
            stats,
            claims: Mutex::new(HashMap::new()),
            tx,
            log,
        });
        let w_shared = shared.clone();
        let out = out.to_path_buf();
        let writer = std::thread::Builder::new()
            .name("kvtrail-writer".into())
            .spawn(move || writer::run(rec, rx, w_shared, &out))
            .map_err(|e| Error::Other(format!("cannot start the writer thread: {e}")))?;
        let a_shared = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("kvtrail-accept".into())
            .spawn(move || accept_loop(listener, a_shared))
            .map_err(|e| Error::Other(format!("cannot start the acceptor thread: {e}")))?;
        Ok(Sidecar {
            shared,
            acceptor: Some(acceptor),
            writer: Some(writer),
            listen,
            socket_path,
        })
    }

    /// The address actually bound (the port, when 0 was asked for).
    pub fn listen(&self) -> &Listen {
        &self.listen
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// Entries held in the sidecar's shared per-connection tables (pool
    /// claims): zero once every connection has closed. For tests that bound
    /// memory per connection.
    #[doc(hidden)]
    pub fn connection_entries(&self) -> usize {
        self.shared.claims.lock().expect("claims lock").len()
    }

    /// Whether the writer has stopped with an error (already logged; the
    /// error itself is what [`Sidecar::shutdown`] returns).
    pub fn writer_failed(&self) -> bool {
        self.shared.writer_failed.load(Ordering::SeqCst)
    }

    /// Stops accepting, reads what the connections still send for up to
    /// `shutdown_grace` (then cuts the ones still sending, counted), drains
    /// the queue and closes the trace.
    pub fn shutdown(mut self) -> Result<RecordSummary> {
        let _ = self.shared.stop_at.set(Instant::now());
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
        // The acceptor held the last live senders besides `shared.tx`;
        // the writer ends when told (the Shared keeps one sender alive).
        let w = self.writer.take().expect("writer runs until shutdown");
        // Fails only when the writer has already ended (with an error, which
        // the join returns).
        let _ = self.shared.tx.send(Batch {
            conn: u64::MAX,
            view: View::Full,
            msgs: Vec::new(),
        });
        match w.join() {
            Ok(r) => r,
            Err(_) => Err(Error::Other("the writer thread panicked".into())),
        }
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

fn bind(l: &Listen) -> Result<(Listener, Listen, Option<PathBuf>)> {
    match l {
        Listen::Tcp(a) => {
            let t = TcpListener::bind(a).map_err(|e| Error::io(Path::new(&a.to_string()), e))?;
            let bound = t
                .local_addr()
                .map_err(|e| Error::io(Path::new(&a.to_string()), e))?;
            t.set_nonblocking(true)
                .map_err(|e| Error::io(Path::new(&a.to_string()), e))?;
            Ok((Listener::Tcp(t), Listen::Tcp(bound), None))
        }
        Listen::Unix(p) => {
            if let Ok(md) = std::fs::symlink_metadata(p) {
                if !md.file_type().is_socket() {
                    return Err(Error::invalid(
                        Location::file(p),
                        "exists and is not a socket",
                        "choose another --listen path",
                    ));
                }
                if UnixStream::connect(p).is_ok() {
                    return Err(Error::invalid(
                        Location::file(p),
                        "another process is listening on this socket",
                        "stop it or choose another --listen path",
                    ));
                }
                std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
            }
            // Bind under a temporary name, restrict it to the owner, then
            // move it into place: no client can connect before it is 0600.
            let dir = p
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            let u = UnixListener::bind(&tmp).map_err(|e| Error::io(&tmp, e))?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io(&tmp, e))?;
            std::fs::rename(&tmp, p).map_err(|e| Error::io(p, e))?;
            u.set_nonblocking(true).map_err(|e| Error::io(p, e))?;
            Ok((Listener::Unix(u), Listen::Unix(p.clone()), Some(p.clone())))
        }
    }
}

fn accept_loop(l: Listener, shared: Arc<Shared>) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 1u64;
    // After the stop flag, one more pass takes connections still in the
    // backlog (their data is read like everyone else's).
    let mut last_pass = false;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            if last_pass {
                break;
            }
            last_pass = true;
        }
        let accepted: Option<Box<dyn conn::Stream>> = match &l {
            Listener::Unix(u) => match u.accept() {
                Ok((s, _)) => s.set_nonblocking(false).ok().map(|_| Box::new(s) as _),
                Err(_) => None,
            },
            Listener::Tcp(t) => match t.accept() {
                Ok((s, peer)) => {
                    let ok = s.set_nonblocking(false).is_ok() && s.set_nodelay(true).is_ok();
                    if !peer.ip().is_loopback() {
                        shared.log(&format!("connection from remote address {peer}"));
                    }
                    ok.then(|| Box::new(s) as _)
                }
                Err(_) => None,
            },
        };
        match accepted {
            Some(mut s) => {
                let id = next_id;
                next_id += 1;
                if shared.stats.connections_live.load(Ordering::Relaxed)
                    >= shared.cfg.max_connections
                {
                    // It may have been an engine: what it would have sent is
                    // missing, so it is counted and the capture incomplete.
                    shared.stats.rejected_hello.fetch_add(1, Ordering::Relaxed);
                    add(&shared.stats.refused_connections, 1);
                    shared.log(&format!(
                        "connection #{id} refused: {} live connections already",
                        shared.cfg.max_connections
                    ));
                    let _ =
                        s.write_all(b"{\"type\":\"error\",\"error\":\"too many connections\"}\n");
                    continue;
                }
                shared
                    .stats
                    .connections_total
                    .fetch_add(1, Ordering::Relaxed);
                // Live from here; `conn::serve` counts it down when it ends.
                shared
                    .stats
                    .connections_live
                    .fetch_add(1, Ordering::Relaxed);
                let sh = shared.clone();
                match std::thread::Builder::new()
                    .name(format!("kvtrail-conn-{id}"))
                    .spawn(move || conn::serve(s, id, sh))
                {
                    Ok(h) => conns.push(h),
                    Err(e) => {
                        shared
                            .stats
                            .connections_live
                            .fetch_sub(1, Ordering::Relaxed);
                        shared.log(&format!("cannot start a connection thread: {e}"));
                    }
                }
                conns.retain(|h| !h.is_finished());
            }
            None if last_pass => break,
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    for h in conns {
        let _ = h.join();
    }
}
