// cuda_cpu_compat.cpp: the thread-local CUDA index built-ins of the CPU
// build of the kernels, and the one entry the Rust emulator calls before
// running a (block, thread) of a kernel. Thread-local, so Rust tests that run
// in parallel each emulate their own launch.
#include "cuda_cpu_compat.h"

thread_local dim3 kvt_emu_thread_idx = {0, 0, 0};
thread_local dim3 kvt_emu_block_idx = {0, 0, 0};
thread_local dim3 kvt_emu_block_dim = {1, 1, 1};
thread_local dim3 kvt_emu_grid_dim = {1, 1, 1};

extern "C" void kvt_emu_set_index(unsigned int grid, unsigned int block, unsigned int b,
                                  unsigned int t) {
    kvt_emu_grid_dim = {grid, 1, 1};
    kvt_emu_block_dim = {block, 1, 1};
    kvt_emu_block_idx = {b, 0, 0};
    kvt_emu_thread_idx = {t, 0, 0};
}
