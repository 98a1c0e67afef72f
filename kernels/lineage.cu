// lineage.cu: the replay backend's kernels. One batch of one pool's events
// (writes, scrubs, reads; seq order) becomes slot touches, sorted stably by
// slot; an inclusive max-scan over (slot << 32 | writer + 1) gives every
// touch the last writer of its slot before it; reads are classified exactly
// like src/lineage/cpu.rs, compacted to runs in (event, slot) order, and each
// slot's last writer becomes its new state. Copies between pools are
// gathers (capture) and scatters (apply_copy).
//
// Kernel rules (docs/cuda.md): grid-stride loops, no shared memory, no
// __syncthreads, no thread reads what another thread of the same launch
// writes, so the CPU emulator may run threads one after another.
#if !defined(__CUDACC__)
#include "cuda_cpu_compat.h"
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

#define KVT_NEVER 0xFFFFFFFFFFFFFFFFull
#define KVT_SCRUBBED 0xFFFFFFFFFFFFFFFEull
// Event kinds on the device (alloc, free, share never reach it).
#define KVT_EV_WRITE 1u
#define KVT_EV_SCRUB 2u
#define KVT_EV_READ 3u
// Read classes (low byte) and the uncertain bit.
#define KVT_CLS_CLEAN 0u
#define KVT_CLS_FOREIGN 1u
#define KVT_CLS_BLANK 2u
#define KVT_CLS_UNKNOWN 3u
#define KVT_CLS_UNCERTAIN 4u
#define KVT_CLS_SHARED 5u
#define KVT_CLS_UNC_BIT 0x100u

#define KVT_FOR(i, n)                                                          \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, kvt_stride_ =     \
                                                                 (u64)gridDim.x * blockDim.x; \
         i < (n); i += kvt_stride_)

struct ExpandParams {
    const u64* ev_off;  // exclusive prefix sum of slot counts
    const u32* ev_slot;
    u32* touch_ev;
    u32* touch_slot;
    u32* key;
    u32* val;
    u64 n_ev;
    u64 n_touch;
};

// Touch t belongs to the last event whose offset is <= t.
extern "C" __global__ void kvt_expand(const ExpandParams p) {
    KVT_FOR(t, p.n_touch) {
        u64 lo = 0, hi = p.n_ev;
        while (hi - lo > 1) {
            const u64 mid = lo + (hi - lo) / 2;
            if (p.ev_off[mid] <= t) lo = mid; else hi = mid;
        }
        const u32 slot = p.ev_slot[lo] + (u32)(t - p.ev_off[lo]);
        p.touch_ev[t] = (u32)lo;
        p.touch_slot[t] = slot;
        p.key[t] = slot;
        p.val[t] = (u32)t;
    }
}

struct RadixParams {
    const u32* key_in;
    const u32* val_in;
    u32* key_out;
    u32* val_out;
    u64* hist;  // [256][n_chunks], digit-major
    u64 n;
    u64 chunk;
    u64 shift;
};

// Per chunk, the count of each 8-bit digit.
extern "C" __global__ void kvt_radix_hist(const RadixParams p) {
    const u64 nch = (p.n + p.chunk - 1) / p.chunk;
    KVT_FOR(c, nch) {
        u32 cnt[256];
        for (int d = 0; d < 256; ++d) cnt[d] = 0;
        const u64 a = c * p.chunk;
        const u64 b = a + p.chunk < p.n ? a + p.chunk : p.n;
        for (u64 i = a; i < b; ++i) cnt[(p.key_in[i] >> p.shift) & 255u] += 1;
        for (int d = 0; d < 256; ++d) p.hist[(u64)d * nch + c] = cnt[d];
    }
}

// Stable scatter: chunk c writes its digit-d keys from the scanned offset.
extern "C" __global__ void kvt_radix_scatter(const RadixParams p) {
    const u64 nch = (p.n + p.chunk - 1) / p.chunk;
    KVT_FOR(c, nch) {
        u64 pos[256];
        for (int d = 0; d < 256; ++d) pos[d] = p.hist[(u64)d * nch + c];
        const u64 a = c * p.chunk;
        const u64 b = a + p.chunk < p.n ? a + p.chunk : p.n;
        for (u64 i = a; i < b; ++i) {
            const u32 k = p.key_in[i];
            const u64 o = pos[(k >> p.shift) & 255u]++;
            p.key_out[o] = k;
            p.val_out[o] = p.val_in[i];
        }
    }
}

struct MarkParams {
    const u32* skey;  // slots, sorted
    const u32* sval;  // touch index of each sorted position
    const u32* touch_ev;
    const u32* ev_kind;
    u64* mk;
    u64 n;
};

// mk = slot << 32 | (writer event + 1, or 0): its inclusive max-scan holds,
// at every sorted position, the last writer of that slot so far.
extern "C" __global__ void kvt_mark_writers(const MarkParams p) {
    KVT_FOR(i, p.n) {
        const u32 e = p.touch_ev[p.sval[i]];
        const u32 k = p.ev_kind[e];
        const u64 w = (k == KVT_EV_WRITE || k == KVT_EV_SCRUB) ? (u64)e + 1 : 0;
        p.mk[i] = ((u64)p.skey[i] << 32) | w;
    }
}

struct ClassifyParams {
    const u32* skey;
    const u32* sval;
    const u64* lw;  // scanned marks
    const u32* touch_ev;
    const u32* ev_kind;
    const u64* ev_val;   // writer / reader request id, KVT_SCRUBBED for scrubs
    const u64* ev_seq1;  // seq + 1
    const u32* ev_gofs;  // the reader's share grants: offset, count
    const u32* ev_gcnt;
    const u32* g_start;
    const u32* g_end;
    const u64* g_seq;
    const u64* st_owner;
    const u64* st_wseq1;
    const u32* st_flags;
    u32* cls_kind;  // per touch (original order)
    u64* cls_src;
    u64* counters;  // [own slots, shared slots]
    u64 n;
    u64 gap_mark;
    u64 never_kind;  // KVT_CLS_BLANK or KVT_CLS_UNKNOWN
};

// Classifies every read touch against the slot state just before it (the
// batch's last writer, or the state at batch start). Mirrors
// state::classify (src/lineage/state.rs) and the own fast path of
// src/lineage/cpu.rs.
extern "C" __global__ void kvt_classify(const ClassifyParams p) {
    u64 own = 0, shared = 0;
    KVT_FOR(i, p.n) {
        const u32 t = p.sval[i];
        const u32 e = p.touch_ev[t];
        u32 cls = KVT_CLS_CLEAN;
        u64 src = 0;
        if (p.ev_kind[e] == KVT_EV_READ) {
            const u32 s = p.skey[i];
            const u64 w = p.lw[i] & 0xFFFFFFFFull;
            u64 o, w1;
            u32 fl;
            if (w != 0) {
                o = p.ev_val[w - 1];
                w1 = p.ev_seq1[w - 1];
                fl = 0;
            } else {
                o = p.st_owner[s];
                w1 = p.st_wseq1[s];
                fl = p.st_flags[s];
            }
            const u64 r = p.ev_val[e];
            const bool unc = fl != 0 || w1 < p.gap_mark;
            if (o == r && !unc) {
                own += 1;
            } else if (o == KVT_NEVER) {
                if (p.never_kind == KVT_CLS_BLANK) {
                    cls = unc ? (KVT_CLS_UNCERTAIN | KVT_CLS_UNC_BIT) : KVT_CLS_BLANK;
                } else {
                    cls = KVT_CLS_UNKNOWN | (unc ? KVT_CLS_UNC_BIT : 0u);
                }
            } else if (o == KVT_SCRUBBED) {
                cls = unc ? (KVT_CLS_UNCERTAIN | KVT_CLS_UNC_BIT) : KVT_CLS_BLANK;
            } else {
                bool granted = o == r;
                const u32 g0 = p.ev_gofs[e];
                const u32 g1 = g0 + p.ev_gcnt[e];
                for (u32 g = g0; g < g1 && !granted; ++g) {
                    granted = p.g_start[g] <= s && s < p.g_end[g] && w1 <= p.g_seq[g];
                }
                if (granted && unc) {
                    cls = KVT_CLS_UNCERTAIN | KVT_CLS_UNC_BIT;
                } else if (granted && o != r) {
                    // another request's content under a grant: clean, but
                    // reported with its source (src/lineage/state.rs)
                    shared += 1;
                    cls = KVT_CLS_SHARED;
                    src = o;
                } else if (granted) {
                    shared += 1;
                } else {
                    cls = KVT_CLS_FOREIGN | (unc ? KVT_CLS_UNC_BIT : 0u);
                    src = o;
                }
            }
        }
        p.cls_kind[t] = cls;
        p.cls_src[t] = src;
    }
    if (own) atomicAdd(&p.counters[0], own);
    if (shared) atomicAdd(&p.counters[1], shared);
}

struct UpdateParams {
    const u32* skey;
    const u64* lw;
    const u64* ev_val;
    const u64* ev_seq1;
    u64* st_owner;
    u64* st_wseq1;
    u32* st_flags;
    u64 n;
};

// The last sorted position of each slot carries the slot's last writer of
// the batch: it becomes the slot's state.
extern "C" __global__ void kvt_update_state(const UpdateParams p) {
    KVT_FOR(i, p.n) {
        if (i + 1 < p.n && p.skey[i + 1] == p.skey[i]) continue;
        const u64 w = p.lw[i] & 0xFFFFFFFFull;
        if (w == 0) continue;
        const u32 s = p.skey[i];
        p.st_owner[s] = p.ev_val[w - 1];
        p.st_wseq1[s] = p.ev_seq1[w - 1];
        p.st_flags[s] = 0;
    }
}

struct RunParams {
    const u32* touch_ev;
    const u32* touch_slot;
    const u32* cls_kind;
    const u64* cls_src;
    u64* fs;  // run-start flags, then their exclusive scan
    u64* fe;  // run-end flags, then their exclusive scan
    u32* run_ev;
    u32* run_slot;
    u32* run_t0;
    u32* run_t1;
    u32* run_kind;
    u64* run_src;
    u64 n;
};

__device__ __forceinline__ bool kvt_same_run(const RunParams& p, u64 a, u64 b) {
    return p.touch_ev[a] == p.touch_ev[b] && p.cls_kind[a] == p.cls_kind[b] &&
           p.cls_src[a] == p.cls_src[b];
}
__device__ __forceinline__ bool kvt_run_start(const RunParams& p, u64 t) {
    return p.cls_kind[t] != KVT_CLS_CLEAN && (t == 0 || !kvt_same_run(p, t - 1, t));
}
__device__ __forceinline__ bool kvt_run_end(const RunParams& p, u64 t) {
    return p.cls_kind[t] != KVT_CLS_CLEAN && (t + 1 == p.n || !kvt_same_run(p, t, t + 1));
}

// Touches in original order are (event, slot) order, the CPU's run order.
extern "C" __global__ void kvt_run_flags(const RunParams p) {
    KVT_FOR(t, p.n) {
        p.fs[t] = kvt_run_start(p, t) ? 1 : 0;
        p.fe[t] = kvt_run_end(p, t) ? 1 : 0;
    }
}

// After the scans: run k starts at the k-th start and ends at the k-th end.
extern "C" __global__ void kvt_run_scatter(const RunParams p) {
    KVT_FOR(t, p.n) {
        if (kvt_run_start(p, t)) {
            const u64 k = p.fs[t];
            p.run_ev[k] = p.touch_ev[t];
            p.run_slot[k] = p.touch_slot[t];
            p.run_t0[k] = (u32)t;
            p.run_kind[k] = p.cls_kind[t];
            p.run_src[k] = p.cls_src[t];
        }
        if (kvt_run_end(p, t)) p.run_t1[p.fe[t]] = (u32)t;
    }
}

struct CopyParams {
    u64* st_owner;
    u64* st_wseq1;
    u32* st_flags;
    u64* pay_owner;
    u32* pay_flag;
    u64 start;
    u64 count;
    u64 seq1;      // scatter: seq + 1 of the copy
    u64 gap_mark;  // gather
    u64 uncertain; // gather: mark every value uncertain
};

// apply_copy: the payload becomes the content of start..start+count.
extern "C" __global__ void kvt_copy_scatter(const CopyParams p) {
    KVT_FOR(i, p.count) {
        const u64 s = p.start + i;
        p.st_owner[s] = p.pay_owner[i];
        p.st_flags[s] = p.pay_flag[i];
        p.st_wseq1[s] = p.seq1;
    }
}

// capture: the content of start..start+count and whether it is uncertain.
extern "C" __global__ void kvt_copy_gather(const CopyParams p) {
    KVT_FOR(i, p.count) {
        const u64 s = p.start + i;
        p.pay_owner[i] = p.st_owner[s];
        p.pay_flag[i] =
            (p.uncertain != 0 || p.st_flags[s] != 0 || p.st_wseq1[s] < p.gap_mark) ? 1u : 0u;
    }
}
