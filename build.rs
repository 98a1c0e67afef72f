//! Compiles kernels/*.cu as plain C++ (with kernels/cuda_cpu_compat.h) into
//! a static library that is always linked: the emulated device
//! (src/lineage/gpu/emu.rs) runs these very kernel sources on the CPU, so the
//! normal test suite covers them without a GPU. The CUDA backend compiles the
//! same files with NVRTC at run time; no CUDA toolkit is needed here.

fn main() {
    let kernels = ["kernels/scan.cu", "kernels/lineage.cu", "kernels/model.cu"];
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .flag("-x")
        .flag("c++")
        .include("kernels");
    for k in kernels {
        b.file(k);
        println!("cargo:rerun-if-changed={k}");
    }
    b.file("kernels/cuda_cpu_compat.cpp");
    println!("cargo:rerun-if-changed=kernels/cuda_cpu_compat.cpp");
    println!("cargo:rerun-if-changed=kernels/cuda_cpu_compat.h");
    b.compile("kvtrail_kernels_emu");
}
