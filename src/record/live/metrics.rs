//! The live sidecar's metrics, in Prometheus text exposition at `/metrics`
//! (the Prometheus project's client, `prometheus-client`), served by a
//! thread of its own: one request at a time, each with read and write
//! timeouts, so a client that never reads or never sends holds nothing
//! but that thread for a moment.
//!
//! Names follow Prometheus conventions (`kvtrail_` prefix, `_total`
//! counters, units in the name). No label names a tenant or a request
//! (cardinality): pools, ops, sinks, and the guard's verdicts and actions
//! only.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::encoding::prometheus_text::{CONTENT_TYPE, encode};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::error::{Error, Location, Result};
use crate::record::stats::Stats;
use crate::record::wire::GuardVerdict;

type Labels = Vec<(String, String)>;

/// Every series the live sidecar exports.
pub struct Metrics {
    registry: Registry,
    pub events: Family<Labels, Counter>,
    pub foreign_reads: Counter,
    pub affected: Family<Labels, Counter>,
    pub prefix_hits: Counter,
    pub lost: Family<Labels, Counter>,
    pub holes: Family<Labels, Counter>,
    pub live_dropped: Counter,
    pub reads_unverified: Counter,
    pub alerts: Counter,
    pub alerts_aggregated: Counter,
    pub alerts_sent: Family<Labels, Counter>,
    pub alerts_dropped: Family<Labels, Counter>,
    pub alert_failures: Family<Labels, Counter>,
    pub alert_queue: Family<Labels, Gauge>,
    pub lag: Histogram,
    pub copies_waiting: Gauge,
    pub events_held: Gauge,
    pub copies_rebuilt: Counter,
    pub copies_late: Counter,
    pub copies_timed_out: Counter,
    pub bytes_written: Gauge,
    pub connections: Gauge,
    pub guard_decisions: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("kvtrail");
        let m = Metrics {
            registry: Registry::default(),
            events: Family::default(),
            foreign_reads: Counter::default(),
            affected: Family::default(),
            prefix_hits: Counter::default(),
            lost: Family::default(),
            holes: Family::default(),
            live_dropped: Counter::default(),
            reads_unverified: Counter::default(),
            alerts: Counter::default(),
            alerts_aggregated: Counter::default(),
            alerts_sent: Family::default(),
            alerts_dropped: Family::default(),
            alert_failures: Family::default(),
            alert_queue: Family::default(),
            // 1 ms .. about 16 s.
            lag: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            copies_waiting: Gauge::default(),
            events_held: Gauge::default(),
            copies_rebuilt: Counter::default(),
            copies_late: Counter::default(),
            copies_timed_out: Counter::default(),
            bytes_written: Gauge::default(),
            connections: Gauge::default(),
            guard_decisions: Family::default(),
        };
        r.register(
            "events",
            "KV events ingested by the live replay, by pool and op",
            m.events.clone(),
        );
        r.register(
            "foreign_reads",
            "Read events that read KV another request wrote without a share grant",
            m.foreign_reads.clone(),
        );
        r.register(
            "affected_responses",
            "Responses with a first foreign read, by confidence",
            m.affected.clone(),
        );
        r.register(
            "cross_tenant_prefix_hits",
            "Responses that hit another tenant's cached prefix where prefix caches are per tenant",
            m.prefix_hits.clone(),
        );
        r.register(
            "events_lost",
            "KV events lost before the trace (seq holes), by pool",
            m.lost.clone(),
        );
        r.register(
            "seq_holes",
            "Seq holes the live replay met, by pool",
            m.holes.clone(),
        );
        r.register(
            "live_events_dropped",
            "Events the live replay's queue could not take (written to the trace, not classified live)",
            m.live_dropped.clone(),
        );
        r.register(
            "live_reads_unverified",
            "Read events with foreign runs the live view could only call uncertain while it was not exact (dropped events, late copies): those runs are not alerted; scope the trace",
            m.reads_unverified.clone(),
        );
        r.register(
            "alerts",
            "Alerts raised (those folded into a storm summary included)",
            m.alerts.clone(),
        );
        r.register(
            "alerts_aggregated",
            "Alerts not sent one by one in an alert storm: counted in a storm summary alert",
            m.alerts_aggregated.clone(),
        );
        r.register(
            "alerts_sent",
            "Alerts delivered, by sink (file: --alerts; alertmanager: --alertmanager)",
            m.alerts_sent.clone(),
        );
        r.register(
            "alerts_dropped",
            "Alerts not delivered (a full queue, a failed write, delivery given up), by sink",
            m.alerts_dropped.clone(),
        );
        r.register(
            "alert_delivery_failures",
            "Failed delivery attempts (each retry counted), by sink",
            m.alert_failures.clone(),
        );
        r.register(
            "alert_queue_depth",
            "Alerts waiting to be delivered, by sink",
            m.alert_queue.clone(),
        );
        r.register_with_unit(
            "live_lag",
            "Time from an event's arrival at the writer to its classification",
            Unit::Seconds,
            m.lag.clone(),
        );
        r.register(
            "copies_waiting",
            "Pools whose next event is a copy waiting for its source pool",
            m.copies_waiting.clone(),
        );
        r.register(
            "events_held",
            "Events waiting in the live replay's queues",
            m.events_held.clone(),
        );
        r.register(
            "copies_rebuilt",
            "Copies whose source had moved past src_seq, rebuilt exactly from its history",
            m.copies_rebuilt.clone(),
        );
        r.register(
            "copies_late",
            "Copies whose source had moved past src_seq (taken uncertain)",
            m.copies_late.clone(),
        );
        r.register(
            "copies_timed_out",
            "Copies that waited past the bound for their source (taken uncertain)",
            m.copies_timed_out.clone(),
        );
        r.register_with_unit(
            "trace",
            "Bytes of the trace on disk",
            Unit::Bytes,
            m.bytes_written.clone(),
        );
        r.register(
            "connections",
            "Live engine connections",
            m.connections.clone(),
        );
        r.register(
            "guard_decisions",
            "Decisions of the guard in the engines, by verdict (ok, foreign, unknown) and action (alert, abort, allow)",
            m.guard_decisions.clone(),
        );
        Metrics { registry: r, ..m }
    }
}

fn sink(s: &str) -> Labels {
    vec![("sink".to_string(), s.to_string())]
}

impl Metrics {
    /// Creates the series of every pool, confidence and sink at zero, so
    /// that a first increase is an increase (Prometheus' `increase()`
    /// sees nothing of a series' first sample).
    pub fn init(&self, pools: &[u16], sinks: &[&str]) {
        for p in pools {
            let l = vec![("pool".to_string(), p.to_string())];
            let _ = self.lost.get_or_create(&l);
            let _ = self.holes.get_or_create(&l);
        }
        for c in ["confirmed", "possible"] {
            let _ = self
                .affected
                .get_or_create(&vec![("confidence".to_string(), c.to_string())]);
        }
        let _ = self.guard("ok", "allow");
        for v in GuardVerdict::ALL {
            for &a in v.actions() {
                let _ = self.guard(v.as_str(), a.as_str());
            }
        }
        for s in sinks {
            self.queue(s);
            self.sent(s);
            self.dropped(s);
            self.delivery_failures(s);
        }
    }

    /// The guard decisions counter of one verdict and action (`ok` and
    /// `allow` for the checks answered ok; else a [`GuardVerdict`] and one
    /// of its actions).
    pub fn guard(&self, verdict: &str, action: &str) -> Counter {
        self.guard_decisions
            .get_or_create(&vec![
                ("verdict".to_string(), verdict.to_string()),
                ("action".to_string(), action.to_string()),
            ])
            .clone()
    }

    /// The queue depth of a sink (`file`, `alertmanager`).
    pub fn queue(&self, s: &str) -> Gauge {
        self.alert_queue.get_or_create(&sink(s)).clone()
    }

    pub fn sent(&self, s: &str) -> Counter {
        self.alerts_sent.get_or_create(&sink(s)).clone()
    }

    pub fn dropped(&self, s: &str) -> Counter {
        self.alerts_dropped.get_or_create(&sink(s)).clone()
    }

    pub fn delivery_failures(&self, s: &str) -> Counter {
        self.alert_failures.get_or_create(&sink(s)).clone()
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut s, &self.registry);
        s
    }

    /// Copies the sidecar's own counters into the gauges.
    pub fn sync(&self, stats: &Stats) {
        self.bytes_written
            .set(stats.bytes_on_disk.load(Ordering::Relaxed) as i64);
        self.connections
            .set(stats.connections_live.load(Ordering::Relaxed) as i64);
    }
}

/// The `/metrics` server.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
}

/// Whether `addr` may be served: loopback, or `allow_remote`.
pub fn check_addr(addr: SocketAddr, allow_remote: bool) -> Result<()> {
    if !addr.ip().is_loopback() && !allow_remote {
        return Err(Error::invalid(
            Location::default().column("--metrics"),
            format!("{} is not a loopback address", addr.ip()),
            "the metrics name pools and counts of findings: serve them on 127.0.0.1 (e.g. \
             --metrics 127.0.0.1:9464), or pass --allow-remote on a trusted network",
        ));
    }
    Ok(())
}

impl Server {
    /// Binds `addr` (refused: the address named, exit 2) and serves.
    pub fn start(addr: SocketAddr, metrics: Arc<Metrics>, served: Arc<AtomicI64>) -> Result<Self> {
        let l = TcpListener::bind(addr).map_err(|e| {
            Error::invalid(
                Location::default().column("--metrics"),
                format!("cannot serve metrics on {addr}: {e}"),
                "the port is taken or not allowed: choose another --metrics address",
            )
        })?;
        let bound = l.local_addr().unwrap_or(addr);
        l.set_nonblocking(true)
            .map_err(|e| Error::Other(format!("metrics listener on {bound}: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvtrail-metrics".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => {
                            if serve(s, &metrics).is_ok() {
                                served.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })
            .map_err(|e| Error::Other(format!("cannot start the metrics thread: {e}")))?;
        Ok(Server {
            stop,
            thread: Some(thread),
            addr: bound,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The longest request head read.
const MAX_HEAD: usize = 8 * 1024;

/// Answers one HTTP request: GET /metrics, else 404 (or 405).
fn serve(mut s: TcpStream, m: &Metrics) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            break;
        }
    }
    let line = String::from_utf8_lossy(&head);
    let first = line.lines().next().unwrap_or_default();
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET" | "HEAD", "/metrics") => ("200 OK", CONTENT_TYPE, m.render()),
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain",
            "not found: try /metrics\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics\n".into(),
        ),
    };
    let body = if method == "HEAD" {
        String::new()
    } else {
        body
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}
