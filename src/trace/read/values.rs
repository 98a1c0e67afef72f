//! The contract's limits on ids and seqs, shared with the JSONL line
//! parser.

use crate::error::{Error, Location, Result};

/// The highest request id this version replays: the two ids above it are
/// the replay's per-slot markers for never-written and scrubbed content
/// (`lineage::state::NEVER`, `SCRUBBED`), so a trace using them would be
/// misread. They are refused, never silently misclassified.
pub const MAX_REQUEST_ID: u64 = u64::MAX - 2;

/// The reader's request-id rule (shared with the JSONL line parser, so a
/// capture never writes a row the readers refuse).
pub fn check_request_id(loc: impl FnOnce() -> Location, id: u64) -> Result<()> {
    if id > MAX_REQUEST_ID {
        return Err(reserved_id(loc(), id));
    }
    Ok(())
}

pub(crate) fn reserved_id(loc: Location, id: u64) -> Error {
    Error::invalid(
        loc,
        format!("request_id {id} is one of the two highest UInt64 values, which kvtrail reserves"),
        "map request ids to values below 18446744073709551614 (e.g. number them from 1) and keep the original id in external_id",
    )
}

/// The largest seq (and `src_seq`) this version reads. seq is the 0-based
/// position of an event in its pool's stream, so 2^64-1 would be a pool's
/// 2^64th event, which no capture reaches; replay keeps "seq + 1" per slot
/// and uses 2^64-1 as the end of a stream. A src_seq can only be legal if
/// its source pool has an event with that seq. Both are refused, never
/// misread.
pub const MAX_SEQ: u64 = u64::MAX - 1;

pub fn check_seq(loc: impl FnOnce() -> Location, seq: u64) -> Result<()> {
    if seq > MAX_SEQ {
        let loc = loc();
        let col = loc.column.clone().unwrap_or_default();
        return Err(Error::invalid(
            loc,
            format!("{col} {seq} (2^64-1) is reserved: no pool reaches its 2^64th event"),
            "seqs number a pool's events from 0; write the event's position in its pool's stream",
        ));
    }
    Ok(())
}

/// The rule of a copy inside one pool (`src_pool` equal to `pool`, a
/// copy-on-write block copy): it reads the pool as it was just after an
/// EARLIER event (`src_seq` < `seq`), and its source and destination
/// extents do not overlap (the destination is another block). A copy
/// between two pools is unaffected. `seq` None (the Recorder, before it
/// numbers the event) checks the extents only; `slots` None (the light
/// planning pass, which reads no slot columns) checks the seqs only.
/// Returns the column at fault and what is wrong.
pub fn check_same_pool_copy(
    pool: u16,
    seq: Option<u64>,
    slots: Option<(u32, u32)>,
    src: crate::schema::CopySrc,
) -> std::result::Result<(), (&'static str, String)> {
    if src.pool != pool {
        return Ok(());
    }
    if let Some(seq) = seq
        && src.seq >= seq
    {
        return Err((
            crate::schema::kv_col::SRC_SEQ,
            format!(
                "copy inside pool {pool} at seq {seq} reads src_seq {} (not before it): a copy \
                 inside one pool reads an earlier state of the pool",
                src.seq
            ),
        ));
    }
    if let Some((start, count)) = slots {
        let (a, b) = (start as u64, start as u64 + count as u64);
        let (sa, sb) = (src.slot_start as u64, src.slot_start as u64 + count as u64);
        if a < sb && sa < b {
            return Err((
                crate::schema::kv_col::SRC_SLOT_START,
                format!(
                    "copy inside pool {pool} from slots {sa}..{sb} into slots {a}..{b}: source \
                     and destination overlap"
                ),
            ));
        }
    }
    Ok(())
}

/// The hint for a refused copy inside one pool.
pub const SAME_POOL_COPY_HINT: &str = "a copy inside one pool (a copy-on-write block copy) \
     names an earlier event of the pool as src_seq and a source extent apart from its \
     destination (docs/trace-format.md, \"Copies inside one pool\")";

/// `capacity_tokens` by pool id, a flat table so the per-row lookup is one
/// index (0: the id is not in the deployment).
#[derive(Debug, Clone, Default)]
pub struct Capacities(Vec<u64>);

impl Capacities {
    pub fn of(deployment: &crate::trace::manifest::Deployment) -> Self {
        let max = deployment.pools.iter().map(|p| p.id).max().unwrap_or(0);
        let mut cap = vec![0u64; max as usize + 1];
        for p in &deployment.pools {
            cap[p.id as usize] = p.capacity_tokens;
        }
        Capacities(cap)
    }

    /// The pool's capacity, or None when the deployment does not list it.
    #[inline]
    pub fn get(&self, pool: u16) -> Option<u64> {
        match self.0.get(pool as usize) {
            Some(&c) if c > 0 => Some(c),
            _ => None,
        }
    }
}

/// Which extent of a row [`check_extent`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// `slot_start .. slot_start + slot_count` of the row's pool.
    Slots,
    /// A copy's `src_slot_start .. src_slot_start + slot_count` of its
    /// source pool.
    Source,
}

/// The contract's extent rule: `count` slots from `start` lie within the
/// `capacity` slots of `pool`. Every reader of kv rows (the full reader and
/// the planning scan, which captures a copy's source before the copy's own
/// row is decoded) checks extents here.
pub fn check_extent(
    loc: impl FnOnce() -> Location,
    which: Extent,
    pool: u16,
    start: u32,
    count: u32,
    capacity: u64,
) -> Result<()> {
    let end = start as u64 + count as u64;
    if end <= capacity {
        return Ok(());
    }
    let what = match which {
        Extent::Slots => "extent",
        Extent::Source => "source extent",
    };
    Err(Error::invalid(
        loc(),
        format!("{what} {start}..{end} lies outside pool {pool} (capacity_tokens {capacity})"),
        "slots are numbered 0..capacity_tokens of their pool",
    ))
}
