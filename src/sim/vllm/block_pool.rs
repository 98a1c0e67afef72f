//! vLLM's `BlockPool` (v1/core/block_pool.py) for one KV cache group, as
//! the vLLM model allocates from it: the null block, the free queue in
//! vLLM's order (unhashed blocks to the head, hashed ones to the tail),
//! prefix-cache lookups by block hash key, and eviction of a cached key
//! when its block is reused.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Default)]
pub(super) struct Block {
    pub(super) ref_cnt: u32,
    /// The block's hash key when it is registered for prefix hits.
    pub(super) key: Option<u64>,
    /// The block carries a hash (a full block): freed to the tail of the
    /// queue (LRU) instead of the head.
    pub(super) hashed: bool,
    /// Position in the free queue while ref_cnt is 0.
    pub(super) qkey: Option<i64>,
    /// A tier load filled the block with KV its key was not stored for
    /// (a stale tier page): the capture grants no hit on it.
    pub(super) ungranted: bool,
}

/// vLLM's `BlockPool` (v1/core/block_pool.py) for one KV cache group:
/// block 0 is the null block; the free queue starts 1..=n; `get_new_blocks`
/// pops from the head and evicts a cached hash; `free_blocks` takes the
/// blocks in eviction order (the manager passes them reversed) and
/// prepends unhashed blocks, appends hashed ones; `touch` takes a hit
/// block out of the queue.
pub(super) struct BlockPool {
    pub(super) bs: u32,
    pub(super) caching: bool,
    pub(super) blocks: Vec<Block>,
    pub(super) free: BTreeMap<i64, u32>,
    pub(super) head: i64,
    pub(super) tail: i64,
    pub(super) table: HashMap<u64, u32>,
    /// Keep the (block, key) of every cached block `get_new` evicts in
    /// `evicted` (a CPU tier stores them).
    pub(super) track_evictions: bool,
    pub(super) evicted: Vec<(u32, u64)>,
}

impl BlockPool {
    pub(super) fn new(usable_blocks: u32, bs: u32, caching: bool) -> BlockPool {
        let mut blocks = vec![Block::default(); usable_blocks as usize + 1];
        let mut free = BTreeMap::new();
        for b in 1..=usable_blocks {
            free.insert(b as i64, b);
            blocks[b as usize].qkey = Some(b as i64);
        }
        BlockPool {
            bs,
            caching,
            blocks,
            free,
            head: 1,
            tail: usable_blocks as i64 + 1,
            table: HashMap::new(),
            track_evictions: false,
            evicted: Vec::new(),
        }
    }

    pub(super) fn slot_space(&self) -> usize {
        self.blocks.len() * self.bs as usize
    }

    /// The longest run of leading keys registered (`find_longest_cache_hit`).
    pub(super) fn lookup(&self, keys: &[Option<u64>]) -> Vec<u32> {
        if !self.caching {
            return Vec::new();
        }
        keys.iter()
            .map_while(|k| k.and_then(|k| self.table.get(&k).copied()))
            .collect()
    }

    /// Hit blocks still in the free queue (they stop being free when touched).
    pub(super) fn idle(&self, blocks: &[u32]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count()
    }

    pub(super) fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let blk = &mut self.blocks[b as usize];
            if blk.ref_cnt == 0
                && let Some(q) = blk.qkey.take()
            {
                self.free.remove(&q);
            }
            blk.ref_cnt += 1;
        }
    }

    pub(super) fn get_new(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, b) = self.free.pop_first().expect("counted");
            let blk = &mut self.blocks[b as usize];
            blk.qkey = None;
            if let Some(k) = blk.key.take()
                && self.table.get(&k) == Some(&b)
            {
                self.table.remove(&k);
                if self.track_evictions {
                    self.evicted.push((b, k));
                }
            }
            blk.hashed = false;
            blk.ungranted = false;
            blk.ref_cnt = 1;
            out.push(b);
        }
        Some(out)
    }

    /// `KVCacheManager.free`: the request's table in order; freed reversed.
    pub(super) fn free(&mut self, table: &[u32]) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for &b in table.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            blk.ref_cnt -= 1;
            if blk.ref_cnt == 0 {
                if blk.hashed && self.caching {
                    last.push(b);
                } else {
                    first.push(b);
                }
            }
        }
        for &b in first.iter().rev() {
            self.head -= 1;
            self.free.insert(self.head, b);
            self.blocks[b as usize].qkey = Some(self.head);
        }
        for b in last {
            self.free.insert(self.tail, b);
            self.blocks[b as usize].qkey = Some(self.tail);
            self.tail += 1;
        }
    }

    /// `cache_full_blocks` for one full block (a block already hashed
    /// keeps its hash; a key another block holds keeps that block).
    pub(super) fn cache(&mut self, b: u32, key: Option<u64>) {
        if !self.caching {
            return;
        }
        let blk = &mut self.blocks[b as usize];
        if blk.hashed {
            return;
        }
        blk.hashed = true;
        if let Some(k) = key {
            blk.key = Some(k);
            self.table.entry(k).or_insert(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_queue_follows_vllm_block_pool_order() {
        let mut p = BlockPool::new(6, 4, true);
        // Block 0 is the null block; the queue starts in id order.
        let a = p.get_new(3).unwrap();
        assert_eq!(a, vec![1, 2, 3]);
        // Blocks 1, 2 full (hashed, 1 with a prefix key); 3 partial.
        p.cache(1, Some(77));
        p.cache(2, None);
        p.free(&a);
        // Freed reversed: the unhashed block 3 goes to the head (LIFO),
        // hashed 2 then 1 to the tail (LRU).
        let order: Vec<u32> = p.free.values().copied().collect();
        assert_eq!(order, vec![3, 4, 5, 6, 2, 1]);
        // A prefix hit on block 1 takes it out of the queue.
        assert_eq!(p.lookup(&[Some(77), Some(78)]), vec![1]);
        assert_eq!(p.idle(&[1]), 1);
        p.touch(&[1]);
        assert_eq!(p.free.len(), 5);
        // Reuse evicts the cached key of a block taken from the queue.
        let b = p.get_new(5).unwrap();
        assert_eq!(b, vec![3, 4, 5, 6, 2]);
        assert!(p.get_new(1).is_none());
        p.free(&[1]);
        let c = p.get_new(1).unwrap();
        assert_eq!(c, vec![1]);
        assert!(p.lookup(&[Some(77)]).is_empty(), "evicted on reuse");
    }

    #[test]
    fn caching_off_frees_everything_to_the_head() {
        let mut p = BlockPool::new(4, 4, false);
        let a = p.get_new(2).unwrap();
        p.cache(1, Some(5));
        p.free(&a);
        // `prepend_n` of the reversed table: the tail block is reused first.
        let order: Vec<u32> = p.free.values().copied().collect();
        assert_eq!(order, vec![2, 1, 3, 4]);
        assert!(p.lookup(&[Some(5)]).is_empty());
    }
}
