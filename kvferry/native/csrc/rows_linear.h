/*
 * Pieces shared by the linear kernels for steps of a few rows (bf16_linear.c, f32_linear.c):
 * when to use a thread team and which outputs each thread computes (the AVX2 helpers they
 * use are in avx2.h).
 */
#ifndef KVF_ROWS_LINEAR_H
#define KVF_ROWS_LINEAR_H

#include <stdint.h>

#include "avx2.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this many multiply-adds a team of threads costs more than it saves. */
#define PARALLEL_MIN_MACS (1 << 17)

/* The outputs [*n0, *n1) of N the calling thread of the current team computes: whole blocks
 * of nb outputs per thread, so that every tile but the last is full. */
static inline void thread_outputs(int64_t N, int64_t nb, int64_t *n0, int64_t *n1) {
    int64_t t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t blocks = (N + nb - 1) / nb;
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    *n0 = b0 * nb;
    *n1 = b1 * nb < N ? b1 * nb : N;
}

/* Inside a tile loop over the weight rows [n0, n1) (with w, sw and the x row m in scope): the
 * weight rows of the tile after the one at n, which the first pass of x rows over a panel
 * prefetches while it computes. The hardware prefetchers lose track of rows only K elements
 * long read a few at a time, so without it that pass waits on memory, and later passes (from
 * L2) leave it idle (AVX2-only Zen 2, docs/benchmarks.md). NULL when no full tile follows. */
#define NEXT_TILE(n, nt) (m == 0 && (n) + 2 * (nt) <= n1 ? w + ((n) + (nt)) * sw : 0)

/* Inside a kernel's rows function (with M, n0 and n1 in scope): every panel [p0, p1) of
 * `panel` weight rows, and within it every tile of MT_FULL (4) x rows from m, then the 1-3
 * rows left over; COLS(MT_) computes x rows [m, m + MT_) against the panel's weight rows. */
#define FOR_PANEL_TILES(panel, MT_FULL, COLS)                                                \
    for (int64_t p0 = n0; p0 < n1; p0 += (panel)) {                                          \
        _Static_assert((MT_FULL) == 4, "the leftover rows are 1-3");                         \
        const int64_t p1 = p0 + (panel) < n1 ? p0 + (panel) : n1;                            \
        int64_t m = 0;                                                                       \
        for (; m + (MT_FULL) <= M; m += (MT_FULL)) COLS(MT_FULL);                            \
        switch (M - m) {                                                                     \
        case 3: COLS(3); break;                                                              \
        case 2: COLS(2); break;                                                              \
        case 1: COLS(1); break;                                                              \
        }                                                                                    \
    }

#endif
