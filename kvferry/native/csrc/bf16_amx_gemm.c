/*
 * out = x @ w.T (+ bias) for bf16 x, w, bias and out on AMX tiles, for steps of a few hundred
 * rows (a prompt's prefill), with the weight in a packed copy made once, at load time.
 *
 * The small-step AMX kernel (bf16_linear.c) reads each weight in place, once per call: right
 * where a step is bound by the weight's bytes. A step of hundreds of rows is bound by the tile
 * products, which run at their rate only while their operands come from L1 and L2. So each
 * thread takes a run of 32-output panels, a block of up to NC_MAX outputs at a time, and for
 * each chunk of KC inputs passes every 32 x rows (that chunk of x, for all rows, in L2) over
 * each panel's chunk (16 KiB, in L1), 2 x 2 tiles at a time: one tile load per product. The
 * block's fp32 sums for all rows wait in a per-thread buffer (in L2) for the next chunk; the
 * last chunk rounds them into out. x is laid out in tiles once per call, chunk by chunk.
 *
 * Packed weight (kvf_bf16_amx_pack): per panel of 32 outputs, per chunk of KC inputs, per
 * half (16 outputs), per step of 32 inputs, the tile of the products' right operand: for
 * each of the 16 input pairs, the pair of each of the 16 outputs. N and K are multiples of 32.
 *
 * Sums run in fp32 over exact bf16 products and are rounded to bf16 once (to nearest even),
 * as oneDNN's bf16 GEMM does; only the order of the sums differs.
 */
#define _DEFAULT_SOURCE /* syscall(), for the request for the tile state */
#include <stdint.h>
#include <stdlib.h>

#include "amx.h"
#include "rows_linear.h"
#include "transpose16.h"

#define KC 256                  /* inputs per chunk: one panel's chunk is 16 KiB */
#define SUMS_BYTES (512 * 1024) /* each thread's fp32 sums: up to NC_MAX outputs x all rows */
#define NC_MAX 128

#if KVF_HAVE_AMX
int kvf_bf16_amx_gemm_ready(void) { return amx_permitted() ? 0 : -1; }

/* Steps (of 32 inputs) in the chunk of inputs from k0. */
static inline int64_t chunk_steps(int64_t k0, int64_t K) {
    return (K - k0 < KC ? K - k0 : KC) / 32;
}

/* The packed weight: panel j's chunk from k0 starts at j * 32 * K + k0 * 32; within it, half
 * h's step t at (h * steps + t) * 512. */
__attribute__((target("avx512f"))) static void
pack_panel(const uint16_t *w, int64_t sw, int64_t K, int64_t j, uint16_t *dst) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t steps = chunk_steps(k0, K);
        for (int h = 0; h < 2; h++)
            for (int64_t t = 0; t < steps; t++) {
                __m512i r[16];
                const uint16_t *src = w + (32 * j + 16 * h) * sw + k0 + 32 * t;
                for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(src + i * sw));
                transpose16(r); /* rows of 16 pairs -> for each pair, the 16 outputs' */
                uint16_t *d = dst + j * 32 * K + k0 * 32 + (h * steps + t) * 512;
                for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(d + i * 32), r[i]);
            }
    }
}

/* x's tile for rows block b (16 rows), input step t, in the per-call layout: chunk by chunk,
 * within a chunk block by block, within a block step by step. */
static inline int64_t x_tile(int64_t b, int64_t t, int64_t blocks, int64_t K) {
    const int64_t k0 = t * 32 / KC * KC;
    return (k0 / 32 * blocks + b * chunk_steps(k0, K) + (t - k0 / 32)) * 512;
}

/* This thread's share of x's blocks laid out in tiles (zero rows past M). */
__attribute__((target("avx512f"))) static void
layout_x(const uint16_t *x, int64_t sx, int64_t M, int64_t K, uint16_t *xt) {
    const int64_t blocks = (M + 15) / 16, steps = K / 32;
    int64_t b0 = 0, b1 = blocks;
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
#endif
    for (int64_t b = b0; b < b1; b++)
        for (int64_t s = 0; s < steps; s++) {
            uint16_t *d = xt + x_tile(b, s, blocks, K);
            for (int64_t i = 0; i < 16; i++) {
                const int64_t m = b * 16 + i;
                _mm512_storeu_si512((void *)(d + i * 32),
                                    m < M ? _mm512_loadu_si512((const void *)(x + m * sx + s * 32))
                                          : _mm512_setzero_si512());
            }
        }
}

/* The 32 outputs' tiles (c[0], c[1]: outputs n.. and n + 16.., rows m0..; c[2], c[3] the
 * next 16 rows) over one chunk: 2 x 2 products per step. */
TAMX void products(const uint16_t *a0, const uint16_t *p, int64_t steps, int two, int first,
                   float (*c)[256]) {
    const uint16_t *a1 = a0 + steps * 512, *p1 = p + steps * 512;
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c[0], 64);
        _tile_loadd(1, c[1], 64);
        if (two) {
            _tile_loadd(2, c[2], 64);
            _tile_loadd(3, c[3], 64);
        }
    }
    for (int64_t t = 0; t < steps; t++) {
        _tile_loadd(4, p + t * 512, 64);
        _tile_loadd(5, p1 + t * 512, 64);
        _tile_loadd(6, a0 + t * 512, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        if (two) {
            _tile_loadd(7, a1 + t * 512, 64);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (two) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

/* Rows [m0, m0 + mc) of outputs n .. n + 31 from their sums (c0: the first 16, c1: the next)
 * plus the bias, rounded: one 64-byte store a row. */
TAMX void emit(const float *c0, const float *c1, const uint16_t *bias, int64_t m0, int64_t mc,
               int64_t n, uint16_t *out, int64_t so) {
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n)));
        const __m512i raw1 =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n + 16)));
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
    }
    for (int64_t i = 0; i < mc; i++) {
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c0 + i * 16), b0));
        const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c1 + i * 16), b1));
        _mm512_storeu_si512((void *)(out + (m0 + i) * so + n),
                            _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)lo), (__m256i)hi, 1));
    }
}

/* The calling thread's x in tiles, and each thread's sums. */
static _Thread_local uint16_t *xbuf;
static _Thread_local int64_t xbuf_len;
static _Thread_local float (*sums)[256];
static _Thread_local int64_t sums_len;

/* Outputs [n0, n1) (whole panels) for all M rows. Returns -2 when out of memory. */
__attribute__((TAMX_ATTR)) static int
gemm(const uint16_t *xt, const uint16_t *packed, const uint16_t *bias, int64_t M, int64_t n0,
     int64_t n1, int64_t K, uint16_t *out, int64_t so) {
    const int64_t blocks = (M + 15) / 16, pairs = (blocks + 1) / 2;
    int64_t nc = SUMS_BYTES / (int64_t)sizeof(float) / (pairs * 32) / 32 * 32;
    nc = nc > NC_MAX ? NC_MAX : nc < 32 ? 32 : nc;
    const int64_t len = pairs * (nc / 32) * 4;
    if (!sums || sums_len < len) {
        free(sums);
        sums = aligned_alloc(64, (size_t)len * sizeof *sums);
        sums_len = sums ? len : 0;
        if (!sums) return -2;
    }
    amx_configure();
    for (int64_t n = n0; n < n1; n += nc) {
        const int64_t np = ((n1 - n < nc ? n1 - n : nc)) / 32;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t steps = chunk_steps(k0, K);
            for (int64_t j = 0; j < np; j++) {
                /* The next panel chunk in this loop's order, fetched a slice per row block
                 * while this one runs: the tiles' own loads would meet memory's latency one
                 * tile at a time. */
                int64_t fn = n, fk = k0, fj = j + 1;
                if (fj == np && (fj = 0, fk += KC) >= K) fk = 0, fn += nc;
                const uint16_t *nx = fn < n1 ? packed + (fn / 32 + fj) * 32 * K + fk * 32 : 0;
                const int64_t lines = chunk_steps(fk, K) * 32;
                const uint16_t *p = packed + (n / 32 + j) * 32 * K + k0 * 32;
                for (int64_t q = 0; q < pairs; q++) {
                    const int two = 2 * q + 1 < blocks;
                    float(*c)[256] = sums + (q * np + j) * 4;
                    if (nx)
                        for (int64_t l = lines * q / pairs; l < lines * (q + 1) / pairs; l++)
                            _mm_prefetch((const char *)nx + l * 64, _MM_HINT_T0);
                    products(xt + x_tile(2 * q, k0 / 32, blocks, K), p, steps, two, k0 == 0, c);
                    if (k0 + KC < K) continue;
                    for (int b = 0; b <= two; b++) {
                        const int64_t m0 = (2 * q + b) * 16, mc = M - m0 < 16 ? M - m0 : 16;
                        emit(c[2 * b], c[2 * b + 1], bias, m0, mc, n + 32 * j, out, so);
                    }
                }
            }
        }
    }
    _tile_release();
    return 0;
}
#else
int kvf_bf16_amx_gemm_ready(void) { return -1; }
#endif

/* w [N, K] (row stride sw) into dst (N x K elements). Returns 0, -1 when N or K is not a
 * multiple of 32 or AMX cannot run here (the packing itself takes AVX-512). */
int kvf_bf16_amx_pack(const uint16_t *w, int64_t sw, int64_t N, int64_t K, uint16_t *dst,
                      int num_threads) {
#if KVF_HAVE_AMX
    if (kvf_bf16_amx_gemm_ready() != 0 || N % 32 || K % 32 || N <= 0 || K <= 0) return -1;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t j = 0; j < N / 32; j++) pack_panel(w, sw, K, j, dst);
    return 0;
#else
    (void)w, (void)sw, (void)N, (void)K, (void)dst, (void)num_threads;
    return -1;
#endif
}

/* x [M, K] (row stride sx), packed (from kvf_bf16_amx_pack), bias [N] or NULL, out [M, N]
 * (row stride so). Returns 0; -1 when the call is not one this kernel takes (no AMX, N or K
 * not a multiple of 32), -2 when out of memory (out is then incomplete). */
int kvf_bf16_amx_gemm(const uint16_t *x, int64_t sx, const uint16_t *packed, const uint16_t *bias,
                      int64_t M, int64_t N, int64_t K, uint16_t *out, int64_t so, int num_threads) {
#if KVF_HAVE_AMX
    if (kvf_bf16_amx_gemm_ready() != 0 || N % 32 || K % 32 || N <= 0 || K <= 0) return -1;
    if (M <= 0) return 0;
    const int64_t need = (M + 15) / 16 * 16 * K;
    if (!xbuf || xbuf_len < need) { /* kept: a fresh buffer per call is paged in every time */
        free(xbuf);
        xbuf = aligned_alloc(64, (size_t)need * sizeof *xbuf);
        xbuf_len = xbuf ? need : 0;
        if (!xbuf) return -2;
    }
    uint16_t *xt = xbuf;
    int rc = 0;
#pragma omp parallel num_threads(num_threads)
    {
        layout_x(x, sx, M, K, xt);
#pragma omp barrier
        int64_t n0, n1;
        thread_outputs(N, 32, &n0, &n1);
        if (n0 < n1 && gemm(xt, packed, bias, M, n0, n1, K, out, so)) {
#pragma omp atomic write
            rc = -2;
        }
    }
    return rc;
#else
    (void)x, (void)sx, (void)packed, (void)bias, (void)M, (void)N, (void)K, (void)out, (void)so;
    (void)num_threads;
    return -1;
#endif
}
