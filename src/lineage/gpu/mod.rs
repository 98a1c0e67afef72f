//! The GPU replay backend and the reference model on the GPU.
//!
//! One backend implementation (`GpuBackend`) drives a `Device`: buffers,
//! copies and kernel launches. Two devices implement it:
//!
//! - `driver::CudaDevice` (feature `cuda`): cudarc's driver API, kernels
//!   compiled at run time from kernels/*.cu with NVRTC (our own loader,
//!   `nvrtc`, always built: a CUDA 13 host's libnvrtc.so.13 is found, and
//!   the test suite compiles every kernel with a real NVRTC, no GPU needed).
//! - `emu::EmuDevice` (always built): the same kernel sources compiled as C++
//!   by build.rs, launched by looping over blocks and threads. The normal
//!   test suite runs the very launch sequence of the CUDA backend on it.
//!
//! `select` turns `--backend auto|cpu|cuda|emu` into a backend after probing
//! the CUDA libraries without calling into cudarc first (cudarc panics when
//! libcuda is missing).

pub mod backend;
pub mod device;
#[cfg(feature = "cuda")]
pub mod driver;
pub mod emu;
pub mod model;
pub mod nvrtc;
pub mod prims;

pub use backend::{GPU_MAX_SLOTS, GpuBackend, GpuConfig};
pub use device::Device;
pub use emu::EmuDevice;

/// The emulated-device backend (kernels on the CPU, one thread at a time).
pub type EmuBackend = GpuBackend<EmuDevice>;

/// The CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = GpuBackend<driver::CudaDevice>;

/// Why the CUDA backend cannot run here, or `None` when it can. Checks, in
/// order: the build has the `cuda` feature, libcuda loads, NVRTC loads, the
/// driver initializes and reports a device.
pub fn unavailable() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        driver::probe().err()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some(
            "this kvtrail was built without the `cuda` feature \
             (rebuild with `cargo build --release --features cuda`)"
                .to_string(),
        )
    }
}

/// Opens the CUDA backend on device 0 (after `unavailable()` said yes).
#[cfg(feature = "cuda")]
pub fn open_cuda() -> crate::error::Result<CudaBackend> {
    open_cuda_with(GpuConfig::default())
}

/// Opens the CUDA backend on device 0 with explicit work sizes.
#[cfg(feature = "cuda")]
pub fn open_cuda_with(cfg: GpuConfig) -> crate::error::Result<CudaBackend> {
    let dev = driver::CudaDevice::open(0)?;
    Ok(GpuBackend::new(dev, cfg))
}
