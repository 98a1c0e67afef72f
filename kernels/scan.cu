// scan.cu: in-place scans over u64 arrays (exclusive sum, inclusive or
// exclusive max), the building block of the lineage and model kernels.
//
// Reduce-then-scan with one contiguous chunk per thread: `kvt_scan_reduce`
// writes one partial per chunk, the partials are scanned recursively (host
// side, src/lineage/gpu/prims.rs), `kvt_scan_apply` rescans each chunk from
// its carry. `kvt_scan_single` does a whole (small) array on one thread and
// writes the total. Every kernel is grid-size agnostic (grid-stride loops),
// so any launch geometry, including one thread after another, is valid.
#if !defined(__CUDACC__)
#include "cuda_cpu_compat.h"
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

struct ScanParams {
    u64* data;
    u64* sums;
    u64* total;
    u64 n;
    u64 chunk;
    u64 op;  // 0: wrapping sum, 1: max (identity 0 for both)
    u64 inclusive;
};

__device__ __forceinline__ u64 kvt_comb(u64 op, u64 a, u64 b) {
    return op == 0 ? a + b : (a > b ? a : b);
}

extern "C" __global__ void kvt_scan_reduce(const ScanParams p) {
    const u64 nch = (p.n + p.chunk - 1) / p.chunk;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += stride) {
        const u64 a = c * p.chunk;
        const u64 b = a + p.chunk < p.n ? a + p.chunk : p.n;
        u64 acc = 0;
        for (u64 i = a; i < b; ++i) acc = kvt_comb(p.op, acc, p.data[i]);
        p.sums[c] = acc;
    }
}

__device__ __forceinline__ u64 kvt_scan_range(const ScanParams& p, u64 a, u64 b, u64 carry) {
    for (u64 i = a; i < b; ++i) {
        const u64 v = p.data[i];
        if (p.inclusive) {
            carry = kvt_comb(p.op, carry, v);
            p.data[i] = carry;
        } else {
            p.data[i] = carry;
            carry = kvt_comb(p.op, carry, v);
        }
    }
    return carry;
}

extern "C" __global__ void kvt_scan_apply(const ScanParams p) {
    const u64 nch = (p.n + p.chunk - 1) / p.chunk;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += stride) {
        const u64 a = c * p.chunk;
        const u64 b = a + p.chunk < p.n ? a + p.chunk : p.n;
        kvt_scan_range(p, a, b, p.sums[c]);
    }
}

extern "C" __global__ void kvt_scan_single(const ScanParams p) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *p.total = kvt_scan_range(p, 0, p.n, 0);
}
