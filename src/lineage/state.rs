//! Slot values and read classification: what a slot holds (a content
//! owner: `NEVER`, `SCRUBBED` or a request id; a generation `wseq1`, seq +
//! 1 of the event that set the content, 0 = never), what a copy carries
//! ([`SlotVal`], [`Payload`]), what a share grant covers ([`Grant`]) and
//! how a read of a slot is classified ([`classify`], docs/trace-format.md,
//! "Semantics"). The transition a slot goes through on each event is
//! `rule::PoolState::apply`; the stale bits are `stale`, the grant sets
//! `grants`. The GPU kernels mirror [`classify`] (kernels/lineage.cu,
//! `kvt_classify`).

/// Owner value of a slot never written during the capture.
pub const NEVER: u64 = u64::MAX;
/// Owner value of a scrubbed slot (zeroed: no owner).
pub const SCRUBBED: u64 = u64::MAX - 1;

/// The content of one source slot as a copy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotVal {
    /// Content owner, or `NEVER` / `SCRUBBED`.
    pub owner: u64,
    /// The value depends on state after a hole (or on an uncertain copy).
    pub uncertain: bool,
    /// The content predates the source slot's latest `alloc`: a copy
    /// carries the staleness to its destination.
    pub stale: bool,
}

/// The content of a copy's source slots, as runs of equal [`SlotVal`]s
/// (`len` slots each, in slot order): a source written by one request in
/// one go is one run, so capturing and applying a copy costs per run, not
/// per slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    runs: Vec<(u32, SlotVal)>,
    len: usize,
}

impl Payload {
    pub fn clear(&mut self) {
        self.runs.clear();
        self.len = 0;
    }

    /// Slots covered.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `n` slots of value `v` (joined to the last run when equal).
    /// A payload covers one copy's extent, at most 2^32 - 1 slots.
    #[inline]
    pub fn push_run(&mut self, n: usize, v: SlotVal) {
        if n == 0 {
            return;
        }
        self.len += n;
        match self.runs.last_mut() {
            Some((k, last)) if *last == v => *k += n as u32,
            _ => {
                // Most payloads are one run: room for exactly one first.
                if self.runs.capacity() == 0 {
                    self.runs.reserve_exact(1);
                }
                self.runs.push((n as u32, v))
            }
        }
    }

    #[inline]
    pub fn push(&mut self, v: SlotVal) {
        self.push_run(1, v)
    }

    /// Keeps the first `n` slots.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        let (mut seen, mut keep) = (0usize, 0usize);
        for (k, _) in self.runs.iter_mut() {
            if seen >= n {
                break;
            }
            let take = (*k as usize).min(n - seen);
            *k = take as u32;
            seen += take;
            keep += 1;
        }
        self.runs.truncate(keep);
        self.len = n;
    }

    /// The runs: (slots, value), in slot order.
    #[inline]
    pub fn runs(&self) -> &[(u32, SlotVal)] {
        &self.runs
    }

    /// The value of every slot, in order.
    pub fn iter(&self) -> impl Iterator<Item = SlotVal> + '_ {
        self.runs
            .iter()
            .flat_map(|&(n, v)| std::iter::repeat_n(v, n as usize))
    }

    /// Bytes a payload in flight costs (for the exchange's limit): its
    /// runs' buffer, itself, and about 64 bytes of map entry and
    /// allocator overhead.
    pub fn bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<(u32, SlotVal)>()
            + std::mem::size_of::<Self>()
            + 64
    }
}

impl Extend<SlotVal> for Payload {
    fn extend<I: IntoIterator<Item = SlotVal>>(&mut self, vals: I) {
        for v in vals {
            self.push(v);
        }
    }
}

impl FromIterator<SlotVal> for Payload {
    fn from_iter<I: IntoIterator<Item = SlotVal>>(vals: I) -> Self {
        let mut p = Payload::default();
        p.extend(vals);
        p
    }
}

/// What a read of a run of slots found, when it is not a clean own read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReadKind {
    /// The content owner is another request without a valid share grant.
    Foreign,
    /// Scrubbed, or never written in a capture that began with the engine.
    Blank,
    /// Never written in a capture that did not begin with the engine.
    Unknown,
    /// Would be own, shared or blank, but the slot's state depends on a
    /// hole in the seq stream: lost events may have changed it.
    Uncertain,
    /// Another request's content read under a valid share grant (a
    /// prefix-cache hit): clean, but the source is kept so that reports can
    /// list hits on another tenant's KV apart.
    Shared,
}

/// A classification: None for a clean own read; otherwise the kind, the
/// source request (`Foreign`, `Shared`) and whether it is uncertain.
pub type Class = Option<(ReadKind, u64, bool)>;

/// Classifies a read of slot `s` by `reader`: the slot holds `owner`'s
/// content set by the event with seq `wseq1 - 1`, `uncertain` when it
/// depends on a hole; `grants` are the reader's; `never` is `Blank` or
/// `Unknown` (whether the capture began with the engine).
#[inline]
pub fn classify(
    owner: u64,
    wseq1: u64,
    uncertain: bool,
    s: u64,
    reader: u64,
    grants: &[Grant],
    never: ReadKind,
) -> Class {
    if owner == NEVER {
        return Some(match never {
            ReadKind::Unknown => (ReadKind::Unknown, 0, uncertain),
            _ if uncertain => (ReadKind::Uncertain, 0, true),
            k => (k, 0, false),
        });
    }
    if owner == SCRUBBED {
        return Some(if uncertain {
            (ReadKind::Uncertain, 0, true)
        } else {
            (ReadKind::Blank, 0, false)
        });
    }
    if owner == reader {
        return uncertain.then_some((ReadKind::Uncertain, 0, true));
    }
    if grants.iter().any(|g| g.covers(s, wseq1)) {
        return Some(if uncertain {
            (ReadKind::Uncertain, 0, true)
        } else {
            (ReadKind::Shared, owner, false)
        });
    }
    Some((ReadKind::Foreign, owner, uncertain))
}

/// A share grant: slots `start..=last` (all current when granted),
/// granted at `seq`. 16 bytes: slots are below 2^32 (a pool holds at most
/// 2^32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub(super) start: u32,
    pub(super) last: u32,
    pub seq: u64,
}

impl Grant {
    /// The grant of slots `start..end` (non-empty, `end` at most 2^32).
    pub fn new(start: u64, end: u64, seq: u64) -> Self {
        debug_assert!(start < end && end <= 1 << 32);
        Grant {
            start: start as u32,
            last: (end - 1) as u32,
            seq,
        }
    }

    /// The first slot.
    #[inline]
    pub fn start(&self) -> u64 {
        self.start as u64
    }

    /// One past the last slot.
    #[inline]
    pub fn end(&self) -> u64 {
        self.last as u64 + 1
    }

    /// Whether the grant makes a read of slot `s` shared, the slot's
    /// content having been set by the event with seq `wseq1 - 1`: the slot
    /// is in the grant and was not written since it.
    #[inline]
    pub fn covers(&self, s: u64, wseq1: u64) -> bool {
        self.start() <= s && s <= self.last as u64 && wseq1 <= self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_keeps_equal_slots_as_one_run() {
        let v = |owner, stale| SlotVal {
            owner,
            uncertain: false,
            stale,
        };
        let mut p = Payload::default();
        p.push_run(5, v(1, false));
        p.push(v(1, false));
        p.push_run(0, v(9, false));
        p.push_run(3, v(2, true));
        p.push(v(1, false));
        assert_eq!(p.len(), 10);
        assert_eq!(
            p.runs(),
            &[(6, v(1, false)), (3, v(2, true)), (1, v(1, false))]
        );
        let each: Vec<u64> = p.iter().map(|x| x.owner).collect();
        assert_eq!(each, [1, 1, 1, 1, 1, 1, 2, 2, 2, 1]);
        let mut t = p.clone();
        t.truncate(7);
        assert_eq!(t.runs(), &[(6, v(1, false)), (1, v(2, true))]);
        assert_eq!(t.len(), 7);
        t.truncate(6);
        assert_eq!(t.runs(), &[(6, v(1, false))]);
        t.truncate(0);
        assert!(t.is_empty() && t.runs().is_empty());
        let back: Payload = p.iter().collect();
        assert_eq!(back, p);
    }
    #[test]
    fn classify_follows_the_semantics() {
        let g = [Grant::new(0, 4, 9)];
        let c = |owner, wseq1, unc, s| classify(owner, wseq1, unc, s, 5, &g, ReadKind::Blank);
        assert_eq!(c(5, 3, false, 0), None);
        assert_eq!(c(5, 3, true, 0), Some((ReadKind::Uncertain, 0, true)));
        assert_eq!(c(6, 3, false, 1), Some((ReadKind::Shared, 6, false)));
        assert_eq!(c(6, 11, false, 1), Some((ReadKind::Foreign, 6, false)));
        assert_eq!(c(6, 3, false, 4), Some((ReadKind::Foreign, 6, false)));
        assert_eq!(c(6, 3, true, 9), Some((ReadKind::Foreign, 6, true)));
        assert_eq!(c(NEVER, 0, false, 9), Some((ReadKind::Blank, 0, false)));
        assert_eq!(
            c(SCRUBBED, 2, true, 9),
            Some((ReadKind::Uncertain, 0, true))
        );
        assert_eq!(
            classify(NEVER, 0, true, 9, 5, &g, ReadKind::Unknown),
            Some((ReadKind::Unknown, 0, true))
        );
    }
}
