//! The `kvtrail` binary: a thin shell over the library; `cli` holds one
//! module per subcommand.

mod cli;

fn main() {
    tune_malloc();
    // rayon's global pool (the parallel steps outside a replay) would
    // otherwise start as many threads as RAYON_NUM_THREADS says, however
    // many; building it fails only when it exists, which it cannot yet.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(kvtrail::lineage::default_threads())
        .build_global();
    std::process::exit(cli::run());
}

/// glibc's malloc raises its mmap threshold to the largest block freed, so
/// the replay's megabyte-sized buffers (Parquet pages, batches, hash tables
/// that grew) end up in per-thread arenas that keep them after they are
/// freed: a seed-scale scope held about 410 MB of RSS for some 210 MB of
/// live heap. Fixed thresholds hand blocks of 4 MiB and more straight back
/// to the system when freed (docs/fleet.md, "Seed scale"). Smaller blocks
/// stay in the arenas for the next batch: with a threshold of 256 KiB,
/// every decoded Parquet page and string column of a batch was a fresh
/// mapping, faulted in and zeroed again batch after batch (a PD trace of
/// 10^7 events on 2 threads: 260,000 to 380,000 page faults and about 1 s
/// of kernel time, against 75,000 to 100,000 and 0.5 s at 4 MiB, for the
/// same peak RSS at 10^8 events). The arenas are capped at half the cores
/// (at least 2): each thread's arena kept its own freed small blocks,
/// which grew with the run (at 2 million requests, 2 arenas instead of
/// glibc's default of 8 a core took scope from 231 to 203 MiB, and from
/// 198 to 182 MiB at 233,000, at no cost in time). Other allocators are
/// left as they are.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let arenas = (cores / 2).max(2) as libc::c_int;
    // SAFETY: mallopt only sets allocator parameters; it is called before
    // any thread is started.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 8 << 20);
        libc::mallopt(libc::M_ARENA_MAX, arenas);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}
