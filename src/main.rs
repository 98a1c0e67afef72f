//! The `kvtrail` binary: a thin shell over the library; `cli` holds one
//! module per subcommand.

mod cli;

fn main() {
    tune_malloc();
    std::process::exit(cli::run());
}

/// glibc's malloc raises its mmap threshold to the largest block freed, so
/// the replay's megabyte-sized buffers (Parquet pages, batches, hash tables
/// that grew) end up in per-thread arenas that keep them after they are
/// freed: a seed-scale scope held about 410 MB of RSS for some 210 MB of
/// live heap. Fixed thresholds hand blocks of 256 KiB and more straight
/// back to the system when freed, at no cost in time (docs/fleet.md, "Seed
/// scale"). Other allocators are left as they are.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    // SAFETY: mallopt only sets allocator parameters; it is called before
    // any thread is started.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}
