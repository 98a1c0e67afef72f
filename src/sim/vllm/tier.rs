//! The vLLM model's KV tiers, each a pool of role `cache`:
//!
//! - a SimpleCPUOffload-style CPU tier on the decode instance (pool 2,
//!   `cpu_offload_tokens`): a block the decode block pool evicts from its
//!   prefix cache is stored first (the engine, request 0, allocates a CPU
//!   block and copies the decode block into it); a later prefix miss the
//!   tier holds is loaded into fresh decode blocks of the request;
//! - an LMCache-style external store (pool 3, `lmcache_tokens`) shared by
//!   both instances: each stores a finished request's full prefix chunks
//!   (`lmcache_chunk_tokens`), keyed by the chunk's chained hash (the block
//!   key of its last block: the prefix and `cache_salt` are in it); prefill
//!   looks the prompt's leading chunks up and loads hits into fresh blocks.
//!
//! Both keep their entries in LRU order and evict the least recently used
//! when full. A load is the request's: its blocks are allocated to it, a
//! `write` with src per run copies the tier's blocks in, and a `share`
//! grants the slots whose tier block was stored for the key looked up (as
//! the hook knows: a tier block reused under a stale key gets no grant, so
//! its read is foreign, with its true source). The planted defect
//! (`bug_stale_*_ppm`) frees an eviction victim's blocks without dropping
//! its key.
//!
//! This file holds a tier's state and index; the engine's stores, loads
//! and grants through it are in `offload`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::sim::base::Slots;

/// Owner recorded for a hit whose content the capture grants nothing:
/// no request has this id, so no read of it is taken as shared.
pub(super) const NO_OWNER: u64 = u64::MAX - 1;

pub(super) struct Entry {
    pub(super) blocks: Vec<u32>,
    /// Content owner of each block's first slot when it was stored.
    pub(super) owners: Vec<u64>,
    /// LRU position; None: a leaked key (its blocks went back to the free
    /// list under the planted defect), never evicted.
    pub(super) tick: Option<u64>,
}

/// One tier pool: its blocks (1..=n; block 0 unused, as in the device
/// pools), per-slot content, the key index and the LRU order.
pub(super) struct Tier {
    pub(super) pool: u16,
    /// Device blocks per entry (1 for the CPU tier, a chunk for LMCache).
    pub(super) unit: u32,
    pub(super) slots: Slots,
    pub(super) free: BTreeSet<u32>,
    pub(super) entries: HashMap<u64, Entry>,
    pub(super) lru: BTreeMap<u64, u64>,
    /// Per tier block: the key whose entry its content was stored for.
    pub(super) written_for: Vec<Option<u64>>,
    pub(super) tick: u64,
    pub(super) evictions: u64,
    pub(super) stale_ppm: u32,
}

/// What a load put into a request's blocks.
pub(super) struct Loaded {
    /// Expected content owner per loaded block (the owner its key was
    /// stored with; [`NO_OWNER`] for a block the capture grants nothing).
    pub(super) owners: Vec<u64>,
}

impl Tier {
    pub(super) fn new(pool: u16, tokens: u64, bs: u32, unit: u32, stale_ppm: u32) -> Tier {
        let n = (tokens / bs as u64) as u32;
        Tier {
            pool,
            unit,
            slots: Slots::new(((n + 1) * bs) as usize),
            free: (1..=n).collect(),
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            written_for: vec![None; n as usize + 1],
            tick: 0,
            evictions: 0,
            stale_ppm,
        }
    }

    /// The key of entry `j` of a prompt whose block keys are `keys`.
    pub(super) fn entry_key(&self, keys: &[Option<u64>], j: usize) -> Option<u64> {
        chunk_key(keys, self.unit as usize, j)
    }

    /// How many leading entries of `keys` the tier holds.
    pub(super) fn lookup(&self, keys: &[Option<u64>]) -> usize {
        let n = keys.len() / self.unit as usize;
        (0..n)
            .take_while(|&j| {
                self.entry_key(keys, j)
                    .is_some_and(|k| self.entries.contains_key(&k))
            })
            .count()
    }

    /// Moves entry `k` to the most recently used end (a leaked key stays
    /// out of the LRU order).
    pub(super) fn touch(&mut self, k: u64) {
        self.tick += 1;
        let t = self.tick;
        if let Some(e) = self.entries.get_mut(&k)
            && let Some(old) = e.tick.replace(t)
        {
            self.lru.remove(&old);
            self.lru.insert(t, k);
        }
    }
}

/// The key of entry `j` of `u` blocks each (the key of its last block:
/// the chained block hash covers the prefix before it and the salt).
pub(super) fn chunk_key(keys: &[Option<u64>], u: usize, j: usize) -> Option<u64> {
    keys.get((j + 1) * u - 1).copied().flatten()
}
