// model.cu: the simulator's integer-only reference model (src/sim/model.rs)
// as kernels: slot values from (seed, position), per-position attention
// terms gathered through a paged block table, and output tokens from the
// inclusive prefix sum of the terms (kvt_scan_* in scan.cu). The sum is
// wrapping u64 addition, so any reduction order gives the CPU's bits.
#if !defined(__CUDACC__)
#include "cuda_cpu_compat.h"
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

#define KVT_FOR(i, n)                                                          \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, kvt_stride_ =     \
                                                                 (u64)gridDim.x * blockDim.x; \
         i < (n); i += kvt_stride_)

__device__ __forceinline__ u64 kvt_mix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct KvParams {
    const u64* seed;
    const u32* pos;  // 0xFFFFFFFF: blank slot (value 0)
    u64* out;
    u64 n;
};

// Value of each slot: kv(seed(owner), owner_pos), 0 when blank.
extern "C" __global__ void kvt_model_slot_values(const KvParams p) {
    KVT_FOR(i, p.n) {
        const u32 q = p.pos[i];
        p.out[i] = q == 0xFFFFFFFFu ? 0 : kvt_mix64(p.seed[i] ^ kvt_mix64((u64)q));
    }
}

struct TermsParams {
    const u64* values;       // slot values of the pool (or the context itself)
    const u32* block_table;  // page ids; unused when page_size == 0
    u64* out;
    u64 n;          // positions
    u64 page_size;  // 0: values are indexed by position directly
};

// term(V[p], p) where V[p] is read through the block table.
extern "C" __global__ void kvt_model_terms(const TermsParams p) {
    KVT_FOR(i, p.n) {
        const u64 slot =
            p.page_size == 0 ? i : (u64)p.block_table[i / p.page_size] * p.page_size + i % p.page_size;
        p.out[i] = kvt_mix64(p.values[slot] + i * 0xD6E8FEB86659FD93ull);
    }
}

struct TokensParams {
    const u64* prefix;  // inclusive prefix sums of the terms
    u32* out;
    u64 prompt_len;
    u64 n_tokens;
};

// token_j = mix64(g_j ^ j) mod 2^16, g_j = sum of terms up to L + j.
extern "C" __global__ void kvt_model_tokens(const TokensParams p) {
    KVT_FOR(j, p.n_tokens) {
        p.out[j] = (u32)(kvt_mix64(p.prefix[p.prompt_len + j] ^ j) & 0xFFFFull);
    }
}
