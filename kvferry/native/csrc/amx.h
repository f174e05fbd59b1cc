/* AMX tiles for the C kernels: whether the compiler knows them (KVF_HAVE_AMX), Linux's
 * permission for the tile state, and the one tile shape every kernel uses. A kernel that
 * includes this defines _DEFAULT_SOURCE (for syscall()) before any other include. */
#ifndef KVF_AMX_H
#define KVF_AMX_H
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KVF_HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TAMX_ATTR target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16")
#define TAMX __attribute__((TAMX_ATTR, always_inline)) static inline

/* Linux hands out the tile registers' state to processes that ask (once per process). */
static int amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* Every tile 16 rows of 64 bytes (16 x 32 bf16, 16 pairs x 16, or 16 x 16 fp32). oneDNN
 * configures its own before each product, so each kernel call does so too, on each thread,
 * and releases the tiles when done. */
__attribute__((TAMX_ATTR, unused)) static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}
#else
#define KVF_HAVE_AMX 0
#endif
#endif
