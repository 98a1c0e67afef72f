//! The `Device` trait: what the GPU backend needs from a device (zeroed or
//! byte-filled buffers, host<->device copies by address, kernel launches
//! with one `#[repr(C)]` parameter struct), and the kernel table shared by
//! the CUDA device (which looks kernels up by name in the NVRTC modules) and
//! the emulator (which calls the C++ build of the same source).
//!
//! Addresses are `u64` on both devices (a `CUdeviceptr`, or a host pointer
//! for the emulator), so parameter structs are identical on both.

use crate::error::Result;

/// Plain data that may be copied to and from a device byte for byte.
///
/// # Safety
/// Implementors have no padding and every bit pattern is valid.
pub unsafe trait Pod: Copy + 'static {}
unsafe impl Pod for u8 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}

pub fn bytes_of<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

pub fn bytes_of_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod: every byte pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// A kernel of kernels/*.cu: its name (for NVRTC modules) and the entry of
/// its C++ build (for the emulator). `P` is its parameter struct.
pub struct Kernel<P> {
    pub name: &'static str,
    pub emu: unsafe extern "C" fn(P),
}

/// A device the GPU backend runs on. All operations are ordered (one
/// stream); downloads wait for everything launched before them.
pub trait Device {
    /// An allocation; freed on drop.
    type Buf;
    /// Allocates `bytes` (at least 8), every byte set to `fill`.
    fn alloc(&self, bytes: usize, fill: u8) -> Result<Self::Buf>;
    /// Address of an allocation, as kernels see it.
    fn addr(&self, b: &Self::Buf) -> u64;
    /// Copies `src` to device address `dst`.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Copies from device address `src` into `dst`.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Sets `bytes` bytes at `dst` to `fill`.
    fn fill(&self, dst: u64, fill: u8, bytes: usize) -> Result<()>;
    /// Launches `k` for about `work` independent items (kernels are
    /// grid-stride, so the geometry is the device's choice).
    fn launch<P: Copy>(&self, k: &Kernel<P>, work: u64, p: P) -> Result<()>;
}

/// A device buffer that grows on demand (contents not kept on growth).
pub struct Grow<D: Device> {
    buf: Option<(D::Buf, usize)>,
}

impl<D: Device> Default for Grow<D> {
    fn default() -> Self {
        Self { buf: None }
    }
}

impl<D: Device> Grow<D> {
    /// Address of a buffer of at least `bytes` bytes.
    pub fn ensure(&mut self, dev: &D, bytes: usize) -> Result<u64> {
        match &self.buf {
            Some((b, n)) if *n >= bytes => Ok(dev.addr(b)),
            _ => {
                let n = bytes.max(64).next_power_of_two();
                self.buf = None;
                let b = dev.alloc(n, 0)?;
                let a = dev.addr(&b);
                self.buf = Some((b, n));
                Ok(a)
            }
        }
    }
}

/// Kernel parameter structs: the same layout as the structs of the same
/// name in kernels/*.cu (every field 8 bytes: pointers are `u64`).
pub mod params {
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct ScanParams {
        pub data: u64,
        pub sums: u64,
        pub total: u64,
        pub n: u64,
        pub chunk: u64,
        pub op: u64,
        pub inclusive: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct ExpandParams {
        pub ev_off: u64,
        pub ev_slot: u64,
        pub touch_ev: u64,
        pub touch_slot: u64,
        pub key: u64,
        pub val: u64,
        pub n_ev: u64,
        pub n_touch: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct RadixParams {
        pub key_in: u64,
        pub val_in: u64,
        pub key_out: u64,
        pub val_out: u64,
        pub hist: u64,
        pub n: u64,
        pub chunk: u64,
        pub shift: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct MarkParams {
        pub skey: u64,
        pub sval: u64,
        pub touch_ev: u64,
        pub ev_kind: u64,
        pub mk: u64,
        pub n: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct ClassifyParams {
        pub skey: u64,
        pub sval: u64,
        pub lw: u64,
        pub touch_ev: u64,
        pub ev_kind: u64,
        pub ev_val: u64,
        pub ev_seq1: u64,
        pub ev_gofs: u64,
        pub ev_gcnt: u64,
        pub g_start: u64,
        pub g_end: u64,
        pub g_seq: u64,
        pub st_owner: u64,
        pub st_wseq1: u64,
        pub st_flags: u64,
        pub cls_kind: u64,
        pub cls_src: u64,
        pub counters: u64,
        pub n: u64,
        pub gap_mark: u64,
        pub never_kind: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct UpdateParams {
        pub skey: u64,
        pub lw: u64,
        pub ev_val: u64,
        pub ev_seq1: u64,
        pub st_owner: u64,
        pub st_wseq1: u64,
        pub st_flags: u64,
        pub n: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct RunParams {
        pub touch_ev: u64,
        pub touch_slot: u64,
        pub cls_kind: u64,
        pub cls_src: u64,
        pub fs: u64,
        pub fe: u64,
        pub run_ev: u64,
        pub run_slot: u64,
        pub run_t0: u64,
        pub run_t1: u64,
        pub run_kind: u64,
        pub run_src: u64,
        pub n: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct CopyParams {
        pub st_owner: u64,
        pub st_wseq1: u64,
        pub st_flags: u64,
        pub pay_owner: u64,
        pub pay_flag: u64,
        pub start: u64,
        pub count: u64,
        pub seq1: u64,
        pub gap_mark: u64,
        pub uncertain: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct KvParams {
        pub seed: u64,
        pub pos: u64,
        pub out: u64,
        pub n: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct TermsParams {
        pub values: u64,
        pub block_table: u64,
        pub out: u64,
        pub n: u64,
        pub page_size: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct TokensParams {
        pub prefix: u64,
        pub out: u64,
        pub prompt_len: u64,
        pub n_tokens: u64,
    }
}

use params::*;

macro_rules! kernel {
    ($konst:ident, $f:ident, $p:ty) => {
        pub const $konst: Kernel<$p> = Kernel {
            name: stringify!($f),
            emu: $f,
        };
    };
}

// The kernels of kernels/*.cu: `extern` declarations of their C++ build,
// one `Kernel` constant each and `SOURCES` (build.rs writes this list from
// the kernel files, the one list of kernels).
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
