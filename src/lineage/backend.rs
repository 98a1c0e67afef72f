//! The `Backend` trait: what a replay backend does to the slot state of a
//! pool, one batch of events at a time.
//!
//! The scheduler (`sched`) owns ordering, copies between pools and gaps; a
//! backend owns the per-slot state and applies whole batches ("push the fors
//! down"), so a CUDA backend can replace the CPU one and must produce the
//! same `ReadRun`s, in the same order, for the same input.

use crate::error::Result;
use crate::schema::KvEvent;

pub use super::state::{NEVER, Payload, ReadKind, SCRUBBED, SlotVal};

/// A maximal run of slots of one read event with one classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRun {
    pub reader: u64,
    pub pool: u16,
    pub slot_start: u32,
    pub count: u32,
    pub kind: ReadKind,
    /// Content owner (the source of the exposure) for `Foreign`.
    pub source: u64,
    /// A `Foreign` run whose owner is known only up to a hole.
    pub uncertain: bool,
    /// seq and time of the read event.
    pub seq: u64,
    pub ts_ns: i64,
}

/// Counters every backend keeps the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub events: u64,
    /// Sum of slot_count over all events.
    pub slot_touches: u64,
    pub read_events: u64,
    pub read_slots: u64,
    pub own_slots: u64,
    pub shared_slots: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.events += o.events;
        self.slot_touches += o.slot_touches;
        self.read_events += o.read_events;
        self.read_slots += o.read_slots;
        self.own_slots += o.own_slots;
        self.shared_slots += o.shared_slots;
    }
}

/// A replay backend: per-slot state of every pool and the batch operations
/// on it.
pub trait Backend {
    /// Short name printed to the user (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Declares a pool of `capacity` slots (1..=2^32); every slot starts
    /// never-written. `from_engine_start` decides whether never-written
    /// reads are blank or unknown.
    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()>;
    /// The most slots, summed over the replayed pools' capacities, this
    /// backend can hold (it allocates every declared slot up front); None
    /// when its memory follows the slots touched. The scheduler refuses a
    /// deployment over the limit before declaring any pool.
    fn slot_limit(&self) -> Option<u64> {
        None
    }
    /// The threads this backend applies a batch on (1 unless it was opened
    /// with more).
    fn threads(&self) -> usize {
        1
    }
    /// `n` fresh backends of the same kind, each on `threads` threads and
    /// holding no pool, that together keep this backend's limits (one
    /// touched-slot budget for all), so that pools no copy connects can
    /// replay on threads of their own; None when the backend cannot run
    /// beside itself (the GPU backends drive one device). The outcome of a
    /// replay never depends on whether it was used.
    fn forks(&self, _n: usize, _threads: usize) -> Option<Vec<Box<dyn Backend + Send>>> {
        None
    }
    /// Share grants a pool keeps in memory before the older ones go to
    /// disk, for a backend that spills them (`state::Grants::spilling`;
    /// its forks keep the limit). Changes memory, never the outcome.
    fn limit_grants(&mut self, _grants: usize) {}
    /// Events are missing just before seq `before_seq` of `pool`: every slot
    /// whose content was set before it becomes uncertain.
    fn mark_gap(&mut self, pool: u16, before_seq: u64);
    /// Applies events of one pool, in seq order. The batch holds no copies
    /// (writes with src): those go through `apply_copy`. Read runs that are
    /// not clean own/shared reads are appended to `out`.
    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        out: &mut Vec<ReadRun>,
        counters: &mut Counters,
    ) -> Result<()>;
    /// Applies one copy (write with src) whose source content is `payload`
    /// (one value per destination slot, in runs).
    fn apply_copy(
        &mut self,
        pool: u16,
        event: &KvEvent,
        payload: &Payload,
        counters: &mut Counters,
    ) -> Result<()>;
    /// Reads the current content of `count` slots from `slot_start`;
    /// `uncertain` marks all of them uncertain (the source seq was lost).
    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Payload,
    ) -> Result<()>;
}

/// A map keyed by pool id. Pool ids are 16 bits, so the key itself is the
/// hash (no hash flooding is possible over 65,536 values): the replay looks
/// its pools up on every batch and copy, where SipHash showed in profiles.
pub type PoolMap<V> = std::collections::HashMap<u16, V, std::hash::BuildHasherDefault<IdHasher>>;

/// A map keyed by an object's address (the engine hooks' native module:
/// objects it holds, so no one outside chooses the keys).
pub type AddrMap<V> = std::collections::HashMap<usize, V, std::hash::BuildHasherDefault<IdHasher>>;

/// The hasher of [`PoolMap`] and [`AddrMap`]: a pool id, or an address
/// without its alignment bits, spread by one multiplication.
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u16(&mut self, v: u16) {
        self.0 = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, n: usize) {
        // Objects are 16-byte aligned: the low bits carry nothing.
        self.0 = ((n as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
