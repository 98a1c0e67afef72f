// cuda_cpu_compat.h: lets kernels/*.cu compile as plain C++ so the normal
// test suite runs the very kernel sources on the CPU (the "emulated device",
// src/lineage/gpu/emu.rs). It maps the CUDA index built-ins to thread-local
// variables the emulator sets before each (block, thread) call, the
// function qualifiers to nothing, and the atomics to GCC __atomic builtins.
//
// Kernels are written so that running their threads one after another is a
// valid execution: no __syncthreads, no shared memory, no thread waiting on
// another within a launch (see docs/cuda.md, "Kernel rules").
#pragma once
#if defined(__CUDACC__)
#error "cuda_cpu_compat.h is for the CPU build only"
#endif

struct dim3 {
    unsigned int x, y, z;
};

extern thread_local dim3 kvt_emu_thread_idx;
extern thread_local dim3 kvt_emu_block_idx;
extern thread_local dim3 kvt_emu_block_dim;
extern thread_local dim3 kvt_emu_grid_dim;

#define threadIdx kvt_emu_thread_idx
#define blockIdx kvt_emu_block_idx
#define blockDim kvt_emu_block_dim
#define gridDim kvt_emu_grid_dim

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
    return old;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp,
                                    unsigned long long v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}
