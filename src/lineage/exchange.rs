//! Copies between pools that replay on threads of their own: the captured
//! source content of a copy passes from the source pool's thread to the
//! destination's through here.
//!
//! The rule is the causal merge's (`sched`): a destination waits only
//! while its next event is a copy whose source pool has not yet moved past
//! the copy's `src_seq` (the source captures each planned copy just before
//! that, as on one scheduler, and puts it here). A source never waits for
//! its destinations, except to bound memory: while more than
//! [`PAYLOAD_LIMIT`] bytes of captured content wait here, a source that
//! captures more is held back, as long as another thread is still running
//! (so the replay always moves; past the limit only as far as one
//! scheduler would hold). Two copies that wait on each other, a copy whose
//! source pool ended without capturing it, or a failure on any thread end
//! the replay with an error; the caller replays again on one scheduler for
//! the error a single-threaded run gives.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::backend::Payload;
use crate::error::{Error, Result};

/// Captured content waiting for its destination, before sources are held
/// back (16 MiB).
pub const PAYLOAD_LIMIT: usize = 16 << 20;

/// Copy payloads in flight between units (threads) of one replay.
pub struct Exchange {
    state: Mutex<State>,
    cv: Condvar,
    limit: usize,
    /// The unit each pool replays in.
    unit_of: HashMap<u16, usize>,
}

struct State {
    /// A B-tree, not a hash table: payloads come and go all the replay
    /// long, and a hash table's deleted entries made it double its table
    /// at half load (12.8 to 25.7 MB at the limit's 127k payloads); a
    /// tree's memory follows the payloads present.
    payloads: BTreeMap<(u16, u64), Payload>,
    bytes: usize,
    /// Unit -> the unit it waits on for a copy's source.
    waiting_on: HashMap<usize, usize>,
    /// Pools whose stream has ended (everything they capture is here).
    done: HashSet<u16>,
    /// Threads that are neither waiting, held back nor finished.
    running: usize,
    /// Threads waiting for a copy, and sources held back.
    waiters: usize,
    held: usize,
    failed: bool,
    /// Applied payloads handed back (cleared) for the sources' next
    /// captures, at most `SPARES`.
    spares: Vec<Payload>,
}

/// Cleared payloads the exchange keeps for the sources' captures.
const SPARES: usize = 256;

/// A payload larger than this (`Payload::bytes`, its capacity) is dropped
/// once applied, not kept for reuse: spares hold at most a few MiB.
pub const SPARE_MAX_BYTES: usize = 16 << 10;

fn bytes_of(p: &Payload) -> usize {
    p.bytes()
}

impl Exchange {
    /// An exchange between `units` (each a set of pools), each replayed on
    /// one of `threads` threads, holding back sources past `limit` bytes.
    pub fn new(units: &[std::collections::BTreeSet<u16>], threads: usize, limit: usize) -> Self {
        let unit_of = units
            .iter()
            .enumerate()
            .flat_map(|(u, pools)| pools.iter().map(move |&p| (p, u)))
            .collect();
        Exchange {
            state: Mutex::new(State {
                payloads: BTreeMap::new(),
                bytes: 0,
                waiting_on: HashMap::new(),
                done: HashSet::new(),
                running: threads,
                waiters: 0,
                held: 0,
                failed: false,
                spares: Vec::new(),
            }),
            cv: Condvar::new(),
            limit,
            unit_of,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock fails the replay
        // anyway (its join reports it); the state stays consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(s).unwrap_or_else(|e| e.into_inner())
    }

    fn aborted() -> Error {
        Error::Other("replay: another pool's thread failed".into())
    }

    /// The captured source of the copy at (`pool`, `seq`), whose source is
    /// `src_pool`: waits until the source pool has captured it. `used`, an
    /// applied copy's payload, is kept (cleared) for a source's next
    /// capture (`put` hands it out), so copies allocate nothing.
    pub fn take(
        &self,
        pool: u16,
        seq: u64,
        src_pool: u16,
        used: Option<Payload>,
    ) -> Result<Payload> {
        let me = self.unit_of.get(&pool).copied();
        let src = self.unit_of.get(&src_pool).copied();
        let (Some(me), Some(src)) = (me, src) else {
            return Err(Error::Other(format!(
                "replay: unknown source pool {src_pool}"
            )));
        };
        let mut s = self.lock();
        if let Some(mut u) = used
            && s.spares.len() < SPARES
            && u.bytes() <= SPARE_MAX_BYTES
        {
            u.clear();
            s.spares.push(u);
        }
        loop {
            if s.failed {
                return Err(Self::aborted());
            }
            if let Some(p) = s.payloads.remove(&(pool, seq)) {
                s.bytes -= bytes_of(&p);
                // A held source goes on once half the limit is free (not
                // at every copy taken).
                if s.held > 0 && s.bytes <= self.limit / 2 {
                    self.cv.notify_all();
                }
                return Ok(p);
            }
            if s.done.contains(&src_pool) {
                s.failed = true;
                self.cv.notify_all();
                return Err(Error::Other(format!(
                    "replay: no captured source for the copy at pool {pool} seq {seq}"
                )));
            }
            // Waiting on a unit that (through others) waits on this one:
            // no order applies both copies.
            let mut at = src;
            for _ in 0..=s.waiting_on.len() {
                match s.waiting_on.get(&at) {
                    Some(&next) if next == me => {
                        s.failed = true;
                        self.cv.notify_all();
                        return Err(Error::Other(format!(
                            "replay: copies wait on each other (pool {pool} seq {seq})"
                        )));
                    }
                    Some(&next) => at = next,
                    None => break,
                }
            }
            s.waiting_on.insert(me, src);
            s.running -= 1;
            s.waiters += 1;
            if s.held > 0 {
                // One fewer thread runs: a held source may have to go on.
                self.cv.notify_all();
            }
            s = self.wait(s);
            s.waiters -= 1;
            s.running += 1;
            s.waiting_on.remove(&me);
        }
    }

    /// Puts the captured source of the copy at (`pool`, `seq`); holds the
    /// caller back while too much waits here and another thread runs.
    /// Returns a payload a destination handed back, if any, for the
    /// caller's next capture.
    pub fn put(&self, pool: u16, seq: u64, payload: Payload) -> Result<Option<Payload>> {
        let mut s = self.lock();
        if s.failed {
            return Err(Self::aborted());
        }
        s.bytes += bytes_of(&payload);
        if s.payloads.insert((pool, seq), payload).is_some() {
            s.failed = true;
            self.cv.notify_all();
            return Err(Error::Other(format!(
                "replay: the copy at pool {pool} seq {seq} was captured twice"
            )));
        }
        if s.waiters > 0 {
            self.cv.notify_all();
        }
        if s.bytes > self.limit {
            // Held until half the limit is free again, or no other thread
            // runs.
            while s.bytes > self.limit / 2 && s.running > 1 && !s.failed {
                s.running -= 1;
                s.held += 1;
                self.cv.notify_all();
                s = self.wait(s);
                s.held -= 1;
                s.running += 1;
            }
        }
        if s.failed {
            return Err(Self::aborted());
        }
        Ok(s.spares.pop())
    }

    /// The streams of `pools` have ended.
    pub fn pools_done(&self, pools: &std::collections::BTreeSet<u16>) {
        let mut s = self.lock();
        s.done.extend(pools.iter().copied());
        self.cv.notify_all();
    }

    /// A thread has no more units to replay.
    pub fn thread_done(&self) {
        let mut s = self.lock();
        s.running -= 1;
        self.cv.notify_all();
    }

    /// A thread failed: every other one stops at its next copy.
    pub fn fail(&self) {
        let mut s = self.lock();
        s.failed = true;
        self.cv.notify_all();
    }

    /// Whether any thread failed.
    pub fn failed(&self) -> bool {
        self.lock().failed
    }

    /// A copy captured but never applied, once every thread is done.
    pub fn leftover(&self) -> Option<(u16, u64)> {
        self.lock().payloads.keys().next().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn units(n: u16) -> Vec<BTreeSet<u16>> {
        (0..n).map(|p| BTreeSet::from([p])).collect()
    }

    fn val(owner: u64) -> Payload {
        std::iter::once(crate::lineage::backend::SlotVal {
            owner,
            uncertain: false,
            stale: false,
        })
        .collect()
    }

    #[test]
    fn a_destination_waits_for_the_capture_and_a_source_past_the_limit_waits_for_it() {
        let x = Exchange::new(&units(2), 2, 0);
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                // Pool 1 takes two copies from pool 0, the first before
                // pool 0 has captured it.
                let a = x.take(1, 10, 0, None).unwrap();
                let b = x.take(1, 11, 0, None).unwrap();
                x.pools_done(&BTreeSet::from([1]));
                x.thread_done();
                (a.runs()[0].1.owner, b.runs()[0].1.owner)
            });
            // Limit 0: each put holds pool 0 back until pool 1 took it or
            // is the only other thread and waits.
            x.put(1, 10, val(7)).unwrap();
            x.put(1, 11, val(8)).unwrap();
            x.pools_done(&BTreeSet::from([0]));
            x.thread_done();
            assert_eq!(t.join().unwrap(), (7, 8));
        });
        assert_eq!(x.leftover(), None);
    }

    #[test]
    fn an_applied_payload_handed_back_is_reused_cleared_by_the_next_capture() {
        let x = Exchange::new(&units(2), 2, PAYLOAD_LIMIT);
        assert!(x.put(1, 10, val(7)).unwrap().is_none());
        let a = x.take(1, 10, 0, None).unwrap();
        assert_eq!(a.runs()[0].1.owner, 7);
        assert!(x.put(1, 11, val(8)).unwrap().is_none());
        let b = x.take(1, 11, 0, Some(a)).unwrap();
        assert_eq!(b.runs()[0].1.owner, 8);
        let back = x
            .put(1, 12, val(9))
            .unwrap()
            .expect("the payload handed back");
        assert!(back.is_empty() && back.runs().is_empty());
        assert!(x.put(1, 13, val(9)).unwrap().is_none());
        // A large payload is dropped, not kept.
        let big: Payload = (0..SPARE_MAX_BYTES as u64)
            .map(|owner| crate::lineage::backend::SlotVal {
                owner,
                uncertain: false,
                stale: false,
            })
            .collect();
        assert!(x.put(1, 20, val(1)).unwrap().is_none());
        x.take(1, 20, 0, Some(big)).unwrap();
        assert!(x.put(1, 21, val(2)).unwrap().is_none());
    }

    #[test]
    fn copies_that_wait_on_each_other_and_a_source_that_ended_fail() {
        let x = Exchange::new(&units(2), 2, PAYLOAD_LIMIT);
        std::thread::scope(|s| {
            let t = s.spawn(|| x.take(1, 5, 0, None));
            // Either the second to wait sees the cycle, or the first is
            // woken by the failure.
            let r0 = x.take(0, 5, 1, None);
            let r1 = t.join().unwrap();
            assert!(r0.is_err() && r1.is_err());
            assert!(x.failed());
        });
        let x = Exchange::new(&units(2), 2, PAYLOAD_LIMIT);
        x.pools_done(&BTreeSet::from([0]));
        let e = x.take(1, 3, 0, None).unwrap_err().to_string();
        assert!(e.contains("no captured source"), "{e}");
    }
}
