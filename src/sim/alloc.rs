//! The KV slot allocator of one pool, modelled on SGLang's
//! `TokenToKVPoolAllocator` (page_size 1) and `PagedTokenToKVPoolAllocator`
//! (`mem_cache/allocator/{token,paged}.py`, 0.5.19 and 0.5.23 read).
//!
//! What is modelled exactly (and checked against the real classes by
//! tests/it/sim_sglang_fidelity.rs):
//! - page 0 is reserved (SGLang pads with it); usable pages are 1..=num_pages;
//! - `alloc` takes whole pages from the front of the free list;
//! - `alloc_extend` fills the rest of the last partial page first
//!   (`last_loc + 1 ...`), then whole new pages, then a tail page;
//! - `alloc_decode` takes a new page only at a page boundary;
//! - `free` releases the distinct pages of the freed slots in ascending
//!   order (`torch.unique`). With [`FreeListPolicy::SortedStaged`] (SGLang's
//!   `need_sort`, on in PD modes) they are staged and, when an allocation
//!   finds the free list short, merged with it and sorted ascending, so low
//!   page ids are reused first. With [`FreeListPolicy::MostRecentlyFreed`]
//!   they are put in front of the free list (the paged allocator without
//!   need_sort), so the page freed last is reused next.
//! - the merge triggers are those of the real calls: `alloc` when the pages
//!   needed exceed the free list, `alloc_extend` when
//!   `extend_tokens / page_size + batch + 1` does, `alloc_decode` when the
//!   batch size does.
//!
//! Nothing here touches KV contents: freed slots keep their data (the engine
//! model scrubs only when the scrub-on-free mitigation is configured).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Order in which freed pages come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FreeListPolicy {
    /// SGLang PD (`need_sort`): staged frees, merged and sorted ascending
    /// when an allocation runs short.
    SortedStaged,
    /// The most recently freed page is reused first (paged allocator
    /// without need_sort).
    MostRecentlyFreed,
}

/// A paged allocator over pages 1..=num_pages of one pool.
#[derive(Debug, Clone)]
pub struct Allocator {
    page_size: u32,
    num_pages: u32,
    policy: FreeListPolicy,
    free: VecDeque<u32>,
    staged: Vec<u32>,
}

impl Allocator {
    /// `size_tokens` is SGLang's `size` (max_total_num_tokens); the pool has
    /// `size_tokens / page_size` usable pages after the reserved page 0.
    pub fn new(size_tokens: u64, page_size: u32, policy: FreeListPolicy) -> Allocator {
        let num_pages = (size_tokens / page_size as u64) as u32;
        Allocator {
            page_size,
            num_pages,
            policy,
            free: (1..=num_pages).collect(),
            staged: Vec::new(),
        }
    }

    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Slots the pool's buffers span, page 0 included: (num_pages + 1) * page_size.
    pub fn slot_space(&self) -> u64 {
        (self.num_pages as u64 + 1) * self.page_size as u64
    }

    /// Pages free or staged (SGLang's `available_size() / page_size`).
    pub fn available_pages(&self) -> u32 {
        (self.free.len() + self.staged.len()) as u32
    }

    fn merge_and_sort(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let mut all: Vec<u32> = self.free.drain(..).collect();
        all.append(&mut self.staged);
        all.sort_unstable();
        self.free = all.into();
    }

    fn maybe_merge(&mut self, needed: usize) {
        if self.policy == FreeListPolicy::SortedStaged && needed > self.free.len() {
            self.merge_and_sort();
        }
    }

    /// `alloc(need_size)`: `n` whole pages from the front of the free list,
    /// or None (nothing taken) when there are not enough.
    pub fn alloc_pages(&mut self, n: u32) -> Option<Vec<u32>> {
        self.maybe_merge(n as usize);
        if n as usize > self.free.len() {
            return None;
        }
        Some(self.free.drain(..n as usize).collect())
    }

    /// `alloc_extend` for one request: extends a sequence from `prefix_len`
    /// to `seq_len` tokens; `last_loc` is the slot of token `prefix_len - 1`
    /// (ignored when prefix_len is 0). Returns the new slots in position
    /// order and the pages newly taken, or None (nothing taken).
    pub fn alloc_extend(
        &mut self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
    ) -> Option<(Vec<u32>, Vec<u32>)> {
        let ps = self.page_size;
        let extend = seq_len - prefix_len;
        if ps == 1 {
            // TokenToKVPoolAllocator: alloc_token_slots -> alloc(n).
            let pages = self.alloc_pages(extend)?;
            return Some((pages.clone(), pages));
        }
        self.maybe_merge((extend / ps) as usize + 2);
        let ceil_prefix = prefix_len.div_ceil(ps) * ps;
        let new_pages = seq_len.div_ceil(ps) - prefix_len.div_ceil(ps);
        if new_pages as usize > self.free.len() {
            return None;
        }
        let pages: Vec<u32> = self.free.drain(..new_pages as usize).collect();
        let mut out = Vec::with_capacity(extend as usize);
        let num1 = seq_len.min(ceil_prefix) - prefix_len;
        for i in 0..num1 {
            out.push(last_loc + 1 + i);
        }
        let mut pos = prefix_len + num1;
        let mut k = 0;
        while pos < seq_len {
            let page = pages[k];
            k += 1;
            let n = (seq_len - pos).min(ps);
            for off in 0..n {
                out.push(page * ps + off);
            }
            pos += n;
        }
        Some((out, pages))
    }

    /// `alloc_decode` for one request whose sequence grows to `seq_len`
    /// tokens; `last_loc` is the slot of token `seq_len - 2`. Returns the
    /// new slot and the page taken, if any.
    pub fn alloc_decode(&mut self, seq_len: u32, last_loc: u32) -> Option<(u32, Option<u32>)> {
        let ps = self.page_size;
        if ps == 1 {
            let p = self.alloc_pages(1)?;
            return Some((p[0], Some(p[0])));
        }
        self.maybe_merge(1);
        if (seq_len - 1) % ps != 0 {
            return Some((last_loc + 1, None));
        }
        let page = self.free.pop_front()?;
        Some((page * ps, Some(page)))
    }

    /// `free(slots)`: releases the distinct pages of `slots`.
    pub fn free_slots(&mut self, slots: &[u32]) {
        let mut pages: Vec<u32> = slots.iter().map(|s| s / self.page_size).collect();
        pages.sort_unstable();
        pages.dedup();
        self.free_pages(&pages);
    }

    /// Releases pages given in ascending order (what `torch.unique` yields).
    pub fn free_pages(&mut self, pages: &[u32]) {
        match self.policy {
            FreeListPolicy::SortedStaged => self.staged.extend_from_slice(pages),
            FreeListPolicy::MostRecentlyFreed => {
                for &p in pages.iter().rev() {
                    self.free.push_front(p);
                }
            }
        }
    }
}

/// What `validate_input_length` decides for a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// `--allow-auto-truncate`: `origin_input_ids[:max_req_input_len]`.
    Truncate(u64),
    /// The scheduler then calls `set_finish_with_abort`: the prompt becomes
    /// the [`PLACEHOLDER_TOKENS`]-token placeholder `[0]` with a pending 400.
    Reject,
}

/// Tokens of the placeholder prompt `set_finish_with_abort` leaves.
pub const PLACEHOLDER_TOKENS: u32 = 1;

/// `managers/utils.py` `validate_input_length` (0.5.19-0.5.23).
pub fn validate_input_length(
    prompt: u64,
    max_req_input_len: u64,
    allow_auto_truncate: bool,
) -> Verdict {
    if prompt >= max_req_input_len {
        if allow_auto_truncate {
            Verdict::Truncate(max_req_input_len)
        } else {
            Verdict::Reject
        }
    } else {
        Verdict::Accept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_zero_is_reserved_and_pages_are_whole() {
        let mut a = Allocator::new(64, 16, FreeListPolicy::SortedStaged);
        assert_eq!(a.num_pages(), 4);
        let (slots, pages) = a.alloc_extend(0, 20, 0).unwrap();
        assert_eq!(pages, vec![1, 2]);
        assert_eq!(slots[0], 16);
        assert_eq!(slots[19], 35);
        assert_eq!(a.slot_space(), 80);
    }

    #[test]
    fn last_partial_page_is_filled_first() {
        let mut a = Allocator::new(128, 4, FreeListPolicy::SortedStaged);
        let (slots, _) = a.alloc_extend(0, 6, 0).unwrap(); // pages 1, 2 (2 slots used)
        assert_eq!(slots, vec![4, 5, 6, 7, 8, 9]);
        let (more, pages) = a.alloc_extend(6, 11, 9).unwrap();
        assert_eq!(more, vec![10, 11, 12, 13, 14]);
        assert_eq!(pages, vec![3]);
        assert_eq!(a.alloc_decode(12, 14).unwrap(), (15, None));
        assert_eq!(a.alloc_decode(13, 15).unwrap(), (16, Some(4)));
    }

    #[test]
    fn sorted_staged_reuses_low_pages_only_after_the_list_runs_short() {
        let mut a = Allocator::new(5 * 2, 2, FreeListPolicy::SortedStaged);
        let p = a.alloc_pages(3).unwrap();
        assert_eq!(p, vec![1, 2, 3]);
        a.free_pages(&[1, 3]);
        // 2 free pages (4, 5) left: a 2-page alloc takes them, no merge.
        assert_eq!(a.alloc_pages(2).unwrap(), vec![4, 5]);
        // Now the list is short: staged 1, 3 merged and sorted.
        assert_eq!(a.alloc_pages(1).unwrap(), vec![1]);
        a.free_pages(&[5]);
        assert_eq!(a.alloc_pages(2).unwrap(), vec![3, 5]);
        assert_eq!(a.alloc_pages(1), None);
    }

    #[test]
    fn most_recently_freed_comes_back_first() {
        let mut a = Allocator::new(5 * 2, 2, FreeListPolicy::MostRecentlyFreed);
        a.alloc_pages(3).unwrap();
        a.free_slots(&[6, 7, 2]); // pages 3 and 1, released ascending
        assert_eq!(a.alloc_pages(3).unwrap(), vec![1, 3, 4]);
    }

    #[test]
    fn exhaustion_takes_nothing() {
        let mut a = Allocator::new(8, 4, FreeListPolicy::SortedStaged);
        assert!(a.alloc_extend(0, 9, 0).is_none());
        assert_eq!(a.available_pages(), 2);
        assert!(a.alloc_extend(0, 8, 0).is_some());
    }
}
