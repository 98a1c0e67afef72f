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

pub mod config;
pub mod conn;
pub mod live;
pub mod shared;
pub mod stats;
pub mod wire;
pub mod writer;

pub use config::{Listen, RecordConfig, SealConfig, WhenBehind};
use shared::{Batch, Shared, View};
pub use shared::{NoLog, RecordLog, RecordSummary, SealCost};
use stats::add;
pub use stats::{Stats, StatsSnapshot};

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Location, Result};
use crate::trace::manifest::Deployment;

/// A running sidecar. Stop it with [`Sidecar::shutdown`]; check
/// [`Sidecar::writer_failed`] while it runs.
pub struct Sidecar {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    writer: Option<JoinHandle<Result<RecordSummary>>>,
    listen: Listen,
    socket_path: Option<PathBuf>,
    metrics_addr: Option<std::net::SocketAddr>,
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
        let stats = Arc::new(Stats::default());
        let live = match &cfg.live {
            Some(o) => Some(live::Live::start(
                o,
                &deployment,
                cfg.recorder.from_engine_start,
                cfg.when_behind == WhenBehind::Wait,
                stats.clone(),
            )?),
            None => None,
        };
        let metrics_addr = live.as_ref().and_then(live::Live::metrics_addr);
        let rec = crate::capture::Recorder::create(out, deployment.clone(), cfg.recorder.clone())?;
        let sealer = match &cfg.seal {
            Some(s) => Some(crate::custody::seal::Sealer::start(
                out,
                s.key.clone(),
                "record",
                crate::custody::seal::writer::wall_ns(),
            )?),
            None => None,
        };
        let (listener, listen, socket_path) = bind(&cfg.listen)?;
        let (tx, rx): (SyncSender<Batch>, Receiver<Batch>) = sync_channel(cfg.queue_batches.max(1));
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
            .spawn(move || writer::run(rec, sealer, rx, w_shared, &out, live))
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
            metrics_addr,
        })
    }

    /// Where `/metrics` is served (the port, when 0 was asked for).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
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
