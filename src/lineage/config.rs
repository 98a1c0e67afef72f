//! The replay backend and its threads, decided once: the one table of
//! backends with their command-line names ([`BackendChoice`]), the one
//! default rule for threads ([`threads_or_default`]: 0 means
//! `RAYON_NUM_THREADS` or every core) and the one constructor
//! ([`BackendConfig::open`]). Every command that replays resolves its
//! `--backend` and `--threads` here; `auto` probes libcuda, NVRTC and a
//! device first and says why it fell back to the CPU.

use super::backend::Backend;
use super::cpu::CpuBackend;
use super::gpu;
use crate::error::{Error, Result};
use crate::trace::read::Trace;

/// Which backend to replay with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when this build has the `cuda` feature and a driver, NVRTC and
    /// a device are found; the CPU otherwise.
    #[default]
    Auto,
    Cpu,
    /// CUDA or a tool error.
    Cuda,
    /// The GPU backend on the emulated device (kernels compiled as C++, run
    /// one thread at a time): for tests and debugging, slow.
    Emu,
}

/// The table of backends: each choice, its name on the command line, its
/// help line, and whether `--help` lists it.
const BACKENDS: [(BackendChoice, &str, &str, bool); 4] = [
    (
        BackendChoice::Auto,
        "auto",
        "CUDA when built with `--features cuda` and a GPU is usable, else CPU",
        false,
    ),
    (
        BackendChoice::Cpu,
        "cpu",
        "The CPU reference backend",
        false,
    ),
    (
        BackendChoice::Cuda,
        "cuda",
        "The CUDA backend (exit 2 when it cannot run here)",
        false,
    ),
    (
        BackendChoice::Emu,
        "emu",
        "The GPU kernels emulated on the CPU (tests and debugging; slow)",
        true,
    ),
];

impl BackendChoice {
    /// Every choice, in the table's order.
    pub const ALL: [BackendChoice; 4] = [
        BackendChoice::Auto,
        BackendChoice::Cpu,
        BackendChoice::Cuda,
        BackendChoice::Emu,
    ];

    fn row(self) -> &'static (BackendChoice, &'static str, &'static str, bool) {
        BACKENDS
            .iter()
            .find(|r| r.0 == self)
            .expect("every choice is in the table")
    }

    /// The name on the command line (`--backend NAME`).
    pub fn name(self) -> &'static str {
        self.row().1
    }

    /// The choice a command-line name stands for.
    pub fn from_name(name: &str) -> Option<Self> {
        BACKENDS.iter().find(|r| r.1 == name).map(|r| r.0)
    }
}

impl clap::ValueEnum for BackendChoice {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let &(_, name, help, hidden) = self.row();
        Some(
            clap::builder::PossibleValue::new(name)
                .help(help)
                .hide(hidden),
        )
    }
}

/// The most threads kvtrail starts for one step (`--threads`, and
/// `RAYON_NUM_THREADS`, which is capped to it): more only costs memory.
pub const MAX_THREADS: usize = 1024;

/// The threads a replay uses by default: `RAYON_NUM_THREADS` when set to
/// a positive number (as for every other parallel step of kvtrail), else
/// every core `std::thread::available_parallelism` reports; at most
/// [`MAX_THREADS`].
pub fn default_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
        .min(MAX_THREADS)
}

/// The one default rule for threads: `threads`, or [`default_threads`]
/// when it is 0 (not given).
pub fn threads_or_default(threads: usize) -> usize {
    match threads {
        0 => default_threads(),
        n => n,
    }
}

/// Runs `f` with rayon's parallel iterators on `threads` threads (0: the
/// default): on the current pool when it has as many, else on a pool of
/// its own for the call.
pub fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    let n = threads_or_default(threads);
    if n == rayon::current_num_threads() {
        return Ok(f());
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .map(|pool| pool.install(f))
        .map_err(|e| Error::Other(format!("cannot start {n} threads: {e}")))
}

/// A backend and a line saying which one was picked and why.
pub struct OpenedBackend {
    pub backend: Box<dyn Backend>,
    pub note: String,
}

/// A replay's backend and threads, resolved: the choice, and the threads
/// (at least 1) of the CPU backend and of the run's other parallel steps.
/// No backend's output depends on the threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendConfig {
    pub choice: BackendChoice,
    pub threads: usize,
}

impl BackendConfig {
    /// `choice` on `threads` threads (0: the default, [`threads_or_default`]).
    pub fn new(choice: BackendChoice, threads: usize) -> Self {
        BackendConfig {
            choice,
            threads: threads_or_default(threads),
        }
    }

    /// Opens the backend to replay `trace` with. `Cuda` fails with a
    /// message that says what is missing (the `cuda` feature, libcuda,
    /// NVRTC or a device); `Auto` replays on the CPU when CUDA cannot run,
    /// or when the pools declare more slots than the GPU backend holds
    /// (`gpu::GPU_MAX_SLOTS`).
    pub fn open(&self, trace: &Trace) -> Result<OpenedBackend> {
        let slots = trace
            .deployment()
            .pools
            .iter()
            .fold(0u64, |n, p| n.saturating_add(p.capacity_tokens));
        match self.choice {
            BackendChoice::Cpu => self.cpu(None),
            BackendChoice::Emu => Ok(OpenedBackend {
                backend: Box::new(gpu::GpuBackend::named(
                    gpu::EmuDevice::new(),
                    gpu::GpuConfig::default(),
                    "emu",
                )),
                note: "emu (GPU kernels emulated on the CPU)".into(),
            }),
            BackendChoice::Cuda => match gpu::unavailable() {
                Some(why) => Err(Error::Other(format!(
                    "--backend cuda: {why}; use --backend cpu or auto"
                ))),
                None => open_cuda(),
            },
            BackendChoice::Auto if slots > gpu::GPU_MAX_SLOTS => {
                let why = gpu::unavailable().unwrap_or_else(|| {
                    format!(
                        "the pools declare {slots} slots, more than the GPU backend holds ({})",
                        gpu::GPU_MAX_SLOTS
                    )
                });
                self.cpu(Some(format!("auto: {why}")))
            }
            BackendChoice::Auto => match gpu::unavailable() {
                Some(why) => self.cpu(Some(format!("auto: {why}"))),
                None => match open_cuda() {
                    Ok(b) => Ok(OpenedBackend {
                        note: format!("{} (auto)", b.note),
                        ..b
                    }),
                    Err(e) => self.cpu(Some(format!("auto: CUDA could not start: {e}"))),
                },
            },
        }
    }

    /// The CPU backend on the threads, and its note with `why` (e.g.
    /// "auto: no CUDA device").
    fn cpu(&self, why: Option<String>) -> Result<OpenedBackend> {
        let n = self.threads;
        let mut note = match why {
            Some(w) => format!("cpu ({w})"),
            None => "cpu".to_string(),
        };
        if n > 1 {
            note.push_str(&format!(" on {n} threads"));
        }
        Ok(OpenedBackend {
            backend: Box::new(CpuBackend::with_threads(n)?),
            note,
        })
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<OpenedBackend> {
    let b = gpu::open_cuda()?;
    let note = format!("cuda on {}", b.device().description);
    Ok(OpenedBackend {
        backend: Box::new(b),
        note,
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<OpenedBackend> {
    Err(Error::Other(gpu::unavailable().unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_choice_has_one_name_and_back() {
        for c in BackendChoice::ALL {
            assert_eq!(BackendChoice::from_name(c.name()), Some(c));
        }
        let names: Vec<&str> = BackendChoice::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names, ["auto", "cpu", "cuda", "emu"]);
        assert_eq!(BackendChoice::from_name("gpu"), None);
    }

    #[test]
    fn zero_threads_means_the_default() {
        assert_eq!(threads_or_default(3), 3);
        assert_eq!(threads_or_default(0), default_threads());
        assert!(BackendConfig::new(BackendChoice::Cpu, 0).threads >= 1);
    }
}
