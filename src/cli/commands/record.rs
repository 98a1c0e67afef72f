//! `kvtrail record --listen ADDR --deployment deploy.json --out TRACE`: the
//! capture sidecar (library side in `kvtrail::record`). Runs until SIGTERM
//! or SIGINT, then closes the trace cleanly; prints a health line to stderr
//! every few seconds and a summary to stdout at the end.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvtrail::capture::jsonl::load_deployment;
use kvtrail::record::{Listen, RecordConfig, RecordLog, Sidecar};
use kvtrail::text::term;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Unix socket path (`unix:PATH` or a path; created 0600) or loopback TCP (`tcp:127.0.0.1:PORT`).
    #[arg(long)]
    pub listen: String,
    /// The deployment: trace.json's `deployment` object, or a whole trace.json.
    #[arg(long)]
    pub deployment: PathBuf,
    /// New trace directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Rotate each part file once it reaches this many bytes.
    #[arg(long, default_value_t = 128 << 20)]
    pub rotate: u64,
    /// Stop writing at this many bytes on disk: later events are counted as lost, capture marked incomplete.
    #[arg(long)]
    pub max_bytes: Option<u64>,
    /// Accept TCP addresses other than loopback (the stream is unauthenticated).
    #[arg(long)]
    pub allow_remote: bool,
    /// Longest accepted line in bytes; longer lines are skipped and counted.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_line_bytes: usize,
    /// Batches (up to 1024 messages each) queued for the writer before events are dropped as holes.
    #[arg(long, default_value_t = 256)]
    pub queue: usize,
    /// When the writer is behind and the queue is full: drop events as counted holes (default; the engine never waits on kvtrail), or wait, slowing the sender through its socket (replaying a capture; a hook that buffers and reports its own loss).
    #[arg(long, value_enum, default_value_t = kvtrail::record::WhenBehind::Drop, value_name = "drop|wait")]
    pub when_behind: kvtrail::record::WhenBehind,
    /// Seconds between health lines on stderr (0: none).
    #[arg(long, default_value_t = 5)]
    pub health_secs: u64,
    /// Seconds a decode transfer commit waits for the prefill's send before it is recorded as lost.
    #[arg(long, default_value_t = 10)]
    pub copy_timeout: u64,
    /// Rows per row group (the most a crash can lose per stream).
    #[arg(long, default_value_t = 64 * 1024)]
    pub row_group_rows: usize,
    /// Capture began with the engines' pools empty (started together with the engine).
    #[arg(long)]
    pub from_engine_start: bool,
    /// Live connections at most (one thread each); more are refused, counted, and the capture marked incomplete.
    #[arg(long, default_value_t = 256)]
    pub max_connections: u64,
    /// Seconds a new connection has to send its hello; then it is closed, counted, and the capture marked incomplete.
    #[arg(long, default_value_t = 10)]
    pub hello_timeout: u64,
    /// Seconds connections may still send after SIGTERM/SIGINT; then the ones still sending are cut (counted, capture incomplete).
    #[arg(long, default_value_t = 5)]
    pub shutdown_grace: u64,
    /// Memory for request views, transfer halves and parked streams waiting for their partner; beyond it they are dropped and counted.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_pending_bytes: u64,
    /// OpenSSH ed25519 private key (owner-only, no passphrase): seal the trace while it is written (seals/, docs/evidence.md).
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
    /// With --signing-key: a seal every DURATION (e.g. 500ms, 10s, 5m; default 60s), and a final one at close.
    #[arg(long, value_name = "DURATION", value_parser = kvtrail::custody::seal::parse_every, requires = "signing_key")]
    pub seal_every: Option<Duration>,
    /// Live detection: apply the lineage rule while recording and write live-findings.json into the trace (docs/live.md). Implied by --alerts, --alertmanager and --metrics.
    #[arg(long)]
    pub live: bool,
    /// Write one OCSF JSON line per alert to FILE (appended; `-`: stdout): first foreign read of a response, cross-tenant prefix hit, capture loss.
    #[arg(long, value_name = "FILE")]
    pub alerts: Option<String>,
    /// Also POST each alert to Alertmanager's v2 API at URL (e.g. http://127.0.0.1:9093); never blocks capture: a bounded queue, retries with backoff, dropped alerts counted.
    #[arg(long, value_name = "URL")]
    pub alertmanager: Option<String>,
    /// Alerts sent one by one per 10 s at most; the rest of the window are counted in one storm summary alert.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub alert_storm_limit: u32,
    /// Serve Prometheus metrics at http://ADDR/metrics (loopback unless --allow-remote), e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Milliseconds live detection holds each event before applying it (so copies see their source as of src_seq).
    #[arg(long, default_value_t = 200)]
    pub live_holdback_ms: u64,
    /// Content-changing events per pool whose prior content live detection keeps, so a copy that arrives after its source moved on is rebuilt exactly (0: none; each costs about 50 bytes).
    #[arg(long, default_value_t = kvtrail::record::live::Bounds::default().history, value_name = "N")]
    pub live_history: usize,
}

struct StderrLog;
impl RecordLog for StderrLog {
    fn log(&self, line: &str) {
        let _ = writeln!(std::io::stderr().lock(), "record: {}", term(line));
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let deployment = load_deployment(&args.deployment)?;
    // Checked before anything is created.
    let key = super::verify::load_key(args.signing_key.as_deref())?;
    kvtrail::custody::prepare_trace_out(
        &args.out,
        &super::ingest::deployment_trace(&args.deployment),
    )?;
    let listen = Listen::parse(&args.listen, args.allow_remote)?;
    let mut cfg = RecordConfig::new(listen);
    cfg.recorder.part.rotate_bytes = args.rotate.max(1);
    cfg.recorder.row_group_rows = args.row_group_rows.max(1);
    cfg.recorder.from_engine_start = args.from_engine_start;
    cfg.max_bytes = args.max_bytes;
    cfg.max_line_bytes = args.max_line_bytes.max(64);
    cfg.queue_batches = args.queue.max(1);
    cfg.when_behind = args.when_behind;
    cfg.copy_timeout = Duration::from_secs(args.copy_timeout);
    cfg.max_connections = args.max_connections.max(1);
    cfg.hello_timeout = Duration::from_secs(args.hello_timeout.max(1));
    cfg.shutdown_grace = Duration::from_secs(args.shutdown_grace);
    cfg.max_pending_bytes = args.max_pending_bytes;
    cfg.seal = key.map(|key| kvtrail::record::SealConfig {
        key,
        every: args.seal_every.unwrap_or(Duration::from_secs(60)),
    });
    if args.live || args.alerts.is_some() || args.metrics.is_some() || args.alertmanager.is_some() {
        if let Some(a) = args.metrics {
            kvtrail::record::live::metrics::check_addr(a, args.allow_remote)?;
        }
        let alertmanager = match &args.alertmanager {
            Some(u) => Some(kvtrail::record::live::AlertmanagerOptions::parse(u)?),
            None => None,
        };
        let mut o = kvtrail::record::live::LiveOptions {
            alerts: args.alerts.as_deref().map(|a| match a {
                "-" => kvtrail::record::live::AlertTarget::Stream(Arc::new(std::sync::Mutex::new(
                    Box::new(std::io::stdout()),
                ))),
                f => kvtrail::record::live::AlertTarget::File(PathBuf::from(f)),
            }),
            metrics: args.metrics,
            alertmanager,
            storm_limit: args.alert_storm_limit.max(1),
            ..Default::default()
        };
        o.bounds.holdback = Duration::from_millis(args.live_holdback_ms);
        o.bounds.history = args.live_history;
        cfg.live = Some(o);
    }

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let sidecar = Sidecar::start(cfg, deployment, &args.out, Arc::new(StderrLog))?;
    eprintln!(
        "record: listening on {}, writing {}",
        term(&sidecar.listen().to_string()),
        term(&args.out.display().to_string())
    );
    if let Some(a) = sidecar.metrics_addr() {
        eprintln!("record: metrics at http://{a}/metrics");
    }
    let stats = sidecar.stats();
    let mut last = Instant::now();
    let mut last_written = 0u64;
    // A failed writer (logged when it happened) ends the run: shutdown
    // returns its error (exit 2).
    while !stop.load(Ordering::SeqCst) && !sidecar.writer_failed() {
        std::thread::sleep(Duration::from_millis(50));
        if args.health_secs > 0 && last.elapsed() >= Duration::from_secs(args.health_secs) {
            let s = stats.snapshot();
            let dt = last.elapsed().as_secs_f64();
            let rate = s.kv_written.saturating_sub(last_written) as f64 / dt;
            last = Instant::now();
            last_written = s.kv_written;
            eprintln!(
                "record: health: {:.0} events/s, {} events, {} requests, queue {}, conns {}, lost {} (queue {}, hooks {}, max-bytes {}, copies {}), rejected {} (malformed {}, forged {}, contract {}, unattributed {}, hello {}), {} bytes",
                rate,
                s.kv_written,
                s.requests_written,
                s.queue_depth,
                s.connections_live,
                s.lost_events(),
                s.lost_queue,
                s.lost_hook,
                s.lost_max_bytes,
                s.copies_unresolved,
                s.rejected(),
                s.rejected_malformed,
                s.rejected_forged,
                s.rejected_contract,
                s.rejected_unattributed,
                s.rejected_hello,
                s.bytes_on_disk,
            );
        }
    }
    eprintln!("record: stopping: draining connections and closing the trace");
    let sum = sidecar.shutdown()?;
    let s = &sum.stats;
    output::print_human(|out| {
        writeln!(
            out,
            "{}: {} kv events, {} requests, {} files, {} connections; lost {} (queue {}, hooks {}, max-bytes {}, copies {}; not recordable as holes {}); rejected malformed {}, forged {}, contract {}, unattributed {}; connections refused {}, dropped before hello {}, cut at shutdown {}, ended without bye {}; events unaccounted {}; requests lost {}, conflicting ids {}; capture {}",
            term(&args.out.display().to_string()),
            s.kv_written,
            s.requests_written,
            sum.files,
            s.connections_total,
            s.lost_events(),
            s.lost_queue,
            s.lost_hook,
            s.lost_max_bytes,
            s.copies_unresolved,
            s.lost_unrecorded,
            s.rejected_malformed,
            s.rejected_forged,
            s.rejected_contract,
            s.rejected_unattributed,
            s.refused_connections,
            s.dropped_before_hello,
            s.connections_cut,
            s.connections_unclosed,
            s.events_unaccounted,
            s.lost_requests,
            s.request_conflicts,
            if sum.complete {
                "complete"
            } else {
                "INCOMPLETE"
            }
        )?;
        if args.signing_key.is_some() {
            let cost = sum.seal_cost.unwrap_or_default();
            writeln!(
                out,
                "{}: sealed: {} in seals/ (check: kvtrail verify --allowed-signers FILE); sealing used {:.3} CPU-s on its thread, {:.3} s of the writer's, {:.3} s waiting for the final seal",
                term(&args.out.display().to_string()),
                kvtrail::words::count(sum.seals, "seal", "seals"),
                cost.sealer_cpu_s,
                cost.writer_s,
                cost.final_wait_s
            )?;
        }
        Ok(())
    })?;
    if let Some(l) = &sum.live {
        output::print_human(|out| {
            writeln!(
                out,
                "live: {} events classified, {} affected responses, {} alerts ({} written, {} dropped{}{}), {} seq holes, {} late copies rebuilt; not seen live: {} events dropped, {} copies late, {} copies timed out, {} reads unverified (not alerted){}; {}",
                l.events_applied,
                l.affected_responses,
                l.alerts,
                l.alerts_written,
                l.alerts_dropped,
                if l.alerts_aggregated > 0 {
                    format!(", {} aggregated in storm summaries", l.alerts_aggregated)
                } else {
                    String::new()
                },
                if args.alertmanager.is_some() {
                    format!(
                        "; Alertmanager: {} sent, {} dropped",
                        l.alertmanager_sent, l.alertmanager_dropped
                    )
                } else {
                    String::new()
                },
                l.seq_holes,
                l.copies_rebuilt,
                l.events_dropped,
                l.copies_late,
                l.copies_timed_out,
                l.reads_unverified,
                l.stopped
                    .as_deref()
                    .map(|s| format!("; stopped: {}", term(s)))
                    .unwrap_or_default(),
                if l.exact() {
                    "live findings equal a fresh scope"
                } else {
                    "live findings may differ from a fresh scope (see live-findings.json)"
                }
            )
        })?;
    }
    Ok(0)
}
