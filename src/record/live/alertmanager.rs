//! Alert delivery to Prometheus Alertmanager (`record --alertmanager URL`):
//! each alert is POSTed to Alertmanager's v2 API (`/api/v2/alerts`) by a
//! thread of its own behind a bounded queue, so a down, slow or failing
//! Alertmanager never holds the live replay, let alone capture.
//!
//! - Labels: `alertname`, `severity`, `pool`, `deployment`, and for an
//!   alert about one response its internal `request_id` (so that two
//!   affected responses are two alerts, not one) and `confidence`. No
//!   tenant, external id or other customer data is a label; the finding
//!   (which names them) is in the annotations.
//! - Queue: at most `queue` alerts wait; one that does not fit is dropped
//!   and counted (`kvtrail_alerts_dropped_total{sink="alertmanager"}`).
//! - Retries: a failed POST (no connection, a timeout, an answer other
//!   than 2xx) is retried with exponential backoff up to `attempts`
//!   times, then its alerts are dropped and counted; each failure is
//!   counted (`kvtrail_alert_delivery_failures_total`).
//! - Bounds: connect and read timeouts, a total timeout per POST, at most
//!   [`MAX_ANSWER`] bytes of an answer read (for its error message), no
//!   redirects, no proxies; at close, what is still queued gets
//!   `close_grace` to go out, then it is dropped and counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::metrics::Metrics;
use crate::error::{Error, Location, Result};

/// The metrics' sink label for Alertmanager.
pub const SINK: &str = "alertmanager";

/// The most bytes of an Alertmanager answer read.
pub const MAX_ANSWER: usize = 64 << 10;

/// Alerts sent in one POST at most.
const BATCH: usize = 64;

/// How alerts reach Alertmanager.
#[derive(Debug, Clone)]
pub struct AlertmanagerOptions {
    /// The POST endpoint (`…/api/v2/alerts`).
    pub url: reqwest::Url,
    /// Alerts waiting at most.
    pub queue: usize,
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of an answer.
    pub read_timeout: Duration,
    /// Longest POST, answer included.
    pub timeout: Duration,
    /// POSTs of one batch at most (the first and the retries).
    pub attempts: u32,
    /// The first backoff; doubled after each failure, at most `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
    /// At close: how long what is queued may still take to go out.
    pub close_grace: Duration,
}

impl AlertmanagerOptions {
    /// Options for Alertmanager at `url`: its base (`http://HOST:9093`)
    /// or the full `/api/v2/alerts` endpoint. Anything but http(s) is
    /// refused (exit 2, naming the option).
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |what: String| {
            Error::invalid(
                Location::default().column("--alertmanager"),
                what,
                "give Alertmanager's base URL, e.g. --alertmanager http://127.0.0.1:9093",
            )
        };
        let mut u =
            reqwest::Url::parse(url).map_err(|e| bad(format!("{url:?} is not a URL: {e}")))?;
        if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
            return Err(bad(format!("{url:?} is not an http(s) URL with a host")));
        }
        if !u.path().trim_end_matches('/').ends_with("/api/v2/alerts") {
            let p = format!("{}/api/v2/alerts", u.path().trim_end_matches('/'));
            u.set_path(&p);
        }
        Ok(AlertmanagerOptions {
            url: u,
            queue: 4096,
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(10),
            attempts: 5,
            backoff: Duration::from_millis(500),
            backoff_max: Duration::from_secs(8),
            close_grace: Duration::from_secs(5),
        })
    }
}

/// One alert as Alertmanager takes it (`postableAlert`).
#[derive(Debug, Clone)]
pub struct AmAlert {
    pub labels: Map<String, Value>,
    pub annotations: Map<String, Value>,
}

impl AmAlert {
    fn json(&self) -> Value {
        serde_json::json!({"labels": self.labels, "annotations": self.annotations})
    }
}

/// The queue to the delivery thread.
pub struct Delivery {
    tx: Option<SyncSender<AmAlert>>,
    thread: Option<JoinHandle<()>>,
    closing: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl Delivery {
    /// Starts the delivery thread.
    pub fn start(opts: &AlertmanagerOptions, metrics: Arc<Metrics>) -> Result<Delivery> {
        let client = reqwest::Client::builder()
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.read_timeout)
            .timeout(opts.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent(concat!("kvtrail/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Other(format!("cannot make the Alertmanager client: {e}")))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Other(format!("cannot start the Alertmanager client: {e}")))?;
        let (tx, rx) = sync_channel::<AmAlert>(opts.queue.max(1));
        let closing = Arc::new(AtomicBool::new(false));
        let w = Worker {
            opts: opts.clone(),
            client,
            rt,
            metrics: metrics.clone(),
            closing: closing.clone(),
            deadline: None,
        };
        let thread = std::thread::Builder::new()
            .name("kvtrail-alertmanager".into())
            .spawn(move || w.run(rx))
            .map_err(|e| Error::Other(format!("cannot start the Alertmanager thread: {e}")))?;
        Ok(Delivery {
            tx: Some(tx),
            thread: Some(thread),
            closing,
            metrics,
        })
    }

    /// Queues one alert (never waits); false (counted) when the queue is
    /// full.
    pub fn send(&self, a: AmAlert) -> bool {
        let q = self.metrics.queue(SINK);
        q.inc();
        match self.tx.as_ref().map(|t| t.try_send(a)) {
            Some(Ok(())) => true,
            Some(Err(TrySendError::Full(_) | TrySendError::Disconnected(_))) | None => {
                q.dec();
                self.metrics.dropped(SINK).inc();
                false
            }
        }
    }

    /// Sends what is queued (within the close grace) and stops the thread.
    pub fn close(mut self) {
        self.closing.store(true, Ordering::Relaxed);
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Worker {
    opts: AlertmanagerOptions,
    client: reqwest::Client,
    rt: tokio::runtime::Runtime,
    metrics: Arc<Metrics>,
    closing: Arc<AtomicBool>,
    deadline: Option<Instant>,
}

impl Worker {
    fn run(mut self, rx: Receiver<AmAlert>) {
        loop {
            let first = match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(a) => a,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let mut batch = vec![first];
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(a) => batch.push(a),
                    Err(_) => break,
                }
            }
            self.metrics.queue(SINK).dec_by(batch.len() as i64);
            let n = batch.len() as u64;
            if self.deliver(&batch) {
                self.metrics.sent(SINK).inc_by(n);
            } else {
                self.metrics.dropped(SINK).inc_by(n);
            }
        }
    }

    /// Whether the close grace is over (set on the first look after
    /// close).
    fn past_deadline(&mut self) -> bool {
        if !self.closing.load(Ordering::Relaxed) {
            return false;
        }
        let d = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + self.opts.close_grace);
        Instant::now() >= d
    }

    /// POSTs one batch, retrying with backoff; whether it went out.
    fn deliver(&mut self, batch: &[AmAlert]) -> bool {
        let body = Value::Array(batch.iter().map(AmAlert::json).collect()).to_string();
        let mut backoff = self.opts.backoff;
        for attempt in 0..self.opts.attempts.max(1) {
            if self.past_deadline() {
                return false;
            }
            if attempt > 0 {
                // The backoff, cut short by the close grace.
                let until = Instant::now() + backoff;
                while Instant::now() < until {
                    if self.past_deadline() {
                        return false;
                    }
                    std::thread::sleep(Duration::from_millis(20).min(backoff));
                }
                backoff = (backoff * 2).min(self.opts.backoff_max);
            }
            match self
                .rt
                .block_on(post(&self.client, &self.opts.url, body.clone()))
            {
                Ok(()) => return true,
                Err(_) => self.metrics.delivery_failures(SINK).inc(),
            };
        }
        false
    }
}

/// One POST; the answer's first [`MAX_ANSWER`] bytes at most are read.
async fn post(
    client: &reqwest::Client,
    url: &reqwest::Url,
    body: String,
) -> std::result::Result<(), String> {
    let mut r = client
        .post(url.clone())
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let mut got = Vec::new();
    while got.len() < MAX_ANSWER {
        match r.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c[..c.len().min(MAX_ANSWER - got.len())]),
            Ok(None) => break,
            // A success whose answer breaks off still delivered the alerts.
            Err(e) if !status.is_success() => return Err(e.to_string()),
            Err(_) => break,
        }
    }
    if status.is_success() {
        Ok(())
    } else {
        Err(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&got[..got.len().min(512)])
        ))
    }
}
