//! Every kernel source of kernels/*.cu compiled by a real NVRTC (CUDA 13,
//! through kvtrail's own loader, as the CUDA backend does at run time) for
//! the H200's sm_90 and an older sm_80, and checked to define every kernel
//! the host code launches. Needs no GPU: .ci/setup.d/40-nvrtc.sh installs
//! NVRTC from PyPI. In CI (`CI` set) a missing NVRTC fails the test;
//! elsewhere the test says how to set it up and passes.

use kvtrail::lineage::gpu::device::SOURCES;
use kvtrail::lineage::gpu::nvrtc::Nvrtc;

use crate::support::rerun_with_env;

/// NVRTC for test `name` of this module, or `None` when the test has
/// nothing more to do here: NVRTC is missing outside CI, or the test ran
/// again in a child process. The loader is process-wide and reads
/// KVTRAIL_NVRTC once, so when it is unset and .ci/setup.d/40-nvrtc.sh
/// installed NVRTC, the test runs again alone in a child process of this
/// binary with it set (setting it here could come after another test of the
/// binary loaded NVRTC).
fn nvrtc(name: &str) -> Option<&'static Nvrtc> {
    if std::env::var_os("KVTRAIL_NVRTC").is_none() {
        let cache = std::env::var("KVTRAIL_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/kvtrail",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        if let Ok(lib) = std::fs::read_to_string(format!("{cache}/venv-nvrtc/.kvtrail-ready")) {
            let module = module_path!().split_once("::").unwrap().1;
            rerun_with_env(&format!("{module}::{name}"), "KVTRAIL_NVRTC", lib.trim());
            return None;
        }
    }
    match Nvrtc::get() {
        Ok(n) => Some(n),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{e}\nrun .ci/setup.d/40-nvrtc.sh first")
        }
        Err(e) => {
            eprintln!(
                "skipped: {e}; run .ci/setup.d/40-nvrtc.sh to compile the kernels with NVRTC"
            );
            None
        }
    }
}

#[test]
fn nvrtc_compiles_every_kernel_for_sm90_and_sm80() {
    let Some(nv) = nvrtc("nvrtc_compiles_every_kernel_for_sm90_and_sm80") else {
        return;
    };
    eprintln!("NVRTC {:?} from {}", nv.version(), nv.path);
    for (major, minor) in [(9, 0), (8, 0)] {
        for (file, src, kernels) in SOURCES {
            let img = nv
                .compile(file, src, major, minor)
                .unwrap_or_else(|e| panic!("{file} sm_{major}{minor}: {e}"));
            assert!(img.len() > 100, "{file}: empty image");
            for k in *kernels {
                assert!(
                    img.windows(k.len()).any(|w| w == k.as_bytes()),
                    "{file} sm_{major}{minor}: kernel {k} missing from the image"
                );
            }
        }
    }
}

#[test]
fn nvrtc_reports_compile_errors_with_the_log() {
    let Some(nv) = nvrtc("nvrtc_reports_compile_errors_with_the_log") else {
        return;
    };
    let e = nv
        .compile(
            "bad.cu",
            "extern \"C\" __global__ void k() { undefined_thing(); }",
            9,
            0,
        )
        .unwrap_err();
    assert!(e.contains("undefined_thing"), "{e}");
}
