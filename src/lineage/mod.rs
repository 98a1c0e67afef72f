//! Replay: the streaming lineage engine. Re-runs every pool's KV events in
//! seq order, follows copies between pools (a causal merge of the pools'
//! streams: a copy waits for its source pool's `src_seq`) and classifies
//! every read as own, shared, blank, unknown, uncertain or foreign, exactly
//! as the "Semantics" section of the trace format says.
//!
//! - `input`: plans the per-pool seq-ordered streams (k-way merge of sorted
//!   runs, external sort of unsorted ones) and the copies.
//! - `sched`: the scheduler (pool turns, copies pulled across pools, gaps).
//! - `rule`: the slot rule, the one transition every backend applies
//!   (`PoolState::apply`), over `stale` (stale bits) and `grants` (share
//!   grants, spilled past a limit); `state`: slot values and `classify`.
//! - `backend` / `cpu`: the per-slot state behind a batch-shaped trait;
//!   `slots`: the paged slot table (pages allocated on first write);
//!   `gpu`: the same on a device (CUDA or the emulator).
//! - `exposure`: aggregation of read runs per reader and source.
//! - `groups`: pools no copy connects replayed at once, a thread each.
//!
//! Memory: the slot pages the trace writes, copy payloads in flight, one
//! batch per open run, share grants and the exposure sets. Nothing here
//! holds the trace's events or grows with a pool's declared capacity.

pub mod ahead;
pub mod backend;
pub mod chains;
pub mod config;
pub mod copies;
pub mod cpu;
pub mod exchange;
pub mod exposure;
pub mod gpu;
mod grant_spill;
pub mod grants;
pub mod groups;
pub mod input;
pub mod intervals;
pub mod rule;
pub mod sched;
pub mod shard;
pub mod shared_read;
pub mod slots;
pub mod stale;
pub mod state;

use std::collections::BTreeMap;
use std::path::Path;

pub use backend::{Backend, Counters, ReadKind, ReadRun, SlotVal};
pub use config::{
    BackendChoice, BackendConfig, MAX_THREADS, OpenedBackend, default_threads, on_threads,
    threads_or_default,
};
pub use exposure::Exposures;
pub use sched::Gap;

use crate::error::Result;
use crate::progress::Reporter;
use crate::trace::read::Trace;

/// Options of a replay.
#[derive(Debug, Clone, Default)]
pub struct LineageOptions {
    pub backend: BackendChoice,
    /// Where unsorted files and large copy indexes are spilled (default:
    /// the system temp dir).
    pub spill_dir: Option<std::path::PathBuf>,
    /// Events (external sort), copies (copy index) and share grants (per
    /// pool, CPU backend) held in memory before spilling; None = the
    /// defaults (`input::SPILL_CHUNK_EVENTS`, `copies::COPY_CHUNK`,
    /// `state::GRANTS_IN_MEMORY`). Small values exercise the spill paths.
    pub chunk: Option<usize>,
    /// Report only these pools (a shard, see `shard`); the pools their
    /// copies read from are replayed too, but not reported. None: all.
    pub pools: Option<Vec<u16>>,
    /// Requests' tenants: shared reads within one tenant are dropped as
    /// they arrive (scope lists only cross-tenant prefix-cache hits).
    pub tenants: Option<exposure::TenantKeysSource>,
    /// Threads of the replay (0: the default, `threads_or_default`): of the index pass
    /// over the kv files, and of the CPU backend `run` opens (`run_with`
    /// takes the backend's own). The outcome is the same for every value.
    pub threads: usize,
    /// Whether the pools of a copy-connected group replay on threads of
    /// their own (`exchange`) when there are fewer groups than threads:
    /// None decides by the events (`pool_threads_pay`); tests force it.
    pub pool_threads: Option<bool>,
}

/// Whether pools on threads of their own beat slot shards for `groups`:
/// only when no pool holds more than two thirds of its group's events
/// (the heaviest pool bounds a pipeline; a PD pair whose decode pool
/// holds nearly every event gains nothing from running its prefill pool
/// beside it, and its decode batches lose the slot shards' threads:
/// `examples/bench_threads.rs`, one PD pair, 0.84x).
pub fn pool_threads_pay(plan: &input::Plan, groups: &[std::collections::BTreeSet<u16>]) -> bool {
    let events = |p: &u16| -> u64 { plan.runs.get(p).into_iter().flatten().map(|r| r.rows).sum() };
    groups.iter().filter(|g| g.len() > 1).any(|g| {
        let all: u64 = g.iter().map(events).sum();
        let top = g.iter().map(events).max().unwrap_or(0);
        all > 0 && top.saturating_mul(3) <= all.saturating_mul(2)
    })
}

/// Everything replay found.
#[derive(Debug, Clone)]
pub struct LineageOutcome {
    pub backend: &'static str,
    pub exposures: Exposures,
    pub counters: Counters,
    pub gaps: Vec<Gap>,
    /// Copies whose src_seq lies past the last recorded event of their
    /// source pool: pool -> (lowest, highest) such src_seq.
    pub late_sources: BTreeMap<u16, (u64, u64)>,
    /// Events that went through the external sort.
    pub spilled_events: u64,
    /// Copies whose index entries were spilled to disk.
    pub spilled_copies: u64,
    pub kv_files: usize,
}

/// Replays a trace with a backend.
///
/// With a backend on several threads that can fork (the CPU one), pools
/// no copy connects (`sched::groups`) replay at once, a group per thread,
/// each batch on the group's share of the threads; with fewer groups than
/// threads, every pool replays on a thread of its own and copies pass
/// between them under the causal merge (`exchange`: a copy waits only for
/// its source pool's src_seq). The outcome is the same either way:
/// exposures aggregate independently of the order runs arrive in, counters
/// add, gaps are sorted. A replay that fails on groups is run again on one
/// scheduler, so that its error is the one a single-threaded run reports.
pub fn run_with(
    trace: &Trace,
    backend: &mut dyn Backend,
    opts: &LineageOptions,
    reporter: &dyn Reporter,
) -> Result<LineageOutcome> {
    keep_freed_memory();
    reporter.start("index", trace.kv_files.len() as u64);
    if let Some(chunk) = opts.chunk {
        backend.limit_grants(chunk);
    }
    let spill = opts.spill_dir.as_deref().map(Path::new);
    // With cores the index pass leaves idle (it reads the kv files one a
    // core), the first kv file's rows are decoded for the replay while it
    // plans (`ahead`).
    let started = (backend.threads() > trace.kv_files.len())
        .then(|| ahead::start(trace, 0, shared_read::QUEUE_EVENTS))
        .flatten();
    let mut plan = on_threads(opts.threads, || {
        input::Plan::build(trace, spill, opts.chunk)
    })??;
    reporter.advance(trace.kv_files.len() as u64);
    reporter.finish();
    // A shard: restrict the plan, hide the source-only pools' reads.
    let reported: Option<std::collections::BTreeSet<u16>> = match &opts.pools {
        Some(pools) => {
            shard::restrict(&mut plan, pools)?;
            Some(pools.iter().copied().collect())
        }
        None => None,
    };
    // Kept only for a replay that reads the file (not sorted, split or
    // restricted away): else nobody takes it and its memory is dropped.
    if let Some(s) = started.filter(|_| plan.reads_file(0)) {
        plan.ahead = s.finish();
    }
    let new_exposures = || Exposures {
        tenant_source: opts.tenants.clone(),
        ..Default::default()
    };
    reporter.start("replay", plan.total_events);
    let mut grouped = None;
    let threads = backend.threads();
    let groups = sched::groups(&plan);
    // Fewer groups than threads, and a group of several pools: every pool
    // on a thread of its own, copies through an exchange; else the groups
    // packed onto the threads.
    // (At most two pools per thread: each pool on its thread holds a
    // stream open from the start.)
    let by_pool = threads > 1
        && groups.len() < threads
        && plan.order.len() > groups.len()
        && plan.order.len() <= 2 * threads
        && opts
            .pool_threads
            .unwrap_or_else(|| pool_threads_pay(&plan, &groups));
    let units: Vec<std::collections::BTreeSet<u16>> = if by_pool {
        plan.order
            .iter()
            .map(|&p| std::collections::BTreeSet::from([p]))
            .collect()
    } else {
        groups
    };
    if threads > 1 && units.len() > 1 {
        // One thread per unit when units wait on each other (each must be
        // running for its copies to move).
        let workers = if by_pool {
            units.len()
        } else {
            threads.min(units.len())
        };
        if let Some(forks) = backend.forks(workers, (threads / workers).max(1)) {
            let units = if by_pool {
                units
            } else {
                groups::pack(&plan, units, workers)
            };
            let exchange =
                by_pool.then(|| exchange::Exchange::new(&units, workers, exchange::PAYLOAD_LIMIT));
            let mut exposures = new_exposures();
            let res = groups::run(
                trace,
                &plan,
                forks,
                groups::Units {
                    pools: &units,
                    exchange: exchange.as_ref(),
                },
                reported.as_ref(),
                reporter,
                &mut exposures,
            );
            match res {
                Ok(r) => grouped = Some((exposures, r)),
                Err(_) => {
                    // Replayed again below on one scheduler, for its error.
                    reporter.finish();
                    reporter.start("replay", plan.total_events);
                }
            }
        }
    }
    let (exposures, (counters, gaps, late)) = match grouped {
        Some(g) => g,
        None => {
            let mut shard_backend;
            let backend: &mut dyn Backend = match &reported {
                Some(r) => {
                    shard_backend = shard::Reported::new(backend, r.clone());
                    &mut shard_backend
                }
                None => backend,
            };
            let mut exposures = new_exposures();
            let mut sink = |runs: &[ReadRun]| exposures.add_runs(runs);
            let r = {
                let mut sched = sched::Sched::new(trace, &plan, backend, reporter, &mut sink)?;
                sched.run()?;
                (
                    sched.counters,
                    sched.gaps.clone(),
                    sched.late_sources.clone(),
                )
            };
            (exposures, r)
        }
    };
    reporter.finish();
    let (gaps, spilled_events) = match &reported {
        Some(r) => (
            gaps.into_iter().filter(|g| r.contains(&g.pool)).collect(),
            shard::spilled_events(&plan, r),
        ),
        None => (gaps, plan.spilled_events),
    };
    Ok(LineageOutcome {
        backend: backend.name(),
        exposures,
        counters,
        gaps,
        late_sources: late,
        spilled_events,
        spilled_copies: plan.copies.spilled,
        kv_files: plan.files.len(),
    })
}

/// Replays a trace with the chosen backend.
pub fn run(
    trace: &Trace,
    opts: &LineageOptions,
    reporter: &dyn Reporter,
) -> Result<LineageOutcome> {
    let mut b = BackendConfig::new(opts.backend, opts.threads)
        .open(trace)?
        .backend;
    run_with(trace, b.as_mut(), opts, reporter)
}

/// How much freed memory the allocator keeps at the top of each heap
/// rather than giving back to the kernel (glibc `M_TOP_PAD`).
const KEEP_FREED_BYTES: i32 = 64 << 20;

/// Keeps memory a replay frees for its next batch. A replay allocates and
/// frees batch-sized buffers on its reader and replay threads all the way
/// through; glibc's default gives the top of each thread's heap back to
/// the kernel and takes it again a batch later, so every batch pays page
/// faults and the kernel zeroing fresh pages (on a prefill-to-decode
/// trace a third of the CPU time was the kernel's, 83,000 page faults for
/// a 125 MB peak). Padding the heaps by [`KEEP_FREED_BYTES`] keeps that
/// memory in the process: the faults drop to a third and the kernel's
/// time to half, for about 10 MB more peak RSS (docs/replay-and-scope.md).
/// The pad is bounded, so memory still follows the pools touched, not the
/// trace's length. Set once per process; other allocators are left alone.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only changes the allocator's tuning parameters.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_TOP_PAD, KEEP_FREED_BYTES);
        });
    }
}
