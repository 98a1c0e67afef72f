//! One engine connection: hello, bounded line reading, per-line parsing and
//! forgery checks, and batched hand-off to the writer over the bounded
//! queue.
//!
//! The connection thread never blocks on the writer while the stream is
//! live: when the queue is full the batch's KV messages are dropped and
//! turned into holes for their pools, sent ahead of the next batch that
//! gets through, so the loss lands in the trace as an explicit seq hole
//! close to where it happened. Requests, guard decisions and the hook's
//! `lost` counts are never dropped: they are carried into the next batch.
//!
//! Time bounds: the hello must come within `hello_timeout` (a silent
//! connection must not hold a slot); after the stop a connection may send
//! for `shutdown_grace`, then it is cut (a trickling client must not hold
//! the shutdown open). Both are counted and make the capture incomplete.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::time::{Duration, Instant};

use super::shared::{Batch, Shared, View};
use super::stats::add;
use super::wire::{Msg, WIRE_MAX_COUNT, canonical_kv, parse_hello, parse_msg};
use crate::capture::jsonl::line_runs;
use crate::trace::manifest::Role;

/// Most messages per batch handed to the writer.
const BATCH: usize = 1024;
/// Carried-over requests beyond this make the thread wait for the writer.
const MAX_CARRIED: usize = 10_000;

pub(crate) trait Stream: Read + Write + Send {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()>;
}

impl Stream for std::os::unix::net::UnixStream {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
}

impl Stream for std::net::TcpStream {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
}

struct Conn {
    id: u64,
    name: String,
    pools: Vec<u16>,
    /// Which side of a PD request this connection reports.
    view: View,
    shared: Arc<Shared>,
    batch: Vec<Msg>,
    /// Events dropped (queue full) and not yet sent as holes.
    pending_loss: BTreeMap<u16, u64>,
    /// `lost` lines of the hook carried over a full queue, summed per pool.
    pending_hook: BTreeMap<u16, u64>,
    logged: u32,
    /// The client's closing line, once it came.
    bye: Option<super::wire::Bye>,
    /// Why this connection's pool positions (a `copy` line's `src_pos`)
    /// can no longer be counted, once a line broke the count.
    unsure: Option<&'static str>,
    /// Pools this connection reported pulls into (their events the hook
    /// cannot count): copies from them are holes. (A transfer's commit is
    /// counted by the writer, which moves the pool's positions past it.)
    pulled_into: Vec<u16>,
}

/// Counts a connection as live from accept until its thread ends.
pub(crate) struct Live(pub Arc<Shared>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0
            .stats
            .connections_live
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one connection to its end (EOF, error, the hello deadline, the
/// stop with nothing left to read, or the end of the stop's grace).
pub(crate) fn serve(mut stream: Box<dyn Stream>, id: u64, shared: Arc<Shared>) {
    let _live = Live(shared.clone());
    let _ = stream.set_timeout(Duration::from_millis(200));
    let max = shared.cfg.max_line_bytes;
    let mut reader = BufReader::with_capacity(1 << 16, &mut *stream);
    // Hello first (bounded like every line, and in time: a connection that
    // never says hello must not hold a slot).
    let deadline = Instant::now() + shared.cfg.hello_timeout;
    let hello = match read_bounded(&mut reader, max, &shared, Some(deadline)) {
        Got::Line(l) => l,
        Got::TooLong | Got::End | Got::Stopped => return,
        Got::Deadline | Got::Cut => {
            // It may have been an engine too slow to say hello: whatever it
            // would have sent is missing, so it is counted.
            add(&shared.stats.dropped_before_hello, 1);
            let why = format!(
                "no hello line within {} s",
                shared.cfg.hello_timeout.as_secs_f64()
            );
            shared.log(&format!("connection #{id} dropped: {why}"));
            let msg = serde_json::json!({"type": "error", "error": why}).to_string();
            let _ = reader.get_mut().write_all(format!("{msg}\n").as_bytes());
            return;
        }
    };
    let hello = match parse_hello(&String::from_utf8_lossy(&hello)) {
        Ok(h) => h,
        Err(e) => return refuse(stream, &shared, id, &e),
    };
    let mut pools = hello.pools.clone();
    pools.sort_unstable();
    pools.dedup();
    for p in &pools {
        let Some(dp) = shared.deployment.pool(*p) else {
            let e = format!("hello declares pool {p}, which the deployment does not list");
            shared.stats.refused_claims.fetch_add(1, Ordering::Relaxed);
            return refuse(stream, &shared, id, &e);
        };
        if let Some(&n) = hello.page_sizes.get(p)
            && n != dp.page_size
        {
            let e = format!(
                "hello gives pool {p} block size {n}, the deployment's page_size is {}",
                dp.page_size
            );
            shared.stats.refused_claims.fetch_add(1, Ordering::Relaxed);
            return refuse(stream, &shared, id, &e);
        }
    }
    {
        let mut claims = shared.claims.lock().expect("claims lock");
        if let Some(p) = pools.iter().find(|p| claims.contains_key(p)) {
            let other = claims[p].clone();
            drop(claims);
            let e = format!("pool {p} is already claimed by live connection {other}");
            shared.stats.refused_claims.fetch_add(1, Ordering::Relaxed);
            return refuse(stream, &shared, id, &e);
        }
        let name = format!("#{id} {}", hello.worker);
        for p in &pools {
            claims.insert(*p, name.clone());
        }
    }
    // A `cache` pool (HiCache host memory) rides on its device pool's
    // connection and sees no requests: the view is the device pools' (a
    // decode worker with HiCache still reports decode rows).
    let roles: Vec<Role> = pools
        .iter()
        .filter_map(|p| shared.deployment.pool(*p).map(|x| x.role))
        .filter(|r| *r != Role::Cache)
        .collect();
    let view = if roles.is_empty() {
        View::Full
    } else if roles.iter().all(|r| *r == Role::Prefill) {
        View::Prefill
    } else if roles.iter().all(|r| *r == Role::Decode) {
        View::Decode
    } else {
        View::Full
    };
    shared.log(&format!(
        "connection #{id} ({}) declares pools {:?}",
        hello.worker, pools
    ));
    // The writer learns the claim before the client does (a blocking hand
    // over), so whatever any connection sends after this client's welcome
    // is seen with the claim in place.
    hand_over(
        &shared,
        id,
        view,
        Msg::Open {
            pools: pools.clone(),
        },
    );
    // The claim holds: say so, so a client knows its events will be kept
    // (a refused hello gets an `error` line instead, then the close).
    let welcome = serde_json::json!({"type": "welcome", "connection": id, "pools": pools});
    if reader
        .get_mut()
        .write_all(format!("{welcome}\n").as_bytes())
        .is_err()
    {
        // The client is gone before its first event: release the claim
        // (it sent nothing, so nothing of it is missing).
        let bye = super::wire::Bye {
            enqueued: 0,
            sent: 0,
            dropped: 0,
        };
        hand_over(
            &shared,
            id,
            view,
            Msg::End {
                bye: Some(bye),
                at_stop: false,
            },
        );
        let mut claims = shared.claims.lock().expect("claims lock");
        for p in &pools {
            claims.remove(p);
        }
        return;
    }
    let mut c = Conn {
        id,
        name: hello.worker,
        pools,
        view,
        shared: shared.clone(),
        batch: Vec::with_capacity(BATCH),
        pending_loss: BTreeMap::new(),
        pending_hook: BTreeMap::new(),
        logged: 0,
        bye: None,
        unsure: None,
        pulled_into: Vec::new(),
    };
    let mut at_stop = false;
    loop {
        // Whole lines already in the buffer are read in place (no copy);
        // a line that spans reads, or is too long, takes read_bounded.
        let buf = reader.buffer();
        if let Some(i) = memchr::memchr(b'\n', buf)
            && i <= max
        {
            let raw = &buf[..i];
            if !raw.iter().all(u8::is_ascii_whitespace) {
                c.line(raw);
            }
            reader.consume(i + 1);
            if c.batch.len() >= BATCH || reader.buffer().is_empty() {
                c.flush(false);
            }
            continue;
        }
        match read_bounded(&mut reader, max, &shared, None) {
            Got::Line(line) => {
                c.line(&line);
                if c.batch.len() >= BATCH || reader.buffer().is_empty() {
                    c.flush(false);
                }
            }
            Got::TooLong => {
                c.reject_unattributed("a line longer than --max-line-bytes (dropped unread)");
            }
            Got::End | Got::Deadline => break,
            Got::Stopped => {
                at_stop = true;
                break;
            }
            Got::Cut => {
                add(&shared.stats.connections_cut, 1);
                shared.log(&format!(
                    "connection #{id} ({}) cut: still sending {} s after the stop; what it had not sent is missing",
                    c.name,
                    shared.cfg.shutdown_grace.as_secs_f64()
                ));
                break;
            }
        }
    }
    c.batch.push(Msg::End {
        bye: c.bye,
        at_stop,
    });
    c.flush(true);
    {
        let mut claims = shared.claims.lock().expect("claims lock");
        for p in &c.pools {
            claims.remove(p);
        }
    }
    shared.log(&format!("connection #{id} ({}) closed", c.name));
}

/// Hands one message to the writer, waiting for room.
fn hand_over(shared: &Shared, conn: u64, view: View, m: Msg) {
    add(&shared.stats.queue_depth, 1);
    if shared
        .tx
        .send(Batch {
            conn,
            view,
            msgs: vec![m],
        })
        .is_err()
    {
        shared.stats.queue_depth.fetch_sub(1, Ordering::Relaxed);
    }
}

fn refuse(mut stream: Box<dyn Stream>, shared: &Shared, id: u64, why: &str) {
    shared.stats.rejected_hello.fetch_add(1, Ordering::Relaxed);
    shared.log(&format!("connection #{id} refused: {why}"));
    let msg = serde_json::json!({"type": "error", "error": why}).to_string();
    let _ = stream.write_all(msg.as_bytes());
    let _ = stream.write_all(b"\n");
}

/// What [`read_bounded`] got.
enum Got {
    Line(Vec<u8>),
    /// A line longer than the limit, skipped up to its newline unbuffered.
    TooLong,
    /// End of stream, a read error, or the stop with nothing pending.
    End,
    /// `deadline` passed before a whole line came.
    Deadline,
    /// The stop's grace period ran out while the client was still sending.
    Cut,
    /// The sidecar stopped while the stream was idle (read to its end).
    Stopped,
}

/// Reads one line of at most `max` bytes, before `deadline` if one is set.
fn read_bounded(
    r: &mut impl BufRead,
    max: usize,
    shared: &Shared,
    deadline: Option<Instant>,
) -> Got {
    let mut line = Vec::new();
    let mut discarding = false;
    loop {
        // Checked before every read, not only when idle: a client that
        // trickles bytes is never idle.
        if shared.past_grace() {
            return Got::Cut;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Got::Deadline;
        }
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // Idle: on shutdown an idle stream is finished.
                if shared.stop.load(Ordering::Relaxed) {
                    return match finish(line, discarding) {
                        Got::End => Got::Stopped,
                        g => g,
                    };
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return finish(line, discarding),
        };
        if buf.is_empty() {
            return finish(line, discarding);
        }
        match memchr::memchr(b'\n', buf) {
            Some(i) => {
                let over = discarding || line.len() + i > max;
                if !over {
                    line.extend_from_slice(&buf[..i]);
                }
                r.consume(i + 1);
                if over {
                    return Got::TooLong;
                }
                if line.iter().all(u8::is_ascii_whitespace) {
                    line.clear();
                    continue;
                }
                return Got::Line(line);
            }
            None => {
                let n = buf.len();
                if !discarding && line.len() + n > max {
                    discarding = true;
                    line = Vec::new();
                }
                if !discarding {
                    line.extend_from_slice(buf);
                }
                r.consume(n);
            }
        }
    }
}

fn finish(line: Vec<u8>, discarding: bool) -> Got {
    if discarding {
        Got::TooLong
    } else if line.iter().all(u8::is_ascii_whitespace) {
        Got::End
    } else {
        Got::Line(line)
    }
}

impl Conn {
    fn log_limited(&mut self, msg: &str) {
        self.logged += 1;
        if self.logged <= 20 {
            self.shared
                .log(&format!("connection #{} ({}): {msg}", self.id, self.name));
        } else if self.logged == 21 {
            self.shared.log(&format!(
                "connection #{} ({}): further rejects are counted, not logged",
                self.id, self.name
            ));
        }
    }

    fn reject_unattributed(&mut self, why: &str) {
        self.unsure = Some("a line of this connection was rejected without a pool");
        self.shared
            .stats
            .rejected_unattributed
            .fetch_add(1, Ordering::Relaxed);
        self.log_limited(&format!("rejected: {why}"));
    }

    fn line(&mut self, raw: &[u8]) {
        // The hook's canonical KV line is read from its bytes (it is ASCII
        // when it parses); anything else is checked for UTF-8 first.
        let (parsed, line) = match canonical_kv(raw) {
            Some(m) => (Ok(m), ""),
            None => {
                let Ok(line) = std::str::from_utf8(raw) else {
                    return self.reject_unattributed("a line that is not UTF-8");
                };
                (Err(()), line)
            }
        };
        if self.bye.is_some() {
            // `bye` is the last line: whatever follows it breaks the
            // client's own count.
            self.bye = None;
            return self.reject_unattributed("a line after the closing `bye` line");
        }
        match parsed.or_else(|()| parse_msg(line)) {
            Ok(Msg::Bye(b)) => self.bye = Some(b),
            Ok(mut m) => {
                self.positions(&mut m);
                if let Some(p) = m.pool()
                    && !self.pools.contains(&p)
                {
                    self.shared
                        .stats
                        .rejected_forged
                        .fetch_add(1, Ordering::Relaxed);
                    return self.log_limited(&format!(
                        "rejected: event for pool {p}, which this connection did not declare ({:?})",
                        self.pools
                    ));
                }
                match m {
                    // A line of several runs: one event per run (the hook's
                    // positions count each), in batches of at most BATCH
                    // like any other lines (the queue's bound).
                    Msg::KvRuns(evs) => {
                        for event in evs {
                            self.batch.push(Msg::Kv { event, seq: None });
                            if self.batch.len() >= BATCH {
                                self.flush(false);
                            }
                        }
                    }
                    m => self.batch.push(m),
                }
            }
            Err(e) => {
                let s = &self.shared.stats;
                match e.pool {
                    // A bad event of a readable, declared pool: explicit hole
                    // (unless it carried its own seq: then the hole is there).
                    Some(p) if self.pools.contains(&p) => {
                        s.rejected_malformed.fetch_add(1, Ordering::Relaxed);
                        if !line_has_seq(line) {
                            // A line of runs (`kv` with runs, `copy`) stood
                            // for one event per run in the hook's count.
                            let n = line_runs(line).unwrap_or(1);
                            self.batch.push(Msg::Hole { pool: p, n });
                        } else {
                            self.unsure = Some("a rejected line carried its own seq");
                        }
                        self.log_limited(&format!("rejected (hole in pool {p}): {e}"));
                    }
                    _ => self.reject_unattributed(&e.to_string()),
                }
            }
        }
    }

    /// Hands the batch to the writer. `wait` (end of connection) or
    /// `--when-behind wait`: block until it is taken; otherwise drop on a
    /// full queue and count.
    fn flush(&mut self, wait: bool) {
        if self.batch.is_empty() && self.pending_loss.is_empty() && self.pending_hook.is_empty() {
            return;
        }
        let head = self.pending_loss.len() + self.pending_hook.len();
        let mut msgs: Vec<Msg> = self
            .pending_loss
            .iter()
            .map(|(&pool, &n)| Msg::Hole { pool, n })
            .chain(
                self.pending_hook
                    .iter()
                    .map(|(&pool, &n)| Msg::Lost { pool, n }),
            )
            .collect();
        msgs.append(&mut self.batch);
        let shared = self.shared.clone();
        let stats = &shared.stats;
        let n = msgs.len() as u64;
        let batch = Batch {
            conn: self.id,
            view: self.view,
            msgs,
        };
        let must_wait = wait
            || self.shared.cfg.when_behind == super::config::WhenBehind::Wait
            || batch
                .msgs
                .iter()
                .filter(|m| matches!(m, Msg::Request(_) | Msg::Guard(_) | Msg::GuardOk { .. }))
                .count()
                > MAX_CARRIED;
        stats.queue_depth.fetch_add(n, Ordering::Relaxed);
        let res = if must_wait {
            self.shared
                .tx
                .send(batch)
                .map_err(|e| TrySendError::Disconnected(e.0))
        } else {
            self.shared.tx.try_send(batch)
        };
        match res {
            Ok(()) => {
                self.pending_loss.clear();
                self.pending_hook.clear();
            }
            Err(TrySendError::Full(b)) | Err(TrySendError::Disconnected(b)) => {
                stats.queue_depth.fetch_sub(n, Ordering::Relaxed);
                // The first `head` messages came from pending_loss and
                // pending_hook, which still hold them; fold the rest in and
                // keep what must not be lost. The hook's `lost` counts stay
                // apart from our own holes (each is counted once).
                for m in b.msgs.into_iter().skip(head) {
                    match m {
                        // A guard decision is no KV event: kept like a
                        // request (the metrics count every one).
                        r @ (Msg::Request(_)
                        | Msg::Guard(_)
                        | Msg::GuardOk { .. }
                        | Msg::Open { .. }
                        | Msg::End { .. }) => self.batch.push(r),
                        // A mark must not pass the holes dropped with it; the
                        // next one says as much.
                        Msg::Mark { .. } => {}
                        Msg::Bye(_) => {}
                        Msg::Lost { pool, n } => {
                            let e = self.pending_hook.entry(pool).or_default();
                            *e = e.saturating_add(n);
                        }
                        Msg::Hole { pool, n } => self.hole(pool, n),
                        Msg::Kv { event, seq } => {
                            add(&stats.lost_queue, 1);
                            if seq.is_none() {
                                self.hole(event.pool, 1);
                            }
                        }
                        Msg::KvRuns(evs) => {
                            add(&stats.lost_queue, evs.len() as u64);
                            if let Some(e) = evs.first() {
                                self.hole(e.pool, evs.len() as u64);
                            }
                        }
                        Msg::XferCommit(c) => {
                            add(&stats.lost_queue, 1);
                            self.hole(c.pool, 1);
                        }
                        Msg::XferSend(_) => add(&stats.lost_queue, 1),
                        Msg::XferPull(x) => {
                            add(&stats.lost_queue, 1);
                            self.hole(x.pool, x.runs.len().max(1) as u64);
                        }
                        // As many holes as the copy had runs: the hook's
                        // positions count one per run.
                        Msg::Copy(x) => {
                            add(&stats.lost_queue, 1);
                            self.hole(x.pool, x.runs.len() as u64);
                        }
                    }
                }
            }
        }
    }
}

impl Conn {
    /// Keeps the count of pool positions honest: a line whose events the
    /// hook's position count does not know (its own seq, a pull into a
    /// pool) makes later copies from there holes.
    fn positions(&mut self, m: &mut Msg) {
        match m {
            Msg::Kv { seq: Some(_), .. } => {
                self.unsure = Some("a KV line carried its own seq");
            }
            Msg::XferPull(x) if !self.pulled_into.contains(&x.pool) => {
                self.pulled_into.push(x.pool)
            }
            Msg::Copy(c) => {
                c.unsure = self.unsure.or_else(|| {
                    self.pulled_into
                        .contains(&c.src_pool)
                        .then_some("the connection reported pulls into the source pool")
                });
            }
            _ => {}
        }
    }

    /// Counts `n` dropped events of `pool`, sent as a hole with the next
    /// batch that gets through.
    fn hole(&mut self, pool: u16, n: u64) {
        let e = self.pending_loss.entry(pool).or_default();
        *e = e.saturating_add(n);
    }
}

/// Whether a (malformed) line still carries a usable `seq` (an integer the
/// wire accepts): then the hole shows at that seq and none is added.
fn line_has_seq(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| v.get("seq").and_then(serde_json::Value::as_u64))
        .is_some_and(|s| s <= WIRE_MAX_COUNT)
}
