//! The emulated device: host memory for buffers and the C++ build of
//! kernels/*.cu (build.rs) for kernels, each launch run as a loop over
//! blocks and threads on the calling thread. The GPU backend runs its full
//! launch sequence on it in the normal test suite, and the CLI offers it as
//! the hidden `--backend emu` (for tests and debugging: it is slow).
//!
//! Kernels are grid-stride, so the emulator picks its own small, odd
//! geometry: every kernel is exercised with several blocks and threads
//! sharing the work, which catches indexing that assumes one item a thread.

use super::device::{Device, Kernel};
use crate::error::{Error, Result};

unsafe extern "C" {
    fn kvt_emu_set_index(grid: u32, block: u32, b: u32, t: u32);
}

/// A host allocation (u64 words, so every kernel type is aligned).
pub struct EmuBuf {
    ptr: *mut u64,
    words: usize,
    live: Live,
}

type Live = std::rc::Rc<std::cell::RefCell<std::collections::BTreeMap<u64, u64>>>;

impl Drop for EmuBuf {
    fn drop(&mut self) {
        self.live.borrow_mut().remove(&(self.ptr as u64));
        // SAFETY: ptr came from Box::into_raw of a boxed slice of `words`.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.words,
            )))
        };
    }
}

/// The emulated device.
pub struct EmuDevice {
    grid: u32,
    block: u32,
    /// Live allocations: address ranges, to check every copy stays inside one.
    live: Live,
}

impl Default for EmuDevice {
    fn default() -> Self {
        Self::with_geometry(3, 5)
    }
}

impl EmuDevice {
    pub fn new() -> Self {
        Self::default()
    }

    /// An emulator launching every kernel on `grid` blocks of `block` threads.
    pub fn with_geometry(grid: u32, block: u32) -> Self {
        Self {
            grid: grid.max(1),
            block: block.max(1),
            live: Default::default(),
        }
    }

    fn check(&self, addr: u64, bytes: usize) -> Result<()> {
        let live = self.live.borrow();
        match live.range(..=addr).next_back() {
            Some((&a, &n)) if addr + bytes as u64 <= a + n => Ok(()),
            _ => Err(Error::Other(format!(
                "emulated device: copy of {bytes} bytes at {addr:#x} outside any allocation"
            ))),
        }
    }
}

impl Device for EmuDevice {
    type Buf = EmuBuf;

    fn alloc(&self, bytes: usize, fill: u8) -> Result<EmuBuf> {
        let words = bytes.max(8).div_ceil(8);
        let w = u64::from_ne_bytes([fill; 8]);
        let ptr = Box::into_raw(vec![w; words].into_boxed_slice()).cast::<u64>();
        self.live
            .borrow_mut()
            .insert(ptr as u64, (words * 8) as u64);
        Ok(EmuBuf {
            ptr,
            words,
            live: self.live.clone(),
        })
    }

    fn addr(&self, b: &EmuBuf) -> u64 {
        b.ptr as u64
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.check(dst, src.len())?;
        // SAFETY: checked to lie inside a live allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check(src, dst.len())?;
        // SAFETY: checked to lie inside a live allocation.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn fill(&self, dst: u64, fill: u8, bytes: usize) -> Result<()> {
        self.check(dst, bytes)?;
        // SAFETY: checked to lie inside a live allocation.
        unsafe { std::ptr::write_bytes(dst as *mut u8, fill, bytes) };
        Ok(())
    }

    fn launch<P: Copy>(&self, k: &Kernel<P>, _work: u64, p: P) -> Result<()> {
        for b in 0..self.grid {
            for t in 0..self.block {
                // SAFETY: the kernels touch only the buffers their parameters
                // name, which the backend sized for this launch.
                unsafe {
                    kvt_emu_set_index(self.grid, self.block, b, t);
                    (k.emu)(p);
                }
            }
        }
        Ok(())
    }
}
