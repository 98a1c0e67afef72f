//! Pools no copy connects, replayed at once: each group of the copy graph
//! (`sched::groups`) runs its own scheduler on a thread of its own with a
//! forked backend (`Backend::forks`), and their read runs come back through
//! a bounded channel to the one `Exposures` of the replay. Many small
//! groups are packed into a few work units first (`pack`).
//!
//! Nothing a group computes depends on another group, so the outcome is
//! the single scheduler's: exposures aggregate independently of the order
//! runs arrive in, counters add, gaps are sorted and each pool's late
//! sources belong to its one group. Memory is the single scheduler's plus
//! at most `RUN_BATCHES` batches of read runs in flight.
//!
//! The same runner replays units that copy to each other (every pool on a
//! thread of its own) when given an `Exchange`: each unit's scheduler
//! hands the copies it captures for another unit to the exchange and takes
//! the copies it applies from there (`lineage::exchange`); every unit then
//! needs a thread of its own, and the caller gives one per unit.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::backend::{Backend, Counters, ReadRun};
use super::exchange::Exchange;
use super::exposure::Exposures;
use super::input::Plan;
use super::sched::Gap;
use super::sched::Sched;
use super::shard;
use crate::error::{Error, Result};
use crate::progress::Reporter;
use crate::trace::read::Trace;

/// Batches of read runs in flight from the groups to the aggregation.
const RUN_BATCHES: usize = 64;

/// Work units per thread: groups are packed into at most this many units
/// per thread, so that thousands of small groups cost a few schedulers,
/// not one each.
const UNITS_PER_THREAD: usize = 4;

/// Packs `groups` into at most `threads * UNITS_PER_THREAD` units of
/// similar event counts (largest group first, into the lightest unit; ties
/// by position, so the packing is deterministic). A union of groups is
/// closed under copies as each group is, so a unit replays on its own.
pub fn pack(plan: &Plan, groups: Vec<BTreeSet<u16>>, threads: usize) -> Vec<BTreeSet<u16>> {
    let n = (threads * UNITS_PER_THREAD).max(1);
    if groups.len() <= n {
        return groups;
    }
    let events = |g: &BTreeSet<u16>| -> u64 {
        g.iter()
            .flat_map(|p| plan.runs.get(p).into_iter().flatten())
            .map(|r| r.rows)
            .sum()
    };
    let mut sized: Vec<(u64, usize, BTreeSet<u16>)> = groups
        .into_iter()
        .enumerate()
        .map(|(i, g)| (events(&g), i, g))
        .collect();
    sized.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut units: Vec<(u64, BTreeSet<u16>)> = vec![(0, BTreeSet::new()); n];
    for (e, _, g) in sized {
        let (_, lightest) = units
            .iter()
            .enumerate()
            .map(|(i, u)| (u.0, i))
            .min()
            .expect("a unit");
        units[lightest].0 += e;
        units[lightest].1.extend(g);
    }
    units.into_iter().map(|u| u.1).collect()
}

/// A thread's leaving of the exchange: done, and failed unless it ended
/// well.
struct Leave<'a> {
    exchange: Option<&'a Exchange>,
    ok: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if let Some(x) = self.exchange {
            if !self.ok {
                x.fail();
            }
            x.thread_done();
        }
    }
}

/// What a replay of some groups gives: counters, sorted gaps, late sources.
pub type GroupsOutcome = (Counters, Vec<Gap>, BTreeMap<u16, (u64, u64)>);

/// What to replay on the threads: the units (sets of pools), and the
/// exchange their copies pass through when they copy to each other.
pub struct Units<'a> {
    pub pools: &'a [BTreeSet<u16>],
    pub exchange: Option<&'a Exchange>,
}

/// Replays the units of `plan` on one thread per backend of `forks`, each
/// thread taking the next unit left; read runs go to `exposures` (of the
/// `reported` pools only, for a shard). The first error of any unit is
/// returned (the caller replays again on one scheduler for the error a
/// single-threaded run gives).
pub fn run(
    trace: &Trace,
    plan: &Plan,
    forks: Vec<Box<dyn Backend + Send>>,
    units: Units<'_>,
    reported: Option<&BTreeSet<u16>>,
    reporter: &dyn Reporter,
    exposures: &mut Exposures,
) -> Result<GroupsOutcome> {
    let Units {
        pools: groups,
        exchange,
    } = units;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<ReadRun>>(RUN_BATCHES);
    let results: Vec<Result<GroupsOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = forks
            .into_iter()
            .map(|mut backend| {
                let (tx, next, failed) = (tx.clone(), &next, &failed);
                s.spawn(move || -> Result<GroupsOutcome> {
                    // Leaves the exchange however the thread ends (an
                    // error or a panic fails the others' waits).
                    let mut leave = Leave {
                        exchange,
                        ok: false,
                    };
                    let mut counters = Counters::default();
                    let mut gaps = Vec::new();
                    let mut late = BTreeMap::new();
                    let mut wrapped;
                    let backend: &mut dyn Backend = match reported {
                        Some(r) => {
                            wrapped = shard::Reported::new(backend.as_mut(), r.clone());
                            &mut wrapped
                        }
                        None => backend.as_mut(),
                    };
                    let mut sink = |runs: &[ReadRun]| {
                        let _ = tx.send(runs.to_vec());
                    };
                    loop {
                        let g = next.fetch_add(1, Ordering::Relaxed);
                        let Some(pools) = groups.get(g) else { break };
                        if failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let r = Sched::for_pools(
                            trace,
                            plan,
                            Some(pools),
                            backend,
                            reporter,
                            &mut sink,
                        )
                        .map(|sched| match exchange {
                            Some(x) => sched.with_exchange(x),
                            None => sched,
                        })
                        .and_then(|mut sched| {
                            sched.run()?;
                            Ok((
                                sched.counters,
                                sched.gaps.clone(),
                                sched.late_sources.clone(),
                            ))
                        });
                        match r {
                            Ok((c, g, l)) => {
                                counters.add(&c);
                                gaps.extend(g);
                                late.extend(l);
                                if let Some(x) = exchange {
                                    x.pools_done(pools);
                                }
                            }
                            Err(e) => {
                                failed.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                        }
                    }
                    leave.ok = true;
                    Ok((counters, gaps, late))
                })
            })
            .collect();
        drop(tx);
        for runs in rx {
            exposures.add_runs(&runs);
        }
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Other("replay: a group's thread panicked".into()))
                })
            })
            .collect()
    });
    let mut counters = Counters::default();
    let mut gaps = Vec::new();
    let mut late = BTreeMap::new();
    for r in results {
        let (c, g, l) = r?;
        counters.add(&c);
        gaps.extend(g);
        late.extend(l);
    }
    if let Some((pool, seq)) = exchange.and_then(Exchange::leftover) {
        return Err(Error::Other(format!(
            "replay: the copy at pool {pool} seq {seq} was captured but never applied"
        )));
    }
    gaps.sort_by_key(|g: &Gap| (g.pool, g.after_seq, g.before_seq));
    Ok((counters, gaps, late))
}
