//! The sidecar's wire protocol: one JSON object per line.
//!
//! A connection starts with a `hello` line declaring the pools it speaks
//! for (and, optionally, its block size in each, which must be the
//! deployment's `page_size`). The sidecar answers one line: `{"type":"welcome","connection":N,
//! "pools":[..]}` when the claim holds, or `{"type":"error","error":".."}`
//! and a close when it is refused (unknown pool, a pool held by another
//! live connection, too many connections). After that every line the
//! client sends is one of:
//!
//! - a KV event or a request, exactly the `kvtrail ingest` shape
//!   (docs/jsonl.md), parsed by [`crate::capture::jsonl::parse_line`];
//! - `{"type":"lost","pool":P,"n":N}`: the hook dropped N events of pool P
//!   (queue full, sidecar unreachable); recorded as an explicit seq hole
//!   (N and a KV line's `seq` are at most [`WIRE_MAX_COUNT`], so no single
//!   line can use up a pool's seq space);
//! - `{"type":"xfer_send",...}` / `{"type":"xfer_commit",...}`: the two
//!   halves of a prefill→decode KV transfer, which the writer joins into
//!   `write` events with `src` on the decode pool (docs/capture-sglang.md);
//! - `{"type":"xfer_pull",...}`: a pull-based transfer (vLLM's NIXL READ)
//!   reported whole by the consumer: slot runs of a source pool copied into
//!   its own pool, or runs over the source's block ids (the block form,
//!   expanded with the source pool's page size), stamped by the writer
//!   with the source pool's latest seq (docs/capture-vllm.md); or a failed
//!   / partial load with the engine's failure policy;
//! - `{"type":"copy",...}`: a copy between two pools of one engine (an
//!   offload into its `cache` pool, a load back) or inside one pool (a
//!   copy-on-write block copy), stamped causally by the
//!   hook with the source pool's position on this connection (`src_pos`:
//!   how many of the source pool's events the connection had reported
//!   before it); the writer resolves the position to the source seq
//!   (docs/capture-sglang.md, "Engine copies");
//! - `{"type":"guard",...}`: a decision of the guard in the engine
//!   (docs/guard.md) that was not `ok`: the request, its verdict
//!   (`foreign`, `unknown`), what the guard did (`alert`, `abort`, `allow`)
//!   and the source requests; counted in the metrics and, with live
//!   detection, alerted once per request. Not written to the trace;
//! - `{"type":"guard_ok","n":N}`: N more guard checks answered `ok` on
//!   this connection since its last such line (counted in the metrics);
//! - `{"type":"mark","ts_ns":T}`: every event of this connection's pools
//!   stamped at or before T has been sent (the sidecar holds a pull from
//!   these pools until their connection has marked past the pull's time);
//! - `{"type":"bye","enqueued":E,"sent":S,"dropped":D}`: the last line, the
//!   hook's own counts of events; a connection that ends without it, or
//!   whose counts do not add up (E > S + D), leaves the capture incomplete.
//!
//! KV lines take two fast paths: a byte scanner for the exact canonical line
//! the hook writes (one event, or a line of several runs), then a typed serde struct for the fully-known shape in any
//! key order; anything neither accepts goes to `parse_line`, which decides and
//! names the error. So the fast paths can only make good lines cheaper, never
//! change what is accepted (tests and a property test compare them).

use serde::Deserialize;

use crate::capture::jsonl::{
    JsonlRecord, LineError, MAX_LINE_RUNS, check_kv, check_request_id, parse_line,
};
use crate::schema::{CopySrc, KvEvent, Op, RequestRecord};

/// The first line of every connection.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    #[serde(rename = "type")]
    pub kind: String,
    pub pools: Vec<u16>,
    #[serde(default)]
    pub worker: String,
    /// The engine's block size per claimed pool, when it knows it: each
    /// must equal the deployment's `page_size` for that pool (the sidecar
    /// expands block-form pulls with it), or the hello is refused.
    #[serde(default)]
    pub page_sizes: std::collections::BTreeMap<u16, u32>,
}

/// Parses and checks a hello line (pool existence is checked by the server).
pub fn parse_hello(line: &str) -> Result<Hello, String> {
    let h: Hello = serde_json::from_str(line).map_err(|e| {
        format!(
            "expected a hello line {{\"type\":\"hello\",\"pools\":[..],\"worker\":\"..\"}}: {e}"
        )
    })?;
    if h.kind != "hello" {
        return Err(format!("expected \"type\":\"hello\", got {:?}", h.kind));
    }
    if h.pools.is_empty() {
        return Err("hello declares no pools".into());
    }
    if h.worker.len() > 128 || h.worker.chars().any(char::is_control) {
        return Err("worker name: at most 128 printable characters".into());
    }
    if let Some(p) = h.page_sizes.keys().find(|p| !h.pools.contains(p)) {
        return Err(format!(
            "hello gives a page size for pool {p}, which it does not claim"
        ));
    }
    if let Some((p, _)) = h.page_sizes.iter().find(|e| *e.1 == 0) {
        return Err(format!("hello gives pool {p} page size 0"));
    }
    Ok(h)
}

/// A run of pages: `[first_page, count]`.
pub type PageRun = (u32, u32);

/// Prefill side of a transfer: pages `src_pages` of `pool` are sent into
/// the decode's destination page list starting at index `dst_index`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XferSend {
    #[serde(rename = "type")]
    pub kind: String,
    pub room: u64,
    pub pool: u16,
    pub ts_ns: i64,
    pub dst_index: u32,
    pub src_pages: Vec<PageRun>,
    pub last: bool,
}

/// Decode side of a transfer: the request's destination pages (the list
/// decode sent to prefill), committed when the transfer reported success.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XferCommit {
    #[serde(rename = "type")]
    pub kind: String,
    pub room: u64,
    pub pool: u16,
    pub ts_ns: i64,
    pub request_id: u64,
    /// Token position of the first destination page (decode-side prefix).
    #[serde(default)]
    pub prefix_len: u32,
    pub dst_pages: Vec<PageRun>,
}

/// One copied run of a pull: `[dst_slot, src_slot, count, token_pos]`.
pub type PullRun = (u32, u32, u32, u32);

/// The most runs one `xfer_pull` line may carry.
pub const PULL_MAX_RUNS: usize = 1 << 16;

/// How a pull ended, as the consumer engine saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PullOutcome {
    /// Reported done: every run was copied.
    Ok,
    /// Some blocks failed; `runs` are the ones that loaded.
    Partial,
    /// Nothing usable arrived; `runs` is empty.
    Failed,
}

/// The engine's configured answer to a failed load (vLLM's
/// `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadPolicy {
    Fail,
    Recompute,
}

/// The most source block ids one block-form `xfer_pull` line may carry.
pub const PULL_MAX_SRC_BLOCKS: usize = 1 << 16;

/// Consumer side of a pull-based transfer, reported once the engine knows
/// how the load ended: the runs of `src_pool`'s slots copied into `pool`.
/// The writer stamps the copies with `src_pool`'s latest written seq.
///
/// Two forms. Slot form (no `src_blocks`): each run is `[dst_slot,
/// src_slot, count, token_pos]`. Block form (`src_blocks`, the source's
/// block ids, when the consumer does not know the source's block size):
/// the source is the blocks laid end to end, each expanded with the source
/// pool's `page_size` (token k is slot `src_blocks[k / ps] * ps + k % ps`),
/// and each run is `[dst_slot, src_tok, count, token_pos]` with `src_tok`
/// a token offset into that source. With `tail` = N, the load read the
/// last N tokens of the source (all of it when it is shorter): `src_tok`
/// counts from there, and tokens past the source's end are not loaded.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XferPull {
    #[serde(rename = "type")]
    pub kind: String,
    pub pool: u16,
    pub ts_ns: i64,
    pub request_id: u64,
    pub src_pool: u16,
    #[serde(default)]
    pub runs: Vec<PullRun>,
    #[serde(default)]
    pub src_blocks: Option<Vec<u32>>,
    #[serde(default)]
    pub tail: Option<u32>,
    pub outcome: PullOutcome,
    #[serde(default)]
    pub policy: Option<LoadPolicy>,
}

/// One copy of a pull in slots: `(dst_slot, src_slot, count, token_pos)`,
/// the source slot wide enough for a block id times a page size (one past
/// the u32 slot space is out of range, a hole, never wrapped).
pub type PullCopy = (u64, u64, u64, u64);

impl XferPull {
    /// Estimated bytes the message holds while queued or parked.
    pub fn bytes(&self) -> u64 {
        size_of::<XferPull>() as u64
            + 16 * self.runs.len() as u64
            + 4 * self.src_blocks.as_ref().map_or(0, Vec::len) as u64
    }

    /// The pull's copies in slots, with the source pool's page size
    /// `src_page` (used by the block form only): see [`pull_copies`].
    pub fn copies(&self, src_page: u32) -> Vec<Result<PullCopy, String>> {
        pull_copies(&self.runs, self.src_blocks.as_deref(), self.tail, src_page)
    }
}

/// A pull's copies in slots (the engine hooks' guard mirrors them too):
/// the slot form's runs as they are; the block form's (`src_blocks`, `tail`,
/// see [`XferPull`]) expanded with the source pool's page size `src_page`,
/// each run split at source block boundaries and its pieces contiguous on
/// both sides merged; or the reason a run names no source slots (a hole).
/// Bounded: a block-form line splits into at most one copy per run and per
/// source block, as a load that reads each source token once does; runs
/// past that are refused.
pub fn pull_copies(
    runs: &[PullRun],
    src_blocks: Option<&[u32]>,
    tail: Option<u32>,
    src_page: u32,
) -> Vec<Result<PullCopy, String>> {
    let Some(blocks) = src_blocks else {
        return runs
            .iter()
            .map(|&(d, s, n, tp)| Ok((d as u64, s as u64, n as u64, tp as u64)))
            .collect();
    };
    let ps = src_page.max(1) as u64;
    let total = blocks.len() as u64 * ps;
    let base = tail.map_or(0, |t| total.saturating_sub(t as u64));
    let budget = runs.len() + blocks.len();
    let mut pieces = 0usize;
    let mut out: Vec<Result<PullCopy, String>> = Vec::new();
    for &(d, off, n, tp) in runs {
        let first = out.len();
        let start = base + off as u64;
        let mut end = start + n as u64;
        if tail.is_some() {
            end = end.min(total);
        } else if end > total {
            out.push(Err(format!(
                "run [{d}, {off}, {n}, {tp}] names source tokens {start}..{end}, past its {} blocks of {ps} tokens ({total} tokens)",
                blocks.len()
            )));
            continue;
        }
        let mut k = start;
        while k < end {
            pieces += 1;
            if pieces > budget {
                out.push(Err(format!(
                    "runs split into more than {budget} copies (one per run and per source block): the runs read source blocks more than once"
                )));
                return out;
            }
            let within = k % ps;
            let len = (ps - within).min(end - k);
            let src = blocks[(k / ps) as usize] as u64 * ps + within;
            let (dst, pos) = (d as u64 + (k - start), tp as u64 + (k - start));
            let same_run = out.len() > first;
            match out.last_mut() {
                Some(Ok(last)) if same_run && last.0 + last.2 == dst && last.1 + last.2 == src => {
                    last.2 += len;
                }
                _ => out.push(Ok((dst, src, len, pos))),
            }
            k += len;
        }
    }
    out
}

/// One copied run of an engine copy: `[dst_slot, src_slot, count]`.
pub type CopyRun = (u32, u32, u32);

/// A copy between two pools of one engine (HiCache's offload to host
/// memory and load back) or inside one pool (vLLM's copy-on-write block
/// copies), reported by the engine's hook in the order of its
/// own events. `src_pos` is the source pool's position on this connection:
/// the number of events of `src_pool` the connection had reported before
/// this line (each KV line 1, each `lost` line its n, each `copy` into that
/// pool its number of runs). The writer turns it into the source seq; each
/// run becomes one `write` with `src` on `pool` (one event or one hole per
/// run, so positions stay countable).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineCopy {
    #[serde(rename = "type")]
    pub kind: String,
    pub pool: u16,
    pub ts_ns: i64,
    #[serde(default)]
    pub request_id: u64,
    pub src_pool: u16,
    pub src_pos: u64,
    pub runs: Vec<CopyRun>,
    /// Never on the wire: set by the connection when this connection's
    /// positions cannot be trusted (why); the copy is then a hole.
    #[serde(skip)]
    pub unsure: Option<&'static str>,
}

/// The most source request ids one `guard` line may name.
pub const GUARD_MAX_SOURCES: usize = 256;

/// The guard's answer about a request's read (docs/guard.md); `ok` is
/// never sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuardVerdict {
    /// Some slot holds another request's content, no grant covers it.
    Foreign,
    /// Some slot's owner depends on state the engine process cannot see.
    Unknown,
}

/// What the guard did about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuardAction {
    /// Logged and let run (`KVTRAIL_GUARD=alert`).
    Alert,
    /// Ended with an error before its first token (`KVTRAIL_GUARD=abort`).
    Abort,
    /// Counted and let run (`unknown` under `KVTRAIL_GUARD_UNKNOWN=allow`).
    Allow,
}

impl GuardVerdict {
    pub const ALL: [GuardVerdict; 2] = [GuardVerdict::Foreign, GuardVerdict::Unknown];
    pub fn as_str(self) -> &'static str {
        match self {
            GuardVerdict::Foreign => "foreign",
            GuardVerdict::Unknown => "unknown",
        }
    }
    /// The actions the guard can take on this verdict: `foreign` is
    /// alerted or aborted, never let run silently.
    pub fn actions(self) -> &'static [GuardAction] {
        match self {
            GuardVerdict::Foreign => &[GuardAction::Alert, GuardAction::Abort],
            GuardVerdict::Unknown => &[GuardAction::Alert, GuardAction::Abort, GuardAction::Allow],
        }
    }
}

impl GuardAction {
    pub fn as_str(self) -> &'static str {
        match self {
            GuardAction::Alert => "alert",
            GuardAction::Abort => "abort",
            GuardAction::Allow => "allow",
        }
    }
}

/// One decision of the guard in the engine that was not `ok`: request
/// `request_id`'s read of `slots_read` slots of `pool`, before its first
/// token. `sources`: the requests whose content it found (sorted, no
/// duplicates once parsed).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardDecision {
    #[serde(rename = "type")]
    pub kind: String,
    pub pool: u16,
    pub ts_ns: i64,
    pub request_id: u64,
    pub verdict: GuardVerdict,
    pub action: GuardAction,
    #[serde(default)]
    pub sources: Vec<u64>,
    pub slots_read: u64,
    pub slots_foreign: u64,
    pub slots_unknown: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GuardOk {
    #[serde(rename = "type")]
    _kind: String,
    n: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Lost {
    #[serde(rename = "type")]
    kind: String,
    pool: u16,
    n: u64,
}

/// The largest `seq` of a KV line and `n` of a `lost` line the sidecar
/// takes (2^48: years of events at millions per second). Larger values are
/// rejected, so no single line can use up a pool's seq space (u64) and stop
/// its recording.
pub const WIRE_MAX_COUNT: u64 = 1 << 48;

/// One parsed line after the hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Kv {
        event: KvEvent,
        seq: Option<u64>,
    },
    /// A KV line of several runs (`runs`, docs/jsonl.md): one event per
    /// run, in order, each without a seq. The connection hands them on as
    /// `Kv` messages, one per run.
    KvRuns(Vec<KvEvent>),
    Request(Box<RequestRecord>),
    /// A `lost` line: the hook dropped `n` events of `pool`.
    Lost {
        pool: u16,
        n: u64,
    },
    /// Never on the wire: events of `pool` the sidecar itself dropped (a
    /// full queue, a malformed line); recorded as a hole like `Lost`, but
    /// counted where it was dropped, not as the hook's loss.
    Hole {
        pool: u16,
        n: u64,
    },
    XferSend(Box<XferSend>),
    XferCommit(Box<XferCommit>),
    XferPull(Box<XferPull>),
    /// A `copy` line: an engine copy between two pools of one connection.
    Copy(Box<EngineCopy>),
    /// A `guard` line: a decision of the engine's guard that was not `ok`.
    Guard(Box<GuardDecision>),
    /// A `guard_ok` line: `n` more guard checks answered `ok`.
    GuardOk {
        n: u64,
    },
    /// A `mark` line: every event of the connection's pools stamped at or
    /// before `ts_ns` has been sent.
    Mark {
        ts_ns: i64,
    },
    /// A `bye` line: the connection's last, with the hook's counts.
    Bye(Bye),
    /// Never on the wire: a connection's claim on `pools`, first in its
    /// stream.
    Open {
        pools: Vec<u16>,
    },
    /// Never on the wire: the connection ended; `bye` is its closing line
    /// if one came. `at_stop`: the sidecar's stop ended it (idle, everything
    /// it sent was read): the capture ends there, nothing of it is missing.
    End {
        bye: Option<Bye>,
        at_stop: bool,
    },
}

/// The closing line's counts (events, as the hook queued them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bye {
    /// Events the hook accepted onto its queue.
    pub enqueued: u64,
    /// Events it sent to a sidecar.
    pub sent: u64,
    /// Events it dropped and reported as `lost` (queue full, sidecar
    /// unreachable, not sent by the exit flush's deadline).
    pub dropped: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ByeLine {
    #[serde(rename = "type")]
    _kind: String,
    enqueued: u64,
    sent: u64,
    dropped: u64,
}

impl Bye {
    /// Events the counts leave unaccounted for (queued, neither sent nor
    /// reported lost).
    pub fn unaccounted(&self) -> u64 {
        self.enqueued
            .saturating_sub(self.sent.saturating_add(self.dropped))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Mark {
    #[serde(rename = "type")]
    _kind: String,
    ts_ns: i64,
}

impl Msg {
    /// The pool this message speaks for (forgery checks), if any.
    pub fn pool(&self) -> Option<u16> {
        match self {
            Msg::Kv { event, .. } => Some(event.pool),
            Msg::KvRuns(evs) => evs.first().map(|e| e.pool),
            Msg::Request(_) => None,
            Msg::Lost { pool, .. } | Msg::Hole { pool, .. } => Some(*pool),
            Msg::XferSend(s) => Some(s.pool),
            Msg::XferCommit(c) => Some(c.pool),
            Msg::XferPull(p) => Some(p.pool),
            Msg::Copy(c) => Some(c.pool),
            Msg::Guard(g) => Some(g.pool),
            Msg::GuardOk { .. }
            | Msg::Mark { .. }
            | Msg::Bye(_)
            | Msg::Open { .. }
            | Msg::End { .. } => None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FastKv<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
    pool: u16,
    #[serde(default)]
    seq: Option<u64>,
    ts_ns: i64,
    request_id: u64,
    #[serde(borrow)]
    op: &'a str,
    slot_start: u32,
    slot_count: u32,
    #[serde(default)]
    token_pos: Option<u32>,
    #[serde(default)]
    src_pool: Option<u16>,
    #[serde(default)]
    src_slot_start: Option<u32>,
    #[serde(default)]
    src_seq: Option<u64>,
}

fn fast_kv(line: &str) -> Option<Msg> {
    let f: FastKv = serde_json::from_str(line).ok()?;
    if f.kind != "kv" || f.slot_count == 0 {
        return None;
    }
    let op = Op::parse(f.op)?;
    let src = match (f.src_pool, f.src_slot_start, f.src_seq) {
        (None, None, None) => None,
        (Some(pool), Some(slot_start), Some(seq)) if op == Op::Write => Some(CopySrc {
            pool,
            slot_start,
            seq,
        }),
        _ => return None,
    };
    checked(
        KvEvent {
            pool: f.pool,
            seq: f.seq.unwrap_or(0),
            ts_ns: f.ts_ns,
            request_id: f.request_id,
            op,
            slot_start: f.slot_start,
            slot_count: f.slot_count,
            token_pos: f.token_pos,
            src,
        },
        f.seq,
    )
}

/// A fast path's event, or `None` when it breaks a reader rule (then
/// `parse_line` decides and names it).
fn checked(event: KvEvent, seq: Option<u64>) -> Option<Msg> {
    check_kv(&event).ok()?;
    Some(Msg::Kv { event, seq })
}

/// A cursor over the canonical KV line the hook writes:
/// `{"type":"kv","pool":N,"ts_ns":N,"request_id":N,"op":"OP","slot_start":N,"slot_count":N,"token_pos":N|null}`
/// (keys in this order, no whitespace, no seq/src; `token_pos` may be left
/// out). Anything else: `None`.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scan<'_> {
    fn lit(&mut self, s: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + s.len())? == s {
            self.i += s.len();
            Some(())
        } else {
            None
        }
    }
    /// A JSON integer without sign, leading zeros, fraction or exponent.
    fn uint(&mut self, max: u64) -> Option<u64> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
            self.i += 1;
        }
        let n = self.i - start;
        if n == 0 || (n > 1 && self.b[start] == b'0') || v > max {
            return None;
        }
        match self.b.get(self.i) {
            Some(b'.' | b'e' | b'E') => None,
            _ => Some(v),
        }
    }
    /// The rest of a canonical line of several runs, after its `[`:
    /// `[S,N,T|null],...]}` (1 to `MAX_LINE_RUNS` runs of three values).
    fn runs(mut self, pool: u16, ts_ns: i64, request_id: u64, op: Op) -> Option<Msg> {
        let mut events = Vec::new();
        loop {
            if events.len() == MAX_LINE_RUNS {
                return None;
            }
            self.lit(b"[")?;
            let slot_start = self.uint(u32::MAX as u64)? as u32;
            self.lit(b",")?;
            let slot_count = self.uint(u32::MAX as u64)? as u32;
            self.lit(b",")?;
            let token_pos = if self.lit(b"null").is_some() {
                None
            } else {
                Some(self.uint(u32::MAX as u64)? as u32)
            };
            self.lit(b"]")?;
            if slot_count == 0 {
                return None;
            }
            events.push(KvEvent::unsequenced(
                pool, ts_ns, request_id, op, slot_start, slot_count, token_pos,
            ));
            if self.lit(b",").is_none() {
                break;
            }
        }
        self.lit(b"]}")?;
        if self.i != self.b.len() {
            return None;
        }
        check_kv(events.first()?).ok()?;
        Some(Msg::KvRuns(events))
    }

    fn int(&mut self) -> Option<i64> {
        if self.b.get(self.i) == Some(&b'-') {
            self.i += 1;
            let v = self.uint(i64::MAX as u64 + 1)?;
            if v == 0 {
                return None; // "-0": leave it to the full parser
            }
            Some(
                (v as i128)
                    .checked_neg()
                    .and_then(|x| i64::try_from(x).ok())?,
            )
        } else {
            i64::try_from(self.uint(i64::MAX as u64)?).ok()
        }
    }
}

/// The canonical KV line read straight from its bytes (no UTF-8 check is
/// needed: a line it accepts is ASCII). `None` for any other line, which
/// [`parse_msg`] then reads.
pub fn canonical_kv(b: &[u8]) -> Option<Msg> {
    let mut s = Scan { b, i: 0 };
    s.lit(br#"{"type":"kv","pool":"#)?;
    let pool = s.uint(u16::MAX as u64)? as u16;
    s.lit(br#","ts_ns":"#)?;
    let ts_ns = s.int()?;
    s.lit(br#","request_id":"#)?;
    let request_id = s.uint(u64::MAX)?;
    s.lit(br#","op":""#)?;
    let end = s.i + b.get(s.i..)?.iter().position(|&c| c == b'"')?;
    let op = Op::parse(std::str::from_utf8(&b[s.i..end]).ok()?)?;
    s.i = end + 1;
    if s.lit(br#","runs":["#).is_some() {
        return s.runs(pool, ts_ns, request_id, op);
    }
    s.lit(br#","slot_start":"#)?;
    let slot_start = s.uint(u32::MAX as u64)? as u32;
    s.lit(br#","slot_count":"#)?;
    let slot_count = s.uint(u32::MAX as u64)? as u32;
    // `token_pos` may be left out (it is optional): then the line ends.
    let token_pos = if s.lit(b"}").is_some() {
        None
    } else {
        s.lit(br#","token_pos":"#)?;
        let t = if s.lit(b"null").is_some() {
            None
        } else {
            Some(s.uint(u32::MAX as u64)? as u32)
        };
        s.lit(b"}")?;
        t
    };
    if s.i != b.len() || slot_count == 0 {
        return None;
    }
    checked(
        KvEvent::unsequenced(
            pool, ts_ns, request_id, op, slot_start, slot_count, token_pos,
        ),
        None,
    )
}

/// Appends the canonical KV line (no newline): the exact line the hooks
/// send and [`canonical_kv`] reads. Its one writer in Rust; the engine
/// hooks' native module builds a step's lines with it (the Python client's
/// own writer for its other items is held to the same bytes by a test).
#[allow(clippy::too_many_arguments)]
pub fn write_canonical_kv(
    out: &mut Vec<u8>,
    pool: u16,
    ts_ns: i64,
    request_id: u64,
    op: Op,
    slot_start: u32,
    slot_count: u32,
    token_pos: Option<u32>,
) {
    push_head(out, pool, ts_ns);
    push_one(out, request_id, op, slot_start, slot_count, token_pos);
}

/// Appends the canonical KV line of several runs (no newline):
/// `{"type":"kv","pool":P,"ts_ns":T,"request_id":R,"op":"OP","runs":[[S,N,T|null],...]}`,
/// one event per run, which [`canonical_kv`] reads. At most
/// [`MAX_LINE_RUNS`] runs (the caller splits longer lists).
pub fn write_canonical_kv_runs(
    out: &mut Vec<u8>,
    pool: u16,
    ts_ns: i64,
    request_id: u64,
    op: Op,
    runs: impl IntoIterator<Item = (u32, u32, Option<u32>)>,
) {
    push_head(out, pool, ts_ns);
    push_runs(out, request_id, op, runs);
}

/// The head the canonical KV lines of one pool and stamp share
/// (`{"type":"kv","pool":P,"ts_ns":T,"request_id":`), written once for
/// the many lines of a scheduler step: its lines are byte for byte
/// [`write_canonical_kv`]'s and [`write_canonical_kv_runs`]'s.
pub struct KvLineHead {
    pool: u16,
    ts_ns: i64,
    bytes: Vec<u8>,
}

impl KvLineHead {
    pub fn new(pool: u16, ts_ns: i64) -> Self {
        let mut bytes = Vec::with_capacity(64);
        push_head(&mut bytes, pool, ts_ns);
        KvLineHead { pool, ts_ns, bytes }
    }

    /// Whether this is the head of `pool`'s lines stamped `ts_ns`.
    pub fn is(&self, pool: u16, ts_ns: i64) -> bool {
        self.pool == pool && self.ts_ns == ts_ns
    }

    /// [`write_canonical_kv`] of this pool and stamp.
    pub fn kv(
        &self,
        out: &mut Vec<u8>,
        request_id: u64,
        op: Op,
        slot_start: u32,
        slot_count: u32,
        token_pos: Option<u32>,
    ) {
        out.extend_from_slice(&self.bytes);
        push_one(out, request_id, op, slot_start, slot_count, token_pos);
    }

    /// [`write_canonical_kv_runs`] of this pool and stamp.
    pub fn kv_runs(
        &self,
        out: &mut Vec<u8>,
        request_id: u64,
        op: Op,
        runs: impl IntoIterator<Item = (u32, u32, Option<u32>)>,
    ) {
        out.extend_from_slice(&self.bytes);
        push_runs(out, request_id, op, runs);
    }
}

fn push_head(out: &mut Vec<u8>, pool: u16, ts_ns: i64) {
    out.extend_from_slice(br#"{"type":"kv","pool":"#);
    push_uint(out, u64::from(pool));
    out.extend_from_slice(br#","ts_ns":"#);
    if ts_ns < 0 {
        out.push(b'-');
    }
    push_uint(out, ts_ns.unsigned_abs());
    out.extend_from_slice(br#","request_id":"#);
}

fn push_one(
    out: &mut Vec<u8>,
    request_id: u64,
    op: Op,
    slot_start: u32,
    slot_count: u32,
    token_pos: Option<u32>,
) {
    push_uint(out, request_id);
    out.extend_from_slice(br#","op":""#);
    out.extend_from_slice(op.as_str().as_bytes());
    out.extend_from_slice(br#"","slot_start":"#);
    push_uint(out, u64::from(slot_start));
    out.extend_from_slice(br#","slot_count":"#);
    push_uint(out, u64::from(slot_count));
    out.extend_from_slice(br#","token_pos":"#);
    match token_pos {
        Some(t) => push_uint(out, u64::from(t)),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
}

fn push_runs(
    out: &mut Vec<u8>,
    request_id: u64,
    op: Op,
    runs: impl IntoIterator<Item = (u32, u32, Option<u32>)>,
) {
    push_uint(out, request_id);
    out.extend_from_slice(br#","op":""#);
    out.extend_from_slice(op.as_str().as_bytes());
    out.extend_from_slice(br#"","runs":["#);
    for (i, (start, count, token_pos)) in runs.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'[');
        push_uint(out, u64::from(start));
        out.push(b',');
        push_uint(out, u64::from(count));
        out.push(b',');
        match token_pos {
            Some(t) => push_uint(out, u64::from(t)),
            None => out.extend_from_slice(b"null"),
        }
        out.push(b']');
    }
    out.extend_from_slice(b"]}");
}

/// Appends the `lost` line (no newline): `n` events of `pool` the hook
/// could not report, a hole. Its one writer in Rust (the Python client's
/// own is held to the same bytes by a test).
pub fn write_lost(out: &mut Vec<u8>, pool: u16, n: u64) {
    out.extend_from_slice(br#"{"type":"lost","pool":"#);
    push_uint(out, u64::from(pool));
    out.extend_from_slice(br#","n":"#);
    push_uint(out, n);
    out.push(b'}');
}

/// Appends `v` in decimal (two digits a step: a step's lines are written
/// on the engine's scheduler thread).
fn push_uint(out: &mut Vec<u8>, mut v: u64) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    while v >= 100 {
        let p = (v % 100) as usize * 2;
        v /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    }
    if v >= 10 {
        let p = v as usize * 2;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + v as u8;
    }
    out.extend_from_slice(&buf[i..]);
}

fn plain(message: String) -> LineError {
    LineError {
        field: None,
        message,
        pool: None,
    }
}

/// Parses one line after the hello.
pub fn parse_msg(line: &str) -> Result<Msg, LineError> {
    let m = parse_any(line)?;
    if let Msg::Kv {
        event,
        seq: Some(seq),
    } = &m
        && *seq > WIRE_MAX_COUNT
    {
        return Err(LineError {
            field: Some("seq".into()),
            message: format!(
                "{seq} is above {WIRE_MAX_COUNT} (2^48), the largest seq the sidecar takes"
            ),
            pool: Some(event.pool),
        });
    }
    Ok(m)
}

fn parse_any(line: &str) -> Result<Msg, LineError> {
    if let Some(m) = canonical_kv(line.as_bytes()).or_else(|| fast_kv(line)) {
        return Ok(m);
    }
    // Protocol messages are told apart by their "type" prefix, cheaply;
    // a line whose "type" is not its first key is read whole for it (key
    // order is the client's JSON library's business).
    let owned;
    let kind = match sniff_type(line) {
        Some(k) => Some(k),
        None => {
            owned = type_key(line);
            owned.as_deref()
        }
    };
    match kind {
        Some("lost") => {
            let l: Lost = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `lost` message: {e}")))?;
            if l.n == 0 {
                return Err(plain("`lost` with n = 0".into()));
            }
            if l.n > WIRE_MAX_COUNT {
                return Err(plain(format!(
                    "`lost` with n = {} above {WIRE_MAX_COUNT} (2^48), the most one line may report",
                    l.n
                )));
            }
            Ok(Msg::Lost {
                pool: l.pool,
                n: l.n,
            })
        }
        Some("xfer_send") => {
            let s: XferSend = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `xfer_send` message: {e}")))?;
            check_runs(&s.src_pages, "src_pages")?;
            Ok(Msg::XferSend(Box::new(s)))
        }
        Some("xfer_commit") => {
            let c: XferCommit = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `xfer_commit` message: {e}")))?;
            check_runs(&c.dst_pages, "dst_pages")?;
            if c.request_id == 0 {
                return Err(plain("xfer_commit with request_id 0".into()));
            }
            check_request_id(c.request_id)?;
            Ok(Msg::XferCommit(Box::new(c)))
        }
        Some("xfer_pull") => {
            let p: XferPull = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `xfer_pull` message: {e}")))?;
            check_pull(&p)?;
            Ok(Msg::XferPull(Box::new(p)))
        }
        Some("copy") => {
            let c: EngineCopy = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `copy` message: {e}")))?;
            check_copy(&c)?;
            Ok(Msg::Copy(Box::new(c)))
        }
        Some("guard") => {
            let mut g: GuardDecision = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `guard` message: {e}")))?;
            check_guard(&mut g)?;
            Ok(Msg::Guard(Box::new(g)))
        }
        Some("guard_ok") => {
            let l: GuardOk = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `guard_ok` message: {e}")))?;
            if l.n == 0 || l.n > WIRE_MAX_COUNT {
                return Err(plain(format!(
                    "`guard_ok` with n = {} (1 to {WIRE_MAX_COUNT}, 2^48)",
                    l.n
                )));
            }
            Ok(Msg::GuardOk { n: l.n })
        }
        Some("mark") => {
            let m: Mark = serde_json::from_str(line)
                .map_err(|e| plain(format!("bad `mark` message: {e}")))?;
            Ok(Msg::Mark { ts_ns: m.ts_ns })
        }
        Some("bye") => {
            let b: ByeLine =
                serde_json::from_str(line).map_err(|e| plain(format!("bad `bye` message: {e}")))?;
            Ok(Msg::Bye(Bye {
                enqueued: b.enqueued,
                sent: b.sent,
                dropped: b.dropped,
            }))
        }
        Some("hello") => Err(plain("a second hello on one connection".into())),
        _ => match parse_line(line)? {
            JsonlRecord::Kv { event, seq } => Ok(Msg::Kv { event, seq }),
            JsonlRecord::KvRuns(evs) => Ok(Msg::KvRuns(evs)),
            JsonlRecord::Request(r) => Ok(Msg::Request(Box::new(r))),
        },
    }
}

fn check_runs(runs: &[PageRun], what: &str) -> Result<(), LineError> {
    if runs.is_empty() || runs.iter().any(|r| r.1 == 0) {
        return Err(plain(format!(
            "{what}: needs at least one [first_page, count] run with count >= 1"
        )));
    }
    Ok(())
}

fn check_pull(p: &XferPull) -> Result<(), LineError> {
    if p.request_id == 0 {
        return Err(plain("xfer_pull with request_id 0".into()));
    }
    check_request_id(p.request_id)?;
    if p.src_pool == p.pool {
        return Err(plain(format!(
            "xfer_pull from pool {} into itself (src_pool must be another pool)",
            p.pool
        )));
    }
    if p.runs.len() > PULL_MAX_RUNS {
        return Err(plain(format!(
            "xfer_pull with {} runs, more than {PULL_MAX_RUNS}",
            p.runs.len()
        )));
    }
    if p.runs.iter().any(|r| r.2 == 0) {
        return Err(plain(
            "xfer_pull runs: each [dst_slot, src_slot, count, token_pos] needs count >= 1".into(),
        ));
    }
    match (&p.src_blocks, p.tail) {
        (None, Some(_)) => {
            return Err(plain(
                "xfer_pull with tail and no src_blocks (tail is of the block form)".into(),
            ));
        }
        (Some(b), _) if b.len() > PULL_MAX_SRC_BLOCKS => {
            return Err(plain(format!(
                "xfer_pull with {} src_blocks, more than {PULL_MAX_SRC_BLOCKS}",
                b.len()
            )));
        }
        (Some(b), _) if b.is_empty() && !p.runs.is_empty() => {
            return Err(plain(
                "xfer_pull with runs over an empty src_blocks (no source to read)".into(),
            ));
        }
        (Some(_), Some(0)) => {
            return Err(plain("xfer_pull with tail 0 (a load of no tokens)".into()));
        }
        (Some(_), Some(t)) => {
            if let Some(r) = p.runs.iter().find(|r| r.1 as u64 + r.2 as u64 > t as u64) {
                return Err(plain(format!(
                    "xfer_pull run [{}, {}, {}, {}] reads past the load's tail of {t} tokens",
                    r.0, r.1, r.2, r.3
                )));
            }
        }
        _ => {}
    }
    match (p.outcome, p.runs.is_empty()) {
        (PullOutcome::Ok, true) => Err(plain("xfer_pull outcome ok with no runs".into())),
        (PullOutcome::Failed, false) => Err(plain(
            "xfer_pull outcome failed with runs (a failed load copies nothing)".into(),
        )),
        _ => Ok(()),
    }
}

fn check_copy(c: &EngineCopy) -> Result<(), LineError> {
    if c.request_id != 0 {
        check_request_id(c.request_id)?;
    }
    if c.src_pool == c.pool
        && c.runs.iter().any(|&(d, s, n)| {
            let (d, s, n) = (d as u64, s as u64, n as u64);
            d < s + n && s < d + n
        })
    {
        // A copy inside one pool (a copy-on-write block copy) reads
        // another extent of it.
        return Err(plain(format!(
            "copy inside pool {} with a run whose source and destination overlap",
            c.pool
        )));
    }
    if c.src_pos > WIRE_MAX_COUNT {
        return Err(plain(format!(
            "copy with src_pos {} above {WIRE_MAX_COUNT} (2^48)",
            c.src_pos
        )));
    }
    if c.runs.is_empty() || c.runs.len() > PULL_MAX_RUNS {
        return Err(plain(format!(
            "copy with {} runs (1 to {PULL_MAX_RUNS})",
            c.runs.len()
        )));
    }
    if c.runs.iter().any(|r| r.2 == 0) {
        return Err(plain(
            "copy runs: each [dst_slot, src_slot, count] needs count >= 1".into(),
        ));
    }
    Ok(())
}

fn check_guard(g: &mut GuardDecision) -> Result<(), LineError> {
    if g.request_id == 0 {
        return Err(plain("guard with request_id 0 (the engine's own)".into()));
    }
    check_request_id(g.request_id)?;
    if !g.verdict.actions().contains(&g.action) {
        return Err(plain(format!(
            "guard verdict {} with action {} (a foreign read is alerted or aborted)",
            g.verdict.as_str(),
            g.action.as_str()
        )));
    }
    if g.sources.len() > GUARD_MAX_SOURCES {
        return Err(plain(format!(
            "guard with {} sources, more than {GUARD_MAX_SOURCES}",
            g.sources.len()
        )));
    }
    for &s in &g.sources {
        check_request_id(s)?;
    }
    if g.verdict == GuardVerdict::Foreign && g.sources.is_empty() {
        return Err(plain(
            "guard verdict foreign names no source request".into(),
        ));
    }
    if g.slots_read > WIRE_MAX_COUNT
        || g.slots_foreign.saturating_add(g.slots_unknown) > g.slots_read
    {
        return Err(plain(format!(
            "guard slots: foreign {} + unknown {} must be at most read {} (at most 2^48)",
            g.slots_foreign, g.slots_unknown, g.slots_read
        )));
    }
    g.sources.sort_unstable();
    g.sources.dedup();
    Ok(())
}

/// The value of a top-level `"type"` key anywhere in the object (`None`
/// when the line is no such object: the full parser names the error).
fn type_key(line: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct TypeOnly {
        #[serde(rename = "type")]
        kind: Option<String>,
    }
    serde_json::from_str::<TypeOnly>(line).ok()?.kind
}

/// The value of a top-level `"type"` key when it is the first key (the
/// hook always writes it first); `None` sends the line to the full parser.
fn sniff_type(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix('{')?.trim_start();
    let rest = rest.strip_prefix("\"type\"")?.trim_start();
    let rest = rest.strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('"')?;
    let end = rest.find('"')?;
    Some(&rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg_of(r: JsonlRecord) -> Msg {
        match r {
            JsonlRecord::Kv { event, seq } => Msg::Kv { event, seq },
            JsonlRecord::KvRuns(evs) => Msg::KvRuns(evs),
            JsonlRecord::Request(r) => Msg::Request(Box::new(r)),
        }
    }

    /// A line of several runs: the writer's bytes read back by the
    /// canonical scanner and by `parse_line` as the same events, one per
    /// run; other spellings go to `parse_line`, which refuses what breaks
    /// the form and names the run.
    #[test]
    fn runs_lines_round_trip_and_agree() {
        let runs = [
            (16u32, 16u32, Some(0u32)),
            (48, 16, Some(16)),
            (4_294_967_295, 1, None),
        ];
        let mut b = Vec::new();
        write_canonical_kv_runs(&mut b, 3, -5, 77, Op::Read, runs);
        let text = std::str::from_utf8(&b).unwrap();
        assert_eq!(
            text,
            r#"{"type":"kv","pool":3,"ts_ns":-5,"request_id":77,"op":"read","runs":[[16,16,0],[48,16,16],[4294967295,1,null]]}"#
        );
        let Some(Msg::KvRuns(evs)) = canonical_kv(&b) else {
            panic!("not canonical: {text}");
        };
        assert_eq!(evs.len(), 3);
        for (e, r) in evs.iter().zip(runs) {
            assert_eq!((e.pool, e.ts_ns, e.request_id, e.op), (3, -5, 77, Op::Read));
            assert_eq!((e.slot_start, e.slot_count, e.token_pos), r);
            assert_eq!((e.seq, e.src), (0, None));
        }
        assert_eq!(parse_line(text).map(msg_of), Ok(Msg::KvRuns(evs.clone())));
        assert_eq!(parse_msg(text), Ok(Msg::KvRuns(evs)));
        // Other spellings parse_line reads: two-value runs, spaces, keys in
        // another order.
        let other = r#"{ "op":"write", "type":"kv","pool":1,"request_id":2,"ts_ns":9,"runs":[[0,4],[8, 2, null],[20,1,7]]}"#;
        assert!(canonical_kv(other.as_bytes()).is_none());
        let Ok(Msg::KvRuns(evs)) = parse_msg(other) else {
            panic!("{other}");
        };
        let got: Vec<_> = evs
            .iter()
            .map(|e| (e.slot_start, e.slot_count, e.token_pos))
            .collect();
        assert_eq!(got, [(0, 4, None), (8, 2, None), (20, 1, Some(7))]);
        // Refused, naming the field: a run of count 0, a bad run, seq or a
        // copy beside runs, no runs, a reserved request id.
        let head = r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read""#;
        for (tail, field) in [
            (r#","runs":[[0,1,0],[5,0,1]]}"#, "runs[1]"),
            (r#","runs":[[0,1,0],[5]]}"#, "runs[1]"),
            (r#","runs":[[0,1,0],[5,1,2,3]]}"#, "runs[1]"),
            (r#","runs":[[0,1,0],[-1,1,0]]}"#, "runs[1]"),
            (r#","runs":[[0,1,0],[0,1,4294967296]]}"#, "runs[1]"),
            (r#","runs":[]}"#, "runs"),
            (r#","runs":{"a":1}}"#, "runs"),
            (r#","seq":4,"runs":[[0,1,0]]}"#, "seq"),
            (r#","slot_start":0,"runs":[[0,1,0]]}"#, "slot_start"),
            (r#","src_pool":1,"runs":[[0,1,0]]}"#, "src_pool"),
        ] {
            let line = format!("{head}{tail}");
            assert!(canonical_kv(line.as_bytes()).is_none(), "{line}");
            let e = parse_msg(&line).expect_err(&line);
            assert_eq!(e.field.as_deref(), Some(field), "{line}: {e}");
            assert_eq!(e.pool, Some(0), "{line}");
        }
        let reserved = r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":18446744073709551615,"op":"read","runs":[[0,1,0],[4,1,1]]}"#;
        assert!(canonical_kv(reserved.as_bytes()).is_none());
        assert!(parse_msg(reserved).is_err());
        // The bound on runs a line carries, on both paths.
        let mut big = Vec::new();
        let many = (0..=MAX_LINE_RUNS as u32).map(|i| (i, 1, None));
        write_canonical_kv_runs(&mut big, 0, 1, 2, Op::Read, many);
        assert!(canonical_kv(&big).is_none());
        let e = parse_msg(std::str::from_utf8(&big).unwrap()).expect_err("too many runs");
        assert_eq!(e.field.as_deref(), Some("runs"));
    }

    /// What the writer writes, the canonical scanner reads back as the same
    /// event, and `parse_line` agrees.
    #[test]
    fn canonical_writer_round_trips() {
        let cases = [
            (0u16, 0i64, 1u64, Op::Write, 0u32, 1u32, Some(0u32)),
            (
                u16::MAX,
                -7,
                u64::MAX >> 1,
                Op::Read,
                4_294_967_295,
                1,
                None,
            ),
            (3, i64::MAX, 42, Op::Share, 16, 4096, Some(u32::MAX)),
            (9, 1_700_000_000_000_000_000, 5, Op::Alloc, 10, 20, None),
            (10, 99, 100, Op::Free, 9, 101, Some(1009)),
        ];
        for (pool, ts, rid, op, start, count, tp) in cases {
            let mut b = Vec::new();
            write_canonical_kv(&mut b, pool, ts, rid, op, start, count, tp);
            let Some(Msg::Kv { event, seq: None }) = canonical_kv(&b) else {
                panic!("not canonical: {}", String::from_utf8_lossy(&b));
            };
            assert_eq!(
                (event.pool, event.ts_ns, event.request_id, event.op),
                (pool, ts, rid, op)
            );
            assert_eq!((event.slot_start, event.slot_count), (start, count));
            assert_eq!(event.token_pos, tp);
            let text = std::str::from_utf8(&b).unwrap();
            assert!(matches!(parse_msg(text), Ok(Msg::Kv { event: e, .. }) if e == event));
        }
        let mut b = Vec::new();
        write_lost(&mut b, 7, 3);
        assert!(matches!(
            parse_msg(std::str::from_utf8(&b).unwrap()),
            Ok(Msg::Lost { pool: 7, n: 3 })
        ));
    }

    #[test]
    fn decimal_writer_matches_format() {
        let mut v: Vec<u64> = (0..20_000).collect();
        v.extend((0..64).map(|k| 1u64 << k));
        v.extend((1..20).map(|k| 10u64.pow(k) - 1));
        v.push(u64::MAX);
        for x in v {
            let mut b = Vec::new();
            push_uint(&mut b, x);
            assert_eq!(b, x.to_string().into_bytes());
        }
    }

    /// The fast path must agree with `parse_line` on every line it accepts.
    #[test]
    fn fast_path_agrees_with_reference() {
        let lines = [
            r#"{"type":"kv","pool":1,"seq":17,"ts_ns":5,"request_id":3,"op":"write","slot_start":8,"slot_count":4,"token_pos":null,"src_pool":0,"src_slot_start":2,"src_seq":9}"#,
            r#"{"type":"kv","pool":0,"ts_ns":-1,"request_id":0,"op":"scrub","slot_start":0,"slot_count":1}"#,
            r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":3,"token_pos":5}"#,
            r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":3,"token_pos":5,"x_layer":1}"#,
            r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":0}"#,
            r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1,"src_pool":1,"src_slot_start":0,"src_seq":0}"#,
            r#"{"type":"kv","pool":70000,"ts_ns":1,"request_id":2,"op":"read","slot_start":0,"slot_count":1}"#,
        ];
        let canonical = [
            r#"{"type":"kv","pool":3,"ts_ns":1700000000000001000,"request_id":17,"op":"write","slot_start":123456,"slot_count":7,"token_pos":99}"#,
            r#"{"type":"kv","pool":0,"ts_ns":-5,"request_id":0,"op":"free","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":65535,"ts_ns":9223372036854775807,"request_id":18446744073709551615,"op":"share","slot_start":4294967295,"slot_count":4294967295,"token_pos":4294967295}"#,
            r#"{"type":"kv","pool":65536,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":01,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":-0,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":1.5,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":1,"request_id":1,"op":"rea","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":0,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null} "#,
            r#"{"type":"kv","pool":1,"ts_ns":-9223372036854775808,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":1,"ts_ns":-9223372036854775809,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"token_pos":null}"#,
            r#"{"type":"kv","pool":2,"ts_ns":7,"request_id":5,"op":"alloc","slot_start":64,"slot_count":64}"#,
            r#"{"type":"kv","pool":2,"ts_ns":7,"request_id":5,"op":"alloc","slot_start":64,"slot_count":64,}"#,
            r#"{"type":"kv","pool":2,"ts_ns":7,"request_id":5,"op":"alloc","slot_start":64,"slot_count":64}}"#,
        ];
        for line in canonical {
            let reference = parse_line(line).map(msg_of);
            if let Some(fast) = canonical_kv(line.as_bytes()) {
                assert_eq!(Ok(fast), reference, "{line}");
            }
            assert_eq!(parse_msg(line), reference, "{line}");
        }
        // The hook's exact shape takes the canonical path.
        assert!(canonical_kv(canonical[0].as_bytes()).is_some());
        assert!(canonical_kv(canonical[1].as_bytes()).is_some());
        // So does a line without the optional token_pos.
        assert!(canonical_kv(canonical[12].as_bytes()).is_some());
        assert!(canonical_kv(canonical[13].as_bytes()).is_none());
        assert!(canonical_kv(canonical[14].as_bytes()).is_none());
        for line in lines {
            let reference = parse_line(line).map(msg_of);
            if let Some(fast) = fast_kv(line) {
                assert_eq!(Ok(fast), reference, "{line}");
            }
            assert_eq!(parse_msg(line), reference, "{line}");
        }
    }

    proptest::proptest! {
        /// Whatever the canonical scanner accepts, parse_line accepts too,
        /// with the same event; also for lines with one byte changed.
        #[test]
        fn canonical_scanner_never_disagrees(
            pool in 0u32..70_000, ts in proptest::num::i64::ANY, rid in proptest::num::u64::ANY,
            op in 0usize..7, start in proptest::num::u32::ANY, count in 0u32..3,
            tp in proptest::option::of(proptest::num::u32::ANY),
            at in 0usize..200, byte in 32u8..127,
        ) {
            let ops = ["alloc", "write", "read", "free", "share", "scrub", "bogus"];
            // Absent, null or a number.
            let tp = match (tp, at % 3) {
                (_, 0) => String::new(),
                (None, _) => r#","token_pos":null"#.to_string(),
                (Some(t), _) => format!(r#","token_pos":{t}"#),
            };
            let line = format!(
                r#"{{"type":"kv","pool":{pool},"ts_ns":{ts},"request_id":{rid},"op":"{}","slot_start":{start},"slot_count":{count}{tp}}}"#,
                ops[op]
            );
            let mut mutated = line.clone().into_bytes();
            let k = at % mutated.len();
            mutated[k] = byte;
            for l in [line.clone(), String::from_utf8(mutated).unwrap()] {
                if let Some(fast) = canonical_kv(l.as_bytes()) {
                    let reference = parse_line(&l).map(msg_of);
                    proptest::prop_assert_eq!(Ok(fast), reference, "{}", l);
                }
            }
        }
    }

    proptest::proptest! {
        /// Lines of several runs, and with one byte changed: whatever the
        /// canonical scanner accepts, parse_line reads as the same events.
        #[test]
        fn canonical_runs_scanner_never_disagrees(
            runs in proptest::collection::vec(
                (proptest::num::u32::ANY, 0u32..3, proptest::option::of(proptest::num::u32::ANY)),
                1..6,
            ),
            rid in proptest::num::u64::ANY, at in 0usize..400, byte in 32u8..127,
        ) {
            let mut b = Vec::new();
            write_canonical_kv_runs(&mut b, 4, 11, rid, Op::Read, runs.iter().copied());
            let mut mutated = b.clone();
            let k = at % mutated.len();
            mutated[k] = byte;
            for l in [b, mutated] {
                let l = String::from_utf8(l).unwrap();
                if let Some(fast) = canonical_kv(l.as_bytes()) {
                    proptest::prop_assert_eq!(Ok(fast), parse_line(&l).map(msg_of), "{}", l);
                }
            }
        }
    }

    #[test]
    fn wire_refuses_reserved_request_ids_on_every_path() {
        for rid in [u64::MAX, u64::MAX - 1] {
            let lines = [
                // The canonical line (byte scanner).
                format!(
                    r#"{{"type":"kv","pool":0,"ts_ns":1,"request_id":{rid},"op":"read","slot_start":0,"slot_count":1,"token_pos":null}}"#
                ),
                // Key order changed (typed fast path).
                format!(
                    r#"{{"type":"kv","request_id":{rid},"pool":0,"ts_ns":1,"op":"read","slot_start":0,"slot_count":1}}"#
                ),
                format!(
                    r#"{{"type":"request","request_id":{rid},"tenant":"t","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#
                ),
                format!(
                    r#"{{"type":"xfer_commit","room":1,"pool":1,"ts_ns":1,"request_id":{rid},"dst_pages":[[0,1]]}}"#
                ),
            ];
            for l in &lines {
                let e = parse_msg(l).expect_err(l).to_string();
                assert!(e.contains("reserves"), "{l}: {e}");
            }
        }
        let src = r#"{"type":"kv","pool":1,"ts_ns":1,"request_id":1,"op":"write","slot_start":0,"slot_count":1,"src_pool":0,"src_slot_start":0,"src_seq":18446744073709551615}"#;
        let e = parse_msg(src).expect_err(src).to_string();
        assert!(e.contains("src_seq") && e.contains("reserved"), "{e}");
    }

    #[test]
    fn protocol_messages() {
        let cases: [(&str, &str); 11] = [
            (
                r#"{"type":"lost","pool":2,"n":281474976710656}"#,
                "Ok(Lost { pool: 2, n: 281474976710656 })",
            ),
            (
                r#"{"type":"lost","pool":2,"n":281474976710657}"#,
                "Err(`lost` with n = 281474976710657 above 281474976710656 (2^48), the most one line may report)",
            ),
            (
                r#"{"type":"kv","pool":2,"seq":18446744073709551614,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1}"#,
                "Err(field `seq`: 18446744073709551614 is above 281474976710656 (2^48), the largest seq the sidecar takes)",
            ),
            (
                r#"{"type":"lost","pool":2,"n":5}"#,
                "Ok(Lost { pool: 2, n: 5 })",
            ),
            (
                r#"{"type":"lost","pool":2,"n":0}"#,
                "Err(`lost` with n = 0)",
            ),
            (
                r#"{"type":"xfer_send","room":7,"pool":0,"ts_ns":1,"dst_index":0,"src_pages":[[3,1]],"last":true}"#,
                "Ok(send room=7 [(3, 1)] last=true)",
            ),
            (
                r#"{"type":"xfer_send","room":7,"pool":0,"ts_ns":1,"dst_index":0,"src_pages":[],"last":true}"#,
                "Err(src_pages: needs at least one [first_page, count] run with count >= 1)",
            ),
            (
                r#"{"type":"xfer_commit","room":7,"pool":1,"ts_ns":1,"request_id":9,"dst_pages":[[1,4]]}"#,
                "Ok(commit room=7 rid=9 [(1, 4)])",
            ),
            (
                r#"{"type":"hello","pools":[0]}"#,
                "Err(a second hello on one connection)",
            ),
            (
                r#"{"type":"lost","pool":2,"n":5,"extra":1}"#,
                "Err(bad `lost` message: unknown field `extra`, expected one of `type`, `pool`, `n` at line 1 column 37)",
            ),
            (
                "not json",
                "Err(not valid JSON: expected ident at line 1 column 2)",
            ),
        ];
        for (line, expect) in cases {
            let got = match parse_msg(line) {
                Ok(Msg::Lost { pool, n }) => format!("Ok(Lost {{ pool: {pool}, n: {n} }})"),
                Ok(Msg::XferSend(s)) => {
                    format!("Ok(send room={} {:?} last={})", s.room, s.src_pages, s.last)
                }
                Ok(Msg::XferCommit(c)) => {
                    format!(
                        "Ok(commit room={} rid={} {:?})",
                        c.room, c.request_id, c.dst_pages
                    )
                }
                Ok(other) => format!("Ok({other:?})"),
                Err(e) => format!("Err({e})"),
            };
            assert_eq!(got, expect, "{line}");
        }
    }

    #[test]
    fn hello_lines() {
        assert_eq!(
            parse_hello(r#"{"type":"hello","pools":[0,1],"worker":"prefill-0"}"#),
            Ok(Hello {
                kind: "hello".into(),
                pools: vec![0, 1],
                worker: "prefill-0".into(),
                page_sizes: Default::default(),
            })
        );
        let h = parse_hello(r#"{"type":"hello","pools":[0,1],"page_sizes":{"1":64}}"#).unwrap();
        assert_eq!(h.page_sizes, [(1, 64)].into_iter().collect());
        assert_eq!(
            parse_hello(r#"{"type":"hello","pools":[0],"page_sizes":{"1":64}}"#),
            Err("hello gives a page size for pool 1, which it does not claim".into())
        );
        assert_eq!(
            parse_hello(r#"{"type":"hello","pools":[0],"page_sizes":{"0":0}}"#),
            Err("hello gives pool 0 page size 0".into())
        );
        assert!(parse_hello(r#"{"type":"hello","pools":[0],"page_sizes":{"x":1}}"#).is_err());
        assert_eq!(
            parse_hello(r#"{"type":"hello","pools":[]}"#),
            Err("hello declares no pools".into())
        );
        assert!(parse_hello(r#"{"type":"kv","pools":[1]}"#).is_err());
    }
}
