/* The groups of an m-grouped BF16 GEMM on Intel AMX tiles: for each group, rows d[s:e] = bf16(a[s:e] @ w_g^T)
 * with w_g [n, k], float32 accumulation, one round-to-nearest-even rounding per output.
 *
 * Why not oneDNN: torch has no CPU grouped GEMM of its own (torch._grouped_mm runs on CPU, no faster than a
 * matmul per group), and oneDNN's kernels at ~128 rows per group reach about half of what they reach on one
 * tall matrix (bench.grouped_gemm). This kernel keeps a group's packed rows (a few hundred KiB) in L2 and
 * streams each weight once, in 32-column panels, prefetching the next panel (or the next group's first) while
 * the current one computes, and writes straight into d (the lines of each block's output requested ahead).
 *
 * Layouts. A weight is packed once (deepep_amx_pack_bf16) into AMX B tiles: for each 16-column block and
 * each 32-deep k block, 16 rows of 64 bytes, row r holding the k pairs (2r, 2r + 1) of the 16 columns
 * (AMX's VNNI order); n is padded to a multiple of 32 and k to 32 with zeros. A is packed per call into
 * 16-row x 32-deep tiles (thread-local scratch), which also pads m and k with zeros.
 *
 * Numerics: TDPBF16PS (float32 accumulation of bf16 products, input and output denormals flushed, as in
 * oneDNN's AMX kernels), k blocks in ascending order, then VCVTNE2PS2BF16 (round to nearest even). The
 * summation order may differ from oneDNN's, so results agree with torch.matmul to bf16 rounding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TILE_K 32    /* bf16 elements of one A tile row (64 bytes) */
#define TILE_ELEMS 512 /* 16 rows x 32 bf16 */

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* Elements of a packed weight of n x k (what deepep_amx_pack_bf16 writes). */
int64_t deepep_amx_packed_elems(int64_t n, int64_t k) { return round_up(n, 32) * round_up(k, TILE_K); }

/* One tile of the packed layout from 16 columns (rows of w) of which `cols` exist and `valid` k values. */
static void pack_tile(uint16_t *t, const uint16_t *src, int64_t ldw, int64_t cols, int64_t valid)
{
    for (int64_t c = 0; c < 16; c++)
        for (int64_t e = 0; e < TILE_K; e++)
            t[(e >> 1) * 32 + 2 * c + (e & 1)] = c < cols && e < valid ? src[c * ldw + e] : 0;
}

#ifdef HAVE_AMX
/* A full tile by gathers: output row r holds the k pair (2r, 2r + 1) of the 16 columns, one 32-bit load each
 * (any ldw: the gather's byte offsets are column * ldw * 2). */
__attribute__((target("avx512f")))
static void pack_tile_full(uint16_t *t, const uint16_t *src, int64_t ldw)
{
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)ldw));
    for (int r = 0; r < 16; r++)
        _mm512_storeu_si512((void *)(t + r * 32), _mm512_i32gather_epi32(offsets, (const void *)(src + 2 * r), 2));
}
#endif

/* dst = w [n, k] (row r at w + r * ldw, unit column stride) in the tile layout above. */
void deepep_amx_pack_bf16(uint16_t *dst, const uint16_t *w, int64_t ldw, int64_t n, int64_t k)
{
    const int64_t kb_n = round_up(k, TILE_K) / TILE_K, nb_n = round_up(n, 32) / 16;
    for (int64_t nb = 0; nb < nb_n; nb++)
        for (int64_t kb = 0; kb < kb_n; kb++) {
            uint16_t *t = dst + (nb * kb_n + kb) * TILE_ELEMS;
            const int64_t cols = n - nb * 16 < 16 ? n - nb * 16 : 16;
            const int64_t valid = k - kb * TILE_K < TILE_K ? k - kb * TILE_K : TILE_K;
            const uint16_t *src = w + (cols > 0 ? nb * 16 * ldw : 0) + kb * TILE_K;
#ifdef HAVE_AMX
            /* offsets must fit the gather's int32 (the weight's span in bytes below 2 GiB) */
            if (cols == 16 && valid == TILE_K && 15 * ldw < (int64_t)1 << 30) {
                pack_tile_full(t, src, ldw);
                continue;
            }
#endif
            pack_tile(t, src, ldw, cols, valid);
        }
}

#ifdef HAVE_AMX

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 if the CPU has AMX-TILE and AMX-BF16 (and the AVX-512 F, BW and BF16 the packing and the rounding use),
 * the OS saves their state, and Linux grants this process the tile data permission (requested here;
 * torch's oneDNN requests the same one). A VM may hide any of these, so each is checked. */
int64_t deepep_amx_bf16_available(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)) /* AMX-BF16, -TILE */
        || !(b & (1u << 16)) || !(b & (1u << 30))) /* AVX512F, AVX512BW */
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) /* AVX512_BF16 */
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE: xgetbv is usable */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    /* the OS saves SSE/AVX (bits 1-2), the AVX-512 opmask and upper registers (5-7), XTILECFG and XTILEDATA (17-18) */
    const unsigned need = (3u << 1) | (7u << 5) | (3u << 17);
    if ((lo & need) != need)
        return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Each calling thread's packed rows of A (at most one L2 chunk), kept across calls and freed when the thread
 * exits (the pthread key's destructor). */
static __thread uint16_t *a_scratch;
static __thread int64_t a_scratch_elems;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void make_scratch_key(void) { pthread_key_create(&scratch_key, free); }

/* a_scratch of at least need elements; 0, or -1 if memory ran out. */
static int ensure_scratch(int64_t need)
{
    if (a_scratch_elems >= need)
        return 0;
    pthread_once(&scratch_once, make_scratch_key);
    free(a_scratch);
    a_scratch = aligned_alloc(64, (size_t)round_up(need * 2, 64));
    a_scratch_elems = a_scratch ? need : 0;
    pthread_setspecific(scratch_key, a_scratch);
    return a_scratch ? 0 : -1;
}

/* A [m, k] into 16-row tiles: tile (mb, kb) at out + (mb * kb_n + kb) * 512, zero padded. */
__attribute__((target("avx512f,avx512bw")))
static void pack_a(uint16_t *out, const uint16_t *a, int64_t lda, int64_t m, int64_t k, int64_t kb_n)
{
    const int64_t m16 = round_up(m, 16);
    for (int64_t r = 0; r < m16; r++) {
        uint16_t *row = out + (r / 16) * kb_n * TILE_ELEMS + (r % 16) * TILE_K;
        if (r >= m) {
            for (int64_t kb = 0; kb < kb_n; kb++)
                memset(row + kb * TILE_ELEMS, 0, 64);
            continue;
        }
        const uint16_t *src = a + r * lda;
        for (int64_t kb = 0; kb < kb_n; kb++) {
            const int64_t left = k - kb * TILE_K;
            const __mmask32 mask = left >= TILE_K ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
            _mm512_storeu_si512((void *)(row + kb * TILE_ELEMS), _mm512_maskz_loadu_epi16(mask, src + kb * TILE_K));
        }
    }
}

/* Rows [0, rows) and columns [0, cols) of a 32 x 32 float32 block (row stride 32) to bf16 d. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void store_block(uint16_t *d, int64_t ldd, const float *c, int64_t rows, int64_t cols)
{
    const __mmask32 mask = cols >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << cols) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(c + r * 32 + 16), _mm512_load_ps(c + r * 32));
        _mm512_mask_storeu_epi16(d + r * ldd, mask, (__m512i)v);
    }
}

/* Ask for ownership of the lines of d that the 32 x 32 block at (m0, n0) writes (rows below m, cols columns):
 * their reads-for-ownership then run under the products before the block instead of stalling its stores
 * (in bench.grouped_gemm that stall cost more than a tenth of the kernel's time). */
__attribute__((target("prfchw")))
static inline void prefetch_out(uint16_t *d, int64_t ldd, int64_t m0, int64_t n0, int64_t m, int64_t cols)
{
    const int64_t rows = m - m0 < 32 ? m - m0 : 32;
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *p = d + (m0 + r) * ldd + n0;
        _m_prefetchw(p);
        if (((uintptr_t)p & 63) + cols * 2 > 64) /* the row's part straddles two lines */
            _m_prefetchw(p + cols - 1);
    }
}

/* Rows of packed A kept in L2 while every panel of the weight streams past them. */
#define A_CHUNK_BYTES (768 * 1024)

/* The 32-column panels of the weight at bp over the packed rows [0, m16) of a_scratch (rows valid:
 * [0, m)), into d. next: the weight data to prefetch while the last panel computes, or NULL. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,prfchw")))
static void panels(uint16_t *d, int64_t ldd, const uint16_t *ap, const uint16_t *bp, int64_t m, int64_t m16,
                   int64_t n, int64_t kb_n, const char *next_last)
{
    float c[32 * 32] __attribute__((aligned(64)));
    const int64_t n32 = round_up(n, 32), panel_bytes = kb_n * TILE_ELEMS * 2 * 2; /* two 16-column blocks */
    const int64_t steps = (m16 + 31) / 32 * kb_n;
    /* the next panel's cache lines, spread over this panel's k steps */
    const int64_t per_step = round_up((panel_bytes + steps - 1) / steps, 64);
    for (int64_t n0 = 0; n0 < n32; n0 += 32) {
        const uint16_t *b0 = bp + (n0 / 16) * kb_n * TILE_ELEMS, *b1 = b0 + kb_n * TILE_ELEMS;
        const char *next = n0 + 32 < n32 ? (const char *)(b0 + 2 * kb_n * TILE_ELEMS) : next_last;
        const int64_t cols = n - n0 < 32 ? n - n0 : 32;
        for (int64_t m0 = 0; m0 < m16; m0 += 32) {
            const uint16_t *a0 = ap + (m0 / 16) * kb_n * TILE_ELEMS, *a1 = a0 + kb_n * TILE_ELEMS;
            const int64_t pf0 = (m0 / 32) * kb_n * per_step;
            const int two = m16 - m0 >= 32; /* else a last block of 16 rows */
            if (m0 == 0 && n0 == 0)
                prefetch_out(d, ldd, 0, 0, m, cols);
            if (m0 + 32 < m16) /* the block after this one: the next rows, else the next panel's first */
                prefetch_out(d, ldd, m0 + 32, n0, m, cols);
            else if (n0 + 32 < n32)
                prefetch_out(d, ldd, 0, n0 + 32, m, n - n0 - 32 < 32 ? n - n0 - 32 : 32);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kb_n; kb++) {
                if (next)
                    for (int64_t q = pf0 + kb * per_step; q < pf0 + (kb + 1) * per_step && q < panel_bytes; q += 64)
                        _mm_prefetch(next + q, _MM_HINT_T1);
                /* loads interleaved with the products that need them (tile registers are not renamed) */
                _tile_loadd(4, a0 + kb * TILE_ELEMS, 64);
                _tile_loadd(6, b0 + kb * TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b1 + kb * TILE_ELEMS, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, a1 + kb * TILE_ELEMS, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            if (two) {
                _tile_stored(2, c + 16 * 32, 128);
                _tile_stored(3, c + 16 * 32 + 16, 128);
            }
            store_block(d + m0 * ldd + n0, ldd, c, m - m0 < 32 ? m - m0 : 32, cols);
        }
    }
}

/* d[m, n] (row r at d + r * ldd) = bf16(a[m, k] (row r at a + r * lda) @ w^T), w packed by
 * deepep_amx_pack_bf16 at bp, a_scratch holding at least min(m, chunk) rows. Rows go in chunks whose
 * packed A fits L2 (A_CHUNK_BYTES); the weight streams once per chunk. next_bp: the weight to prefetch
 * while the last panel computes (the next group's), or NULL. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void gemm_one(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, const uint16_t *bp, int64_t m,
                     int64_t n, int64_t k, int64_t chunk, const uint16_t *next_bp)
{
    const int64_t kb_n = round_up(k, TILE_K) / TILE_K;
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
        pack_a(a_scratch, a + r0 * lda, lda, rows, k, kb_n);
        panels(d + r0 * ldd, ldd, a_scratch, bp, rows, round_up(rows, 16), n, kb_n,
               r0 + chunk < m ? (const char *)bp : (const char *)next_bp);
    }
}

/* The groups of an m-grouped GEMM in one call: for i < count, rows [starts[i], ends[i]) of d (row r at
 * d + r * ldd) = bf16(the same rows of a (row r at a + r * lda) @ w_i^T), w_i packed by
 * deepep_amx_pack_bf16 at bps[i] (n x k, the same for every group); each group's weight is prefetched
 * while the previous group's last panel computes. Other rows of d are not written. Returns 0, or -1 if
 * the A scratch could not be allocated (nothing written). The caller checks deepep_amx_bf16_available()
 * first and the runs' bounds. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
int64_t deepep_amx_gemm_bf16(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, int64_t n, int64_t k,
                             int64_t count, const int64_t *starts, const int64_t *ends, const uint16_t *const *bps)
{
    if (n <= 0 || count <= 0)
        return 0;
    const int64_t row_elems = round_up(k, TILE_K);
    int64_t chunk = A_CHUNK_BYTES / (row_elems * 2) / 32 * 32, most = 0;
    if (chunk < 32)
        chunk = 32;
    for (int64_t i = 0; i < count; i++)
        if (ends[i] - starts[i] > most)
            most = ends[i] - starts[i];
    const int64_t need = (most < chunk ? round_up(most, 16) : chunk) * row_elems;
    if (ensure_scratch(need))
        return -1;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    for (int64_t i = 0; i < count; i++)
        if (ends[i] > starts[i])
            gemm_one(d + starts[i] * ldd, ldd, a + starts[i] * lda, lda, bps[i], ends[i] - starts[i], n, k, chunk,
                     i + 1 < count ? bps[i + 1] : NULL);
    _tile_release();
    return 0;
}

#else /* no AMX build: the library reports it unavailable and the callers use oneDNN */

int64_t deepep_amx_bf16_available(void) { return 0; }

int64_t deepep_amx_gemm_bf16(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, int64_t n, int64_t k,
                             int64_t count, const int64_t *starts, const int64_t *ends, const uint16_t *const *bps)
{
    (void)d, (void)ldd, (void)a, (void)lda, (void)n, (void)k, (void)count, (void)starts, (void)ends, (void)bps;
    return -2;
}

#endif
