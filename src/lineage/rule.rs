//! The slot rule, in one place: what each event does to a pool's slots
//! (docs/trace-format.md, "Semantics"). [`PoolState::apply`] is the
//! transition every backend calls, event by event (the CPU and GPU replay
//! backends, the audit's, the counterfactual's, and the benchmarks'):
//!
//! - `alloc`: the slots' content becomes stale (it predates the holding);
//! - `write` / `scrub`: the slots hold the request's content (or none) and
//!   are current;
//! - a copy (`write` with src): each slot takes its source slot's content
//!   and current/stale state ([`PoolState::copy`]);
//! - `share`: the reader is granted the slots whose content is current; the
//!   grant holds until the slots are written again (a `free` does not end
//!   it); dead grants are swept when enough piled up;
//! - `free`: nothing changes in the content;
//! - `read`: classified by the backend against the pool's grants
//!   (`state::classify` is the classification).
//!
//! The rule keeps the stale bits and the grants ([`PoolState`]); what a
//! backend keeps per slot (owner, generation, holder, token position, or
//! device buffers) and how it answers a read is its [`SlotData`], a type
//! parameter, so each backend's calls are monomorphised and inlined.
//! Nothing here batches or looks ahead: live detection can apply events
//! one at a time as they arrive.

use crate::error::Result;
use crate::schema::{KvEvent, Op};

use super::grants::Grants;
use super::stale::StaleBits;
use super::state::{Grant, Payload, SCRUBBED, SlotVal};

/// Whether an event of `op` (not a copy) can change what a copy of its
/// slots captures ([`SlotVal`]: owner, uncertainty, stale state), as
/// [`PoolState::apply`] below defines: `alloc` (stale), `write` and
/// `scrub` (content). `free`, `share` (grants only) and `read` leave it as
/// it was. A copy always can. Live detection keeps the prior content of
/// exactly these events, so a copy that arrives after its source pool
/// moved on still sees the source as of `src_seq`.
#[inline]
pub fn changes_content(op: Op) -> bool {
    matches!(op, Op::Alloc | Op::Write | Op::Scrub)
}

/// What a backend keeps per slot besides the rule's stale bits and grants.
/// Slot ranges are `a..b` (non-empty for `set`, `copy` and `read` when the
/// event is; a backend that splits a pool calls the rule once per piece).
pub trait SlotData {
    /// A `write` (owner: the request) or `scrub` (owner: `SCRUBBED`) by
    /// `e`: slots `a..b` now hold `owner`'s content, of generation
    /// `e.seq + 1`.
    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()>;

    /// A copy by `e` into slots `a..b`: each takes the content `v` (owner,
    /// uncertainty), of generation `e.seq + 1`.
    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()>;

    /// A `read` of slots `a..b` by `e.request_id`, to classify against the
    /// pool's `grants` (`Grants::lookup` for the reader's).
    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()>;

    /// An `alloc` of slots `a..b` by `e` (the rule made their content stale).
    #[inline]
    fn alloc(&mut self, _e: &KvEvent, _a: u64, _b: u64) {}

    /// A `free` of slots `a..b` by `e` (the content stays).
    #[inline]
    fn free(&mut self, _e: &KvEvent, _a: u64, _b: u64) {}

    /// Whether grant `g` can still make a read shared: some slot of it was
    /// not written since it was given. A sweep drops the others; a backend
    /// that cannot tell cheaply keeps every grant (true).
    fn alive(&self, g: &Grant) -> bool;
}

/// The rule's own state for one pool (or one piece of a pool): which slots
/// hold stale content, and the share grants.
pub struct PoolState {
    pub stale: StaleBits,
    pub grants: Grants,
}

impl PoolState {
    /// A pool of `capacity` slots, nothing written, holding its grants in
    /// `grants` (`Grants::default()`, or `Grants::spilling`).
    pub fn new(capacity: u64, grants: Grants) -> Self {
        PoolState {
            stale: StaleBits::new(capacity),
            grants,
        }
    }

    /// Applies event `e` to slots `a..b` (its extent, or the piece of it a
    /// backend holds here), with `slots` the backend's per-slot data.
    /// Copies go through [`copy`](Self::copy).
    #[inline]
    pub fn apply<S: SlotData + ?Sized>(
        &mut self,
        slots: &mut S,
        e: &KvEvent,
        a: u64,
        b: u64,
    ) -> Result<()> {
        match e.op {
            Op::Alloc => {
                self.stale.alloc(a, b);
                slots.alloc(e, a, b);
            }
            Op::Free => slots.free(e, a, b),
            Op::Write | Op::Scrub => {
                debug_assert!(e.src.is_none(), "copies go through PoolState::copy");
                let owner = if e.op == Op::Write {
                    e.request_id
                } else {
                    SCRUBBED
                };
                slots.set(e, a, b, owner)?;
                self.stale.set_current(a, b);
            }
            Op::Share => {
                let current = self.stale.current_runs(a, b);
                if self.grants.share(e.request_id, current, e.seq)? {
                    self.grants.sweep(|g| slots.alive(g))?;
                }
            }
            Op::Read => slots.read(e, a, b, &mut self.grants)?,
        }
        Ok(())
    }

    /// A copy by `e` into slots `a..b`, every one taking the source content
    /// `v` (owner, uncertainty, and current/stale state). A payload is
    /// applied a run at a time ([`copy_payload`](Self::copy_payload)).
    #[inline]
    pub fn copy<S: SlotData + ?Sized>(
        &mut self,
        slots: &mut S,
        e: &KvEvent,
        a: u64,
        b: u64,
        v: SlotVal,
    ) -> Result<()> {
        slots.copy(e, a, b, v)?;
        self.stale.set_range(a, b, v.stale);
        Ok(())
    }

    /// A copy by `e` of `payload` into slots `a..a + payload.len()`.
    pub fn copy_payload<S: SlotData + ?Sized>(
        &mut self,
        slots: &mut S,
        e: &KvEvent,
        a: u64,
        payload: &Payload,
    ) -> Result<()> {
        let mut s = a;
        for &(n, v) in payload.runs() {
            self.copy(slots, e, s, s + u64::from(n), v)?;
            s += u64::from(n);
        }
        Ok(())
    }
}
