//! The writer's copies between pools: a transfer's commit rebuilt from its
//! room's sends, a pull (`xfer_pull`) stamped causally with its source
//! pool's last change at or before the load, and an engine copy (`copy`)
//! stamped with the source pool's position its hook reported; each is
//! recorded as holes when its source state cannot be known.

use std::sync::atomic::Ordering;

use super::{RECENT, Ready, Room, W, Wait};
use crate::error::Result;
use crate::record::shared::View;
use crate::record::stats::add;
use crate::record::wire::{EngineCopy, LoadPolicy, PageRun, PullOutcome, XferCommit, XferPull};
use crate::schema::{CopySrc, KvEvent, Op};

impl W<'_> {
    /// A pull whose source state cannot be known: its runs are lost
    /// events (holes), never a guess.
    pub(super) fn unstamped(&mut self, p: &XferPull, why: &str) -> Result<()> {
        let n = p.runs.len().max(1) as u64;
        add(&self.sh.stats.copies_unresolved, n);
        self.log(&format!(
            "load into pool {} for request {} from pool {}: {why}; recorded as lost events",
            p.pool, p.request_id, p.src_pool
        ));
        self.lose(p.pool, n)
    }

    pub(super) fn commit(&mut self, c: &XferCommit) -> Result<()> {
        let room = self.rooms.remove(&c.room).unwrap_or_default();
        self.held -= room.bytes;
        if self.stopped_at_max {
            add(&self.sh.stats.lost_max_bytes, 1);
            return self.lose(c.pool, 1);
        }
        if room.broken {
            add(&self.sh.stats.copies_unresolved, 1);
            self.log(&format!(
                "transfer for room {} into pool {}: a send was dropped (--max-pending-bytes); recorded as a lost event",
                c.room, c.pool
            ));
            return self.lose(c.pool, 1);
        }
        match self.copy_events(c, &room) {
            Ok(evs) => {
                for ev in evs {
                    match self.rec.kv(ev) {
                        Ok(seq) => self.written(ev, seq),
                        Err(e) => {
                            self.sh
                                .stats
                                .rejected_contract
                                .fetch_add(1, Ordering::Relaxed);
                            self.lose(c.pool, 1)?;
                            self.log(&format!(
                                "copy into pool {} rejected (hole): {}",
                                c.pool,
                                e.to_string().replace('\n', " ")
                            ));
                        }
                    }
                }
                Ok(())
            }
            Err(why) => {
                self.sh
                    .stats
                    .rejected_contract
                    .fetch_add(1, Ordering::Relaxed);
                self.log(&format!(
                    "transfer for room {} into pool {} rejected (hole): {why}",
                    c.room, c.pool
                ));
                self.lose(c.pool, 1)
            }
        }
    }

    /// A pull-based transfer reported by its consumer: each run becomes one
    /// `write` with `src` on the consumer's pool, stamped with the source
    /// pool's last change (event or hole) whose ts_ns is at or before the
    /// pull's (the consumer reports the time the load was seen done; a
    /// one-sided read leaves no event on the producer). The pull waits (its
    /// stream parked) until the source pool's connection has marked past
    /// that time or ended, so the stamp does not depend on which
    /// connection's lines arrived first. A run outside either pool, a source
    /// pool with no such change, or one whose feed cannot say, is a hole,
    /// never a guess.
    pub(super) fn pull(&mut self, conn: u64, view: View, p: Box<XferPull>) -> Result<()> {
        let st = &self.sh.stats;
        if let Some(pol) = p.policy {
            let v = self.policies.entry(p.pool).or_default();
            if !v.contains(&pol) {
                v.push(pol);
            }
        }
        match p.outcome {
            PullOutcome::Ok => {}
            PullOutcome::Partial => {
                add(&st.pulls_partial, 1);
                self.log(&format!(
                    "load into pool {} for request {} was partial (policy {}); the blocks that loaded are recorded",
                    p.pool,
                    p.request_id,
                    policy_name(p.policy)
                ));
            }
            PullOutcome::Failed => {
                add(&st.pulls_failed, 1);
                self.log(&format!(
                    "load into pool {} for request {} failed (policy {})",
                    p.pool,
                    p.request_id,
                    policy_name(p.policy)
                ));
                return Ok(());
            }
        }
        if self.stopped_at_max {
            add(&st.lost_max_bytes, p.runs.len() as u64);
            return self.lose(p.pool, p.runs.len() as u64);
        }
        match self.ready(conn, p.src_pool, p.ts_ns) {
            Ready::Now => self.stamp(&p),
            Ready::Never(why) => self.unstamped(&p, &why),
            Ready::Wait => {
                let bytes = p.bytes();
                self.park(conn, view, Wait::Pull(p), bytes)
            }
        }
    }

    /// Writes a ready pull's runs (see [`W::pull`]).
    pub(super) fn stamp(&mut self, p: &XferPull) -> Result<()> {
        let st = &self.sh.stats;
        let dep = &self.sh.deployment;
        let src_cap = dep.pool(p.src_pool).map(|sp| sp.capacity_tokens);
        // The source pool's last event at or before the load, among those
        // written (events of one pool come in seq order on one connection).
        let src_seq = self.recent.get(&p.src_pool).and_then(|r| {
            // Older than the window kept: unknown, never the oldest kept.
            if r.len() >= RECENT && r.front().is_some_and(|f| f.0 > p.ts_ns) {
                return None;
            }
            r.iter().rev().find(|&&(ts, _)| ts <= p.ts_ns).map(|x| x.1)
        });
        if src_cap.is_none() || src_seq.is_none() {
            let why = if src_cap.is_none() {
                "no such pool in the deployment"
            } else {
                "the source pool has no recorded change at or before the load (no state to copy)"
            };
            return self.unstamped(p, why);
        }
        let src_cap = src_cap.unwrap_or(0);
        let src_seq = src_seq.unwrap_or(0);
        let page = |q: u16| dep.pool(q).map_or(0, |x| x.page_size);
        if p.src_blocks.is_none() && page(p.src_pool) != page(p.pool) {
            // Slot form: the hook mapped blocks to slots with its own block
            // size; with a source of another block size its runs would name
            // the wrong slots. A hole, never a guess (the block form, which
            // the sidecar expands with the source's page size, has none).
            add(&st.copies_unresolved, p.runs.len() as u64);
            self.log(&format!(
                "load into pool {} for request {} from pool {}: page sizes differ ({} vs {}) in a slot-form pull; recorded as lost events",
                p.pool,
                p.request_id,
                p.src_pool,
                page(p.src_pool),
                page(p.pool)
            ));
            return self.lose(p.pool, p.runs.len() as u64);
        }
        let what = format!("load into pool {} for request {}", p.pool, p.request_id);
        for c in p.copies(page(p.src_pool)) {
            // (A copy never spans runs, so its count fits a run's u32; its
            // start and token position may not: outside every pool.)
            let conv = c.and_then(|(dst, src, count, tpos)| {
                match (
                    u32::try_from(dst),
                    u32::try_from(count),
                    u32::try_from(tpos),
                ) {
                    (Ok(d), Ok(n), Ok(t)) => Ok((d, src, n, t)),
                    _ => Err(format!(
                        "a copy into slots {dst}..{} at token {tpos} is outside the u32 slot space",
                        dst + count
                    )),
                }
            });
            let (dst, src, count, tpos) = match conv {
                Ok(x) => x,
                Err(why) => {
                    add(&st.rejected_contract, 1);
                    self.log(&format!("{what}: {why}; recorded as a lost event"));
                    self.lose(p.pool, 1)?;
                    continue;
                }
            };
            if !self.src_in_range(&what, p.pool, p.src_pool, src, count, src_cap)? {
                continue;
            }
            let ev = copy_event(
                p.pool,
                p.ts_ns,
                p.request_id,
                dst,
                count,
                Some(tpos),
                p.src_pool,
                src as u32,
                src_seq,
            );
            if self.copy_run(&what, ev, src_cap)? {
                add(&st.pulls_written, 1);
            }
        }
        Ok(())
    }

    /// An engine copy between two pools of one connection: each run becomes
    /// one `write` with `src` on `pool`, stamped with the seq the hook's
    /// `src_pos` names, or one hole when it cannot be (one seq per run
    /// either way, so the connection's positions stay countable).
    pub(super) fn engine_copy(&mut self, conn: u64, c: &EngineCopy) -> Result<()> {
        let n = c.runs.len() as u64;
        if self.stopped_at_max {
            add(&self.sh.stats.lost_max_bytes, n);
            return self.lose(c.pool, n);
        }
        let src_seq = match self.copy_source(conn, c) {
            Ok(s) => s,
            Err(why) => {
                add(&self.sh.stats.copies_unresolved, n);
                self.log(&format!(
                    "copy into pool {} from pool {} at position {}: {why}; recorded as lost events",
                    c.pool, c.src_pool, c.src_pos
                ));
                return self.lose(c.pool, n);
            }
        };
        let src_cap = self
            .sh
            .deployment
            .pool(c.src_pool)
            .map_or(0, |p| p.capacity_tokens);
        let what = format!("copy into pool {}", c.pool);
        for &(dst, src, count) in &c.runs {
            let ev = copy_event(
                c.pool,
                c.ts_ns,
                c.request_id,
                dst,
                count,
                None,
                c.src_pool,
                src,
                src_seq,
            );
            self.copy_run(&what, ev, src_cap)?;
        }
        Ok(())
    }

    /// One run of a copy into `ev.pool` (a pull's load, an engine copy):
    /// written with its `src`, or a hole (a lost event, the reason logged
    /// after `what`) when it names slots past the source pool's
    /// `src_cap` or the Recorder refuses it. Whether it was written.
    fn copy_run(&mut self, what: &str, ev: KvEvent, src_cap: u64) -> Result<bool> {
        let src = ev.src.map_or((0, 0), |s| (s.pool, s.slot_start));
        if !self.src_in_range(what, ev.pool, src.0, src.1 as u64, ev.slot_count, src_cap)? {
            return Ok(false);
        }
        match self.rec.kv(ev) {
            Ok(seq) => {
                self.written(ev, seq);
                Ok(true)
            }
            Err(e) => {
                add(&self.sh.stats.rejected_contract, 1);
                self.log(&format!(
                    "{what} rejected (hole): {}",
                    e.to_string().replace('\n', " ")
                ));
                self.lose(ev.pool, 1)?;
                Ok(false)
            }
        }
    }

    /// Whether `count` slots of `src_pool` from `src` lie inside its
    /// `src_cap` slots; if not, a hole in `pool` (a lost event, the reason
    /// logged after `what`).
    fn src_in_range(
        &mut self,
        what: &str,
        pool: u16,
        src_pool: u16,
        src: u64,
        count: u32,
        src_cap: u64,
    ) -> Result<bool> {
        let end = src + count as u64;
        if end <= src_cap {
            return Ok(true);
        }
        add(&self.sh.stats.rejected_contract, 1);
        self.log(&format!(
            "{what} names slots {src}..{end} of pool {src_pool} ({src_cap} slots): out of range; recorded as a lost event"
        ));
        self.lose(pool, 1)?;
        Ok(false)
    }

    /// The source seq an engine copy's position names, or why there is none.
    fn copy_source(&self, conn: u64, c: &EngineCopy) -> std::result::Result<u64, String> {
        if let Some(why) = c.unsure {
            return Err(format!("positions of this connection are unknown ({why})"));
        }
        let dep = &self.sh.deployment;
        let (Some(sp), Some(dp)) = (dep.pool(c.src_pool), dep.pool(c.pool)) else {
            return Err("no such pool in the deployment".into());
        };
        if sp.page_size != dp.page_size {
            return Err(format!(
                "page sizes differ ({} vs {})",
                sp.page_size, dp.page_size
            ));
        }
        let pos = match self.positions.get(&c.src_pool) {
            Some(p) if p.conn == conn && !p.broken => p,
            Some(p) if p.conn == conn => {
                return Err(
                    "another connection's stream changed the source pool after this connection claimed it"
                        .into(),
                );
            }
            _ => return Err("the source pool is not held by this connection".into()),
        };
        if c.src_pos == 0 {
            return Err(
                "the source pool had no event on this connection before the copy (no state to copy)"
                    .into(),
            );
        }
        let next = self.rec.next_seq(c.src_pool).map_err(|e| e.to_string())?;
        let seen = next.saturating_sub(pos.base);
        if c.src_pos > seen {
            return Err(format!(
                "a source position never reported (the connection reported {seen} events of the pool)"
            ));
        }
        Ok(pos.base + c.src_pos - 1)
    }

    /// Remembers a written event's time for stamping later pulls.
    pub(super) fn note(&mut self, pool: u16, ts_ns: i64, seq: u64) {
        let r = self.recent.entry(pool).or_default();
        if r.len() >= RECENT {
            r.pop_front();
        }
        r.push_back((ts_ns, seq));
    }

    /// The `write`-with-src events of one commit (one per contiguous run).
    pub(super) fn copy_events(
        &self,
        c: &XferCommit,
        room: &Room,
    ) -> std::result::Result<Vec<KvEvent>, String> {
        let dep = &self.sh.deployment;
        let dst_pool = dep.pool(c.pool).ok_or("unknown decode pool")?;
        let ps = dst_pool.page_size as u64;
        let dst = expand(&c.dst_pages, dst_pool.capacity_tokens / ps)?;
        let mut out: Vec<KvEvent> = Vec::new();
        for ch in &room.chunks {
            let sp = dep.pool(ch.src_pool).ok_or("unknown source pool")?;
            if sp.page_size as u64 != ps {
                return Err(format!(
                    "page size {} of pool {} differs from {} of pool {}",
                    sp.page_size, ch.src_pool, ps, c.pool
                ));
            }
            let src = expand(&ch.src_pages, sp.capacity_tokens / ps)?;
            for (k, &s) in src.iter().enumerate() {
                let i = ch.dst_index as usize + k;
                let Some(&d) = dst.get(i) else {
                    // Destination shorter than the source: the transfer
                    // engine truncates (Mooncake warns); so do we.
                    break;
                };
                let (slot, src_slot) = (d as u64 * ps, s as u64 * ps);
                let tp = c.prefix_len as u64 + i as u64 * ps;
                if let Some(last) = out.last_mut()
                    && let Some(ls) = last.src
                    && last.slot_end() == slot
                    && ls.slot_start as u64 + last.slot_count as u64 == src_slot
                    && ls.pool == ch.src_pool
                    && ls.seq == ch.src_seq
                    && (last.slot_count as u64 + ps) <= u32::MAX as u64
                {
                    last.slot_count += ps as u32;
                    continue;
                }
                out.push(KvEvent {
                    pool: c.pool,
                    seq: 0,
                    ts_ns: c.ts_ns,
                    request_id: c.request_id,
                    op: Op::Write,
                    slot_start: u32::try_from(slot).map_err(|_| "slot beyond u32")?,
                    slot_count: ps as u32,
                    token_pos: u32::try_from(tp).ok(),
                    src: Some(CopySrc {
                        pool: ch.src_pool,
                        slot_start: u32::try_from(src_slot).map_err(|_| "slot beyond u32")?,
                        seq: ch.src_seq,
                    }),
                });
            }
        }
        Ok(out)
    }
}

/// A run list as page ids, after checking it fits a pool of `pages` pages.
fn expand(runs: &[PageRun], pages: u64) -> std::result::Result<Vec<u32>, String> {
    let mut total = 0u64;
    for &(s, n) in runs {
        if s as u64 + n as u64 > pages {
            return Err(format!(
                "pages {s}..{} outside the pool ({pages} pages)",
                s as u64 + n as u64
            ));
        }
        total += n as u64;
        if total > pages {
            return Err(format!("more pages than the pool holds ({pages})"));
        }
    }
    let mut v = Vec::with_capacity(total as usize);
    for &(s, n) in runs {
        // In u64: `s + n` may be 2^32 (the last page of a 2^32-page pool).
        v.extend((s as u64..s as u64 + n as u64).map(|p| p as u32));
    }
    Ok(v)
}

fn policy_name(p: Option<LoadPolicy>) -> &'static str {
    match p {
        Some(LoadPolicy::Fail) => "fail",
        Some(LoadPolicy::Recompute) => "recompute",
        None => "not reported",
    }
}

/// A copy run as the event it is: a `write` on `pool` whose content comes
/// from `count` slots of `src_pool` at `src_slot`, as of `src_seq`.
#[allow(clippy::too_many_arguments)]
fn copy_event(
    pool: u16,
    ts_ns: i64,
    request_id: u64,
    dst: u32,
    count: u32,
    token_pos: Option<u32>,
    src_pool: u16,
    src_slot: u32,
    src_seq: u64,
) -> KvEvent {
    KvEvent {
        pool,
        seq: 0,
        ts_ns,
        request_id,
        op: Op::Write,
        slot_start: dst,
        slot_count: count,
        token_pos,
        src: Some(CopySrc {
            pool: src_pool,
            slot_start: src_slot,
            seq: src_seq,
        }),
    }
}
