/* AMX tiles (Intel Sapphire Rapids and later): whether they run, and their configuration record. Shared by
 * the GEMM tiles (gemm_tile.h) and the LoRA segment kernel (lora_amx.h); each library that includes this
 * has its own switch, gemm_amx (kernels/cpu/gemm.py's amx() sets them all). */
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GEMM_AMX 1
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
long syscall(long number, ...);     /* glibc declares it only outside strict -std=c11 (an error on GCC >= 14) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Whether the tiles run on AMX: the kernel must grant this process the tile state (Linux >= 5.16, asked
 * once at load); LORAPLEX_CPU_AMX=0 turns it off (gemm_amx switches it for tests and benchmarks). */
static int amx_permitted, amx_on;

__attribute__((constructor)) static void amx_request(void) {
    amx_permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    const char *env = getenv("LORAPLEX_CPU_AMX");
    amx_on = amx_permitted && !(env && env[0] == '0');
}
#else
#define GEMM_AMX 0
#endif

/* on: 1 AMX tiles where this CPU and kernel allow, 0 vdpbf16ps tiles, -1 as they are -> 1 if AMX tiles run
 * now (this library's own switch). */
int gemm_amx(int on) {
#if GEMM_AMX
    if (on >= 0) amx_on = on && amx_permitted;
    return amx_on;
#else
    (void)on;
    return 0;
#endif
}
