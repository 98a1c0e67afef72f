//! How the sidecar runs: where it listens ([`Listen`]) and its bounds
//! ([`RecordConfig`]; docs/limits.md lists each).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::capture::RecorderOptions;
use crate::error::{Error, Location, Result};

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
    /// What a connection does when the writer (or the live thread) is
    /// behind and its queue is full: drop the events as counted holes (an
    /// engine must never wait on its recorder), or wait, so the sender is
    /// slowed through the socket and nothing is lost (`--when-behind
    /// wait`: replaying a capture, a hook that buffers on its side).
    pub when_behind: WhenBehind,
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
    /// Seal the trace while it is written (`--signing-key`,
    /// `--seal-every`): see `custody::seal`.
    pub seal: Option<SealConfig>,
    /// Live detection (docs/live.md): None records only.
    pub live: Option<super::live::LiveOptions>,
}

/// What the sidecar does when its writer falls behind (`--when-behind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WhenBehind {
    /// Drop the events as counted seq holes; the capture says it is
    /// incomplete and live detection alerts the loss.
    #[default]
    Drop,
    /// Stop reading the connection until the writer catches up: the
    /// sender waits (socket back-pressure) and nothing is lost.
    Wait,
}

/// How the sidecar seals the trace it writes.
#[derive(Debug, Clone)]
pub struct SealConfig {
    pub key: std::sync::Arc<crate::custody::keys::SigningKey>,
    /// A seal every this often (and a final one at close).
    pub every: Duration,
}

impl RecordConfig {
    pub fn new(listen: Listen) -> Self {
        RecordConfig {
            listen,
            recorder: RecorderOptions::default(),
            max_bytes: None,
            max_line_bytes: crate::capture::jsonl::MAX_LINE_BYTES,
            queue_batches: 256,
            when_behind: WhenBehind::Drop,
            copy_timeout: Duration::from_secs(10),
            pair_timeout: Duration::from_secs(900),
            max_connections: 256,
            hello_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
            max_pending_bytes: 64 << 20,
            seal: None,
            live: None,
        }
    }
}
