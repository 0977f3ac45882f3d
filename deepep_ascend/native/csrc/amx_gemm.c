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
 * FP4 weights (MXFP4: e2m1 codes, one UE8M0 exponent per column and 32-deep k block) are packed once
 * (deepep_amx_pack_fp4) into the same tile order at a quarter of the bytes: per tile 16 rows of 16 bytes, byte
 * c of row r holding column c's k pair (2r, 2r + 1) as two nibbles (low first), then, after all tiles, 16
 * exponent bytes per tile. Each 32-column panel is decoded into bf16 tiles (thread-local) while the panel
 * before it multiplies: a table lookup per nibble and the exponent added to the bf16 exponent field, which
 * gives the same bits as the dequantized weight, so results equal the bf16 kernel's on deepep's dequantized
 * copy, bit for bit. The weight then streams from memory at 0.53 bytes per element instead of 2.
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

/* Bytes of a packed FP4 weight of n x k (what deepep_amx_pack_fp4 writes): 256 nibble bytes and 16 exponent
 * bytes per 16 x 32 tile. */
int64_t deepep_amx_fp4_packed_bytes(int64_t n, int64_t k) { return deepep_amx_packed_elems(n, k) / 512 * 272; }

/* dst = the FP4 weight w [n, k] (packed nibbles [n, k/2], row r at w + r * ldw bytes, k even) with exponents
 * e [n, ceil(k/32)] (UE8M0 bytes, row r at e + r * lde) in the FP4 tile layout above; padding columns and k
 * values get code 0 (+0) and exponent 127. The caller checks that every exponent is in [2, 252], where every
 * nonzero value stays a normal bf16 (the decoder adds exponents without range checks). */
void deepep_amx_pack_fp4(uint8_t *dst, const uint8_t *w, int64_t ldw, const uint8_t *e, int64_t lde, int64_t n,
                         int64_t k)
{
    const int64_t kb_n = round_up(k, TILE_K) / TILE_K, nb_n = round_up(n, 32) / 16, pairs = k / 2;
    uint8_t *exps = dst + nb_n * kb_n * 256;
    for (int64_t nb = 0; nb < nb_n; nb++)
        for (int64_t kb = 0; kb < kb_n; kb++) {
            uint8_t *t = dst + (nb * kb_n + kb) * 256, *te = exps + (nb * kb_n + kb) * 16;
            for (int64_t c = 0; c < 16; c++) {
                const int64_t col = nb * 16 + c;
                te[c] = col < n ? e[col * lde + kb] : 127;
                for (int64_t r = 0; r < 16; r++)
                    t[r * 16 + c] = col < n && kb * 16 + r < pairs ? w[col * ldw + kb * 16 + r] : 0;
            }
        }
}

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

/* bf16 bits of the e2m1 codes 0..15 (code 8, "-0", as +0, as deepep's dequantization gives it). */
static const uint16_t e2m1_bf16[32] __attribute__((aligned(64))) = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x0000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* tiles FP4 tiles (nibbles at nib, 256 bytes each; exponents at exps, 16 bytes each) into bf16 B tiles at out:
 * per tile row, the 16 bytes widen to 16 dwords whose two words take the low and the high nibble, a word
 * permute looks up their bf16 bits, and the column's exponent minus 127 is added to the exponent field of
 * the nonzero ones (exact: the packer's range check keeps them normal). */
__attribute__((target("avx512f,avx512bw")))
static void decode_fp4(uint16_t *out, const uint8_t *nib, const uint8_t *exps, int64_t tiles)
{
    const __m512i lut = _mm512_load_si512((const void *)e2m1_bf16), low = _mm512_set1_epi32(0x000F000F),
                  magnitude = _mm512_set1_epi16(7), bias = _mm512_set1_epi32(127);
    for (int64_t t = 0; t < tiles; t++, nib += 256, exps += 16, out += TILE_ELEMS) {
        const __m512i e = _mm512_slli_epi32(
            _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)exps)), bias), 7);
        const __m512i off = _mm512_mask_blend_epi16(0xAAAAAAAA, e, _mm512_slli_epi32(e, 16));
        for (int r = 0; r < 16; r++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + r * 16)));
            const __m512i idx = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), low);
            const __m512i v = _mm512_permutexvar_epi16(idx, lut);
            _mm512_store_si512((void *)(out + r * 32),
                               _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(idx, magnitude), v, off));
        }
    }
}

/* Rows of packed A kept in L2 while every panel of the weight streams past them. */
#define A_CHUNK_BYTES (768 * 1024)

/* The 32-column panels of the weight at w over the packed rows [0, m16) of ap (rows valid: [0, m)), into d.
 * bf16 tiles are read where they are. FP4 tiles (dec: room for two decoded panels) are decoded one panel
 * ahead: the first before the loop, each next one a few tiles per k step of the current panel's products,
 * so the decoding (vector ports) runs beside the tile products (the AMX unit) instead of before them.
 * next_last: the weight data to prefetch while the last panel computes, or NULL. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,prfchw")))
static void panels(uint16_t *d, int64_t ldd, const uint16_t *ap, const void *w, uint16_t *dec, int64_t m,
                   int64_t m16, int64_t n, int64_t kb_n, const char *next_last)
{
    float c[32 * 32] __attribute__((aligned(64)));
    const int64_t n32 = round_up(n, 32), tile_bytes = dec ? 256 : TILE_ELEMS * 2;
    const int64_t panel_bytes = kb_n * tile_bytes * 2; /* two 16-column blocks */
    const int64_t steps = (m16 + 31) / 32 * kb_n, panel_tiles = 2 * kb_n;
    /* the next panel's cache lines (FP4: the one after it, the next being decoded), spread over the k steps */
    const int64_t per_step = round_up((panel_bytes + steps - 1) / steps, 64), ahead = dec ? 2 : 1;
    const uint8_t *exps = dec ? (const uint8_t *)w + n32 / 16 * kb_n * 256 : NULL;
    if (dec)
        decode_fp4(dec, (const uint8_t *)w, exps, panel_tiles);
    for (int64_t n0 = 0; n0 < n32; n0 += 32) {
        const char *wp = (const char *)w + (n0 / 16) * kb_n * tile_bytes;
        const char *next = n0 + 32 * ahead < n32 ? wp + ahead * panel_bytes : next_last;
        const uint16_t *b0 = dec ? dec + ((n0 / 32) & 1) * panel_tiles * TILE_ELEMS : (const uint16_t *)wp;
        const uint16_t *b1 = b0 + kb_n * TILE_ELEMS;
        /* FP4: where the next panel is decoded meanwhile, or NULL */
        uint16_t *nd = dec && n0 + 32 < n32 ? dec + (((n0 / 32) + 1) & 1) * panel_tiles * TILE_ELEMS : NULL;
        const uint8_t *nn = nd ? (const uint8_t *)wp + panel_bytes : NULL;
        const uint8_t *ne = nd ? exps + (n0 / 16 + 2) * kb_n * 16 : NULL;
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
                if (nd) {
                    const int64_t step = (m0 / 32) * kb_n + kb, t0 = step * panel_tiles / steps,
                                  t1 = (step + 1) * panel_tiles / steps;
                    if (t1 > t0)
                        decode_fp4(nd + t0 * TILE_ELEMS, nn + t0 * 256, ne + t0 * 16, t1 - t0);
                }
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
 * deepep_amx_pack_bf16 (or, with dec, by deepep_amx_pack_fp4) at w, a_scratch holding at least min(m, chunk)
 * rows. Rows go in chunks whose packed A fits L2 (A_CHUNK_BYTES); the weight streams once per chunk. next_w:
 * the weight to prefetch while the last panel computes (the next group's), or NULL. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void gemm_one(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, const void *w, uint16_t *dec,
                     int64_t m, int64_t n, int64_t k, int64_t chunk, const void *next_w)
{
    const int64_t kb_n = round_up(k, TILE_K) / TILE_K;
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
        pack_a(a_scratch, a + r0 * lda, lda, rows, k, kb_n);
        panels(d + r0 * ldd, ldd, a_scratch, w, dec, rows, round_up(rows, 16), n, kb_n,
               r0 + chunk < m ? (const char *)w : (const char *)next_w);
    }
}

/* The groups of an m-grouped GEMM in one call: for i < count, rows [starts[i], ends[i]) of d (row r at
 * d + r * ldd) = bf16(the same rows of a (row r at a + r * lda) @ w_i^T), w_i packed by
 * deepep_amx_pack_bf16 at bps[i] (with fp4 nonzero: by deepep_amx_pack_fp4) (n x k, the same for every
 * group); each group's weight is prefetched while the previous group's last panel computes. Other rows of d
 * are not written. Returns 0, or -1 if the scratch could not be allocated (nothing written). The caller
 * checks deepep_amx_bf16_available() first and the runs' bounds. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
int64_t deepep_amx_gemm_bf16(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, int64_t n, int64_t k,
                             int64_t count, const int64_t *starts, const int64_t *ends, const void *const *bps,
                             int64_t fp4)
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
    const int64_t a_elems = (most < chunk ? round_up(most, 16) : chunk) * row_elems;
    /* with fp4, two decoded panels (each two 16-column blocks of bf16 tiles) after the packed rows */
    if (ensure_scratch(a_elems + (fp4 ? 64 * row_elems : 0)))
        return -1;
    uint16_t *dec = fp4 ? a_scratch + a_elems : NULL;
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
            gemm_one(d + starts[i] * ldd, ldd, a + starts[i] * lda, lda, bps[i], dec, ends[i] - starts[i], n, k,
                     chunk, i + 1 < count ? bps[i + 1] : NULL);
    _tile_release();
    return 0;
}

#else /* no AMX build: the library reports it unavailable and the callers use oneDNN */

int64_t deepep_amx_bf16_available(void) { return 0; }

int64_t deepep_amx_gemm_bf16(uint16_t *d, int64_t ldd, const uint16_t *a, int64_t lda, int64_t n, int64_t k,
                             int64_t count, const int64_t *starts, const int64_t *ends, const void *const *bps,
                             int64_t fp4)
{
    (void)d, (void)ldd, (void)a, (void)lda, (void)n, (void)k, (void)count, (void)starts, (void)ends, (void)bps;
    (void)fp4;
    return -2;
}

#endif
