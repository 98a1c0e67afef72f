//! Our own NVRTC loader (always built; it needs no CUDA at build time). cudarc 0.19 built with
//! `cuda-12080` looks for libnvrtc.so, then .so.12, .so.11, ... and panics
//! when none loads, so a CUDA 13 host with only libnvrtc.so.13 would be
//! missed. We dlopen NVRTC ourselves and call its stable C API (the seven
//! functions below have not changed since CUDA 11.1). Candidates, in order:
//! `$KVTRAIL_NVRTC` (a full path), libnvrtc.so, libnvrtc.so.13, .so.12,
//! .so.11, then the same names under `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`
//! and /usr/local/cuda/lib64.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

type Prog = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// The loaded NVRTC library and its entry points.
pub struct Nvrtc {
    _lib: libloading::Library,
    pub path: String,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    destroy: DestroyFn,
    version: VersionFn,
}

// SAFETY: NVRTC's API is thread safe; the struct holds only fn pointers and
// the library handle.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

fn candidates() -> Vec<String> {
    let names = [
        "libnvrtc.so",
        "libnvrtc.so.13",
        "libnvrtc.so.12",
        "libnvrtc.so.11",
    ];
    let mut v: Vec<String> = std::env::var("KVTRAIL_NVRTC").into_iter().collect();
    v.extend(names.iter().map(|s| s.to_string()));
    let mut dirs: Vec<String> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .map(|d| format!("{d}/lib64"))
        .collect();
    dirs.push("/usr/local/cuda/lib64".into());
    for d in dirs {
        v.extend(names.iter().map(|n| format!("{d}/{n}")));
    }
    v
}

impl Nvrtc {
    /// The process-wide NVRTC, loaded on first use.
    pub fn get() -> Result<&'static Nvrtc, String> {
        static N: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
        N.get_or_init(Self::load).as_ref().map_err(|e| e.clone())
    }

    fn load() -> Result<Nvrtc, String> {
        let cands = candidates();
        for c in &cands {
            // SAFETY: loading NVRTC runs no initialisers with preconditions.
            let Ok(lib) = (unsafe { libloading::Library::new(c) }) else {
                continue;
            };
            // SAFETY: the symbol types match nvrtc.h.
            unsafe {
                macro_rules! sym {
                    ($n:literal) => {
                        *lib.get(concat!($n, "\0").as_bytes())
                            .map_err(|e| format!("{c}: no symbol {}: {e}", $n))?
                    };
                }
                return Ok(Nvrtc {
                    create: sym!("nvrtcCreateProgram"),
                    compile: sym!("nvrtcCompileProgram"),
                    log_size: sym!("nvrtcGetProgramLogSize"),
                    log: sym!("nvrtcGetProgramLog"),
                    cubin_size: sym!("nvrtcGetCUBINSize"),
                    cubin: sym!("nvrtcGetCUBIN"),
                    ptx_size: sym!("nvrtcGetPTXSize"),
                    ptx: sym!("nvrtcGetPTX"),
                    destroy: sym!("nvrtcDestroyProgram"),
                    version: sym!("nvrtcVersion"),
                    path: c.clone(),
                    _lib: lib,
                });
            }
        }
        Err(format!(
            "NVRTC (libnvrtc) was not found (tried {}); install the CUDA toolkit's NVRTC \
             or set KVTRAIL_NVRTC=/path/to/libnvrtc.so.N",
            cands.join(", ")
        ))
    }

    pub fn version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two out-pointers.
        unsafe { (self.version)(&mut a, &mut b) };
        (a, b)
    }

    /// Compiles `src` for compute capability `major.minor`: a CUBIN for
    /// `sm_XY`, or PTX for `compute_XY` when this NVRTC cannot emit the
    /// CUBIN. Returns the image (NUL-terminated for PTX).
    pub fn compile(
        &self,
        name: &str,
        src: &str,
        major: i32,
        minor: i32,
    ) -> Result<Vec<u8>, String> {
        match self.compile_as(name, src, &format!("sm_{major}{minor}"), true) {
            Ok(v) => Ok(v),
            Err(_) => self.compile_as(name, src, &format!("compute_{major}{minor}"), false),
        }
    }

    fn compile_as(
        &self,
        name: &str,
        src: &str,
        arch: &str,
        cubin: bool,
    ) -> Result<Vec<u8>, String> {
        let csrc = CString::new(src).map_err(|e| e.to_string())?;
        let cname = CString::new(name).map_err(|e| e.to_string())?;
        let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "--std=c++17".into()]
            .into_iter()
            .map(|o| CString::new(o).expect("no NUL"))
            .collect();
        let optp: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid C strings; prog is destroyed below on every path.
        unsafe {
            let r = (self.create)(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if r != 0 {
                return Err(format!("nvrtcCreateProgram({name}) failed with code {r}"));
            }
            let r = (self.compile)(prog, optp.len() as c_int, optp.as_ptr());
            let out = if r != 0 {
                let mut n = 0usize;
                (self.log_size)(prog, &mut n);
                let mut log = vec![0u8; n.max(1)];
                (self.log)(prog, log.as_mut_ptr().cast());
                let log = CStr::from_bytes_until_nul(&log)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(format!("NVRTC could not compile {name} for {arch}: {log}"))
            } else {
                let (size, get) = if cubin {
                    (self.cubin_size, self.cubin)
                } else {
                    (self.ptx_size, self.ptx)
                };
                let mut n = 0usize;
                let r1 = size(prog, &mut n);
                let mut img = vec![0u8; n + 1];
                let r2 = get(prog, img.as_mut_ptr().cast());
                if r1 != 0 || r2 != 0 || n == 0 {
                    Err(format!("NVRTC gave no image for {name} ({arch})"))
                } else {
                    Ok(img)
                }
            };
            (self.destroy)(&mut prog);
            out
        }
    }
}
