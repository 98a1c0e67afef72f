//! What both engine models (`sglang`, `vllm`) build on: the simulated
//! clock (time 0 is [`EPOCH_NS`]; a time past [`MAX_CLOCK_NS`] is refused,
//! never wrapped), the pool ids of simulated traces, the per-slot content
//! state of a pool ([`Slots`]), the contiguous runs one KV event each
//! covers ([`slot_runs`]) and what a run reports besides its trace
//! ([`RunStats`]). It imports neither model.

use crate::error::Result;

/// Pool id of the prefill pool in simulated traces.
pub const PREFILL_POOL: u16 = 0;
/// Pool id of the decode pool in simulated traces.
pub const DECODE_POOL: u16 = 1;
/// Pool id of the HiCache host pool (role `cache`; only with `hicache`).
pub const HOST_POOL: u16 = 2;
/// Pool id of the vLLM model's decode CPU tier (`cpu_offload_tokens`).
pub const CPU_POOL: u16 = 2;
/// Pool id of the vLLM model's LMCache store (`lmcache_tokens`).
pub const LMCACHE_POOL: u16 = 3;
/// Simulated time 0 is 2026-09-01T00:00:00Z.
pub const EPOCH_NS: i64 = 1_788_220_800_000_000_000;

/// The latest simulated time (ns since [`EPOCH_NS`]) whose timestamp
/// still fits the trace's i64 nanoseconds (2262-04-11).
pub const MAX_CLOCK_NS: i64 = i64::MAX - EPOCH_NS;

/// `value * unit` nanoseconds, saturating at i64::MAX (never wrapping).
pub(crate) fn span(value: u64, unit: u64) -> i64 {
    i64::try_from(value.saturating_mul(unit)).unwrap_or(i64::MAX)
}

/// `now + value * unit`, saturating (an event past [`MAX_CLOCK_NS`] is
/// refused when the clock reaches it).
pub(crate) fn later(now: i64, value: u64, unit: u64) -> i64 {
    now.saturating_add(span(value, unit))
}

/// Refuses a simulated time whose timestamp would not fit the trace.
pub(crate) fn clock_checked(t: i64, request_id: Option<u64>) -> Result<i64> {
    if (0..=MAX_CLOCK_NS).contains(&t) {
        return Ok(t);
    }
    let who = request_id.map_or(String::new(), |r| format!(" (request {r})"));
    Err(crate::error::Error::invalid(
        crate::error::Location::default().column("timing"),
        format!("the simulated clock left the range a trace timestamp can hold{who}"),
        "lower the timing keys, timeouts and arrival spread so the run ends before 2262-04-11 (docs/simulator.md, \"Timing ranges\")",
    ))
}

/// What the simulator did, besides the trace and the truth.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunStats {
    pub requests: u64,
    pub kv_events: u64,
    /// Requests whose prompt the prefill pool rejected (over-long).
    pub over_long: u64,
    pub sim_end_ns: i64,
}

/// Per-slot content state of one pool (the simulator's bookkeeping).
pub(crate) struct Slots {
    pub(crate) owner: Vec<u64>,
    pub(crate) seed: Vec<u64>,
    pub(crate) pos: Vec<u32>,
    pub(crate) tenant: Vec<u32>,
    pub(crate) wgen: Vec<u32>,
    /// The content was put there after the slot's latest alloc (a write, a
    /// scrub, or a copy of current content); false: it is stale, left over
    /// from an earlier holder.
    pub(crate) current: Vec<bool>,
}

impl Slots {
    pub(crate) fn new(n: usize) -> Slots {
        Slots {
            owner: vec![0; n],
            seed: vec![0; n],
            pos: vec![0; n],
            tenant: vec![0; n],
            wgen: vec![0; n],
            current: vec![true; n],
        }
    }

    /// Copies slot `s` of `from` into slot `d` of `self`: content owner,
    /// model value and current/stale bit; the destination is written.
    pub(crate) fn copy_from(&mut self, d: usize, from: &Slots, s: usize) {
        self.owner[d] = from.owner[s];
        self.seed[d] = from.seed[s];
        self.pos[d] = from.pos[s];
        self.tenant[d] = from.tenant[s];
        self.current[d] = from.current[s];
        self.wgen[d] = self.wgen[d].wrapping_add(1);
    }
}

/// The contiguous runs of `slots` (in position order): each run's offset
/// in `slots` and its extent (first slot, count), one KV event each. The
/// SGLang and vLLM engine models emit through it.
pub(crate) fn slot_runs(slots: &[u32]) -> impl Iterator<Item = (u32, (u32, u32))> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= slots.len() {
            return None;
        }
        let mut j = i + 1;
        while j < slots.len() && slots[j - 1].checked_add(1) == Some(slots[j]) {
            j += 1;
        }
        let run = (i as u32, (slots[i], (j - i) as u32));
        i = j;
        Some(run)
    })
}
