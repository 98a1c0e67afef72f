//! The CUDA device (feature `cuda`): cudarc's driver API on the primary
//! context of one GPU, the null stream (so every copy and launch is ordered
//! and downloads wait for the kernels before them), and the kernels of
//! kernels/*.cu compiled once per context by NVRTC (our loader, nvrtc.rs).
//!
//! `probe` checks, before any cudarc driver call, that libcuda loads
//! (`cudarc::driver::sys::is_culib_present`: cudarc panics otherwise),
//! that NVRTC loads, and that the driver initializes with a device.

use std::collections::HashMap;
use std::ffi::{CString, c_void};

use cudarc::driver::{result, sys};

use super::device::{Device, Kernel, SOURCES};
use super::nvrtc::Nvrtc;
use crate::error::{Error, Result};

fn err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Other(format!("CUDA: {what}: {e}"))
}

/// Why CUDA cannot be used here, checked without letting cudarc panic.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to dlopen the candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err("the NVIDIA driver library (libcuda.so) was not found".into());
    }
    Nvrtc::get()?;
    result::init().map_err(|e| format!("the CUDA driver did not initialize: {e}"))?;
    let n = result::device::get_count().map_err(|e| format!("no CUDA device count: {e}"))?;
    if n < 1 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(())
}

/// A device buffer.
pub struct CudaBuf {
    ptr: sys::CUdeviceptr,
    ctx: sys::CUcontext,
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in ctx and is freed once.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// One GPU, its primary context and the loaded kernels.
pub struct CudaDevice {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    funcs: HashMap<&'static str, sys::CUfunction>,
    max_blocks: u32,
    /// Device name and compute capability, for the user.
    pub description: String,
}

const BLOCK: u32 = 256;

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles and loads every kernel.
    pub fn open(ordinal: i32) -> Result<Self> {
        probe().map_err(Error::Other)?;
        let nv = Nvrtc::get().map_err(Error::Other)?;
        let dev = result::device::get(ordinal).map_err(|e| err("device", e))?;
        // SAFETY: dev is a valid device; the context is released on drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| err("context", e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| err("context", e))?;
        let attr = |a| unsafe { result::device::get_attribute(dev, a) };
        use sys::CUdevice_attribute::*;
        let major =
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(|e| err("attribute", e))?;
        let minor =
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(|e| err("attribute", e))?;
        let sms =
            attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| err("attribute", e))?;
        let name = result::device::get_name(dev).unwrap_or_else(|_| "CUDA device".into());
        let (nv_major, nv_minor) = nv.version();
        let mut funcs = HashMap::new();
        for (file, src, kernels) in SOURCES {
            let image = nv.compile(file, src, major, minor).map_err(Error::Other)?;
            // SAFETY: image is a CUBIN or a NUL-terminated PTX from NVRTC;
            // modules stay loaded for the life of the primary context.
            let module = unsafe { result::module::load_data(image.as_ptr().cast::<c_void>()) }
                .map_err(|e| err(&format!("loading {file}"), e))?;
            for k in *kernels {
                let cname = CString::new(*k).expect("kernel names have no NUL");
                // SAFETY: module is loaded.
                let f = unsafe { result::module::get_function(module, cname) }
                    .map_err(|e| err(&format!("kernel {k}"), e))?;
                funcs.insert(*k, f);
            }
        }
        Ok(Self {
            dev,
            ctx,
            funcs,
            max_blocks: (sms.max(1) as u32) * 32,
            description: format!(
                "{name} (sm_{major}{minor}, {sms} SMs; NVRTC {nv_major}.{nv_minor} from {})",
                nv.path
            ),
        })
    }

    fn current(&self) -> Result<()> {
        // SAFETY: ctx is retained while self lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| err("context", e))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: retained in open.
        unsafe {
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

impl Device for CudaDevice {
    type Buf = CudaBuf;

    fn alloc(&self, bytes: usize, fill: u8) -> Result<CudaBuf> {
        self.current()?;
        let bytes = bytes.max(8);
        // SAFETY: plain allocation in the current context.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| err(&format!("allocating {bytes} bytes"), e))?;
        let b = CudaBuf { ptr, ctx: self.ctx };
        self.fill(ptr, fill, bytes)?;
        Ok(b)
    }

    fn addr(&self, b: &CudaBuf) -> u64 {
        b.ptr
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.current()?;
        // SAFETY: dst points into a live allocation of at least src.len()
        // bytes (the backend sizes every buffer before use).
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| err("upload", e))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.current()?;
        // SAFETY: as upload; the null stream orders it after earlier launches.
        unsafe { result::memcpy_dtoh_sync(dst, src) }
            .map_err(|e| err("download (or an earlier kernel)", e))
    }

    fn fill(&self, dst: u64, fill: u8, bytes: usize) -> Result<()> {
        self.current()?;
        // SAFETY: as upload.
        unsafe { result::memset_d8_sync(dst, fill, bytes) }.map_err(|e| err("memset", e))
    }

    fn launch<P: Copy>(&self, k: &Kernel<P>, work: u64, p: P) -> Result<()> {
        self.current()?;
        let f = *self
            .funcs
            .get(k.name)
            .ok_or_else(|| err("launch", format!("kernel {} not loaded", k.name)))?;
        let grid = work.div_ceil(BLOCK as u64).clamp(1, self.max_blocks as u64) as u32;
        let mut p = p;
        let mut args = [(&mut p as *mut P).cast::<c_void>()];
        // SAFETY: the kernel takes exactly one parameter of type P (the
        // #[repr(C)] mirror of its C struct); p outlives the call, which
        // copies the parameter.
        unsafe {
            result::launch_kernel(
                f,
                (grid, 1, 1),
                (BLOCK, 1, 1),
                0,
                std::ptr::null_mut(),
                &mut args,
            )
        }
        .map_err(|e| err(&format!("launching {}", k.name), e))
    }
}
