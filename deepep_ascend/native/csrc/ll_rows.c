/* Row moves of the data plane in one pass: dst row dst_rows[i] = src row src_rows[i], nbytes each;
 * and the low-latency combine's weighted sum of rows read where they lie.
 *
 * torch has no gather-and-scatter: it gathers into a temporary (index_select) and scatters that
 * (index_copy_), two passes over the rows and a third allocation-sized write; the low-latency paths
 * move every (token, expert) row this way (senders into the receivers' slots, receivers into
 * recv_x). Here each row is one memcpy straight into its final place.
 *
 * Zeroing rows (an expanded layout's padding) streams whole cache lines to memory (deepep_zero_rows, stream.h).
 *
 * Plain C, no Python headers: loaded with ctypes (which releases the GIL). The caller
 * (deepep_ascend.native.copy_rows, zero_rows) checks shapes; the kernels check the row numbers against the
 * matrices in a first pass (n integer compares, far cheaper than a torch reduction per call at the
 * few rows of a decode step) and write nothing when one is out of range.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "stream.h"

/* Whether every one of the n row numbers lies in [lo, hi). */
static int rows_in(const int64_t *rows, int64_t n, int64_t lo, int64_t hi) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
        bad |= (rows[i] < lo) | (rows[i] >= hi);
    return !bad;
}

/* n rows of nbytes; dst row r at dst + r * dst_stride, src row r at src + r * src_stride (bytes);
 * dst_rows / src_rows: int64 row numbers in [0, dst_limit) / [0, src_limit), or NULL for 0..n-1 (the
 * caller checks n against the limit then). Rows may not overlap between dst and src (the caller's
 * operands are distinct buffers). Returns 0, or 1 (nothing written) when a row number is out of range. */
int64_t deepep_copy_rows(int64_t n, int64_t nbytes, uint8_t *dst, int64_t dst_stride, const int64_t *dst_rows,
                         int64_t dst_limit, const uint8_t *src, int64_t src_stride, const int64_t *src_rows,
                         int64_t src_limit) {
    if ((dst_rows && !rows_in(dst_rows, n, 0, dst_limit)) || (src_rows && !rows_in(src_rows, n, 0, src_limit)))
        return 1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t d = dst_rows ? dst_rows[i] : i;
        const int64_t s = src_rows ? src_rows[i] : i;
        memcpy(dst + d * dst_stride, src + s * src_stride, (size_t)nbytes);
    }
    return 0;
}

/* n rows of nbytes zeroed; row r at dst + r * stride (bytes); rows: int64 row numbers in [0, limit), or
 * NULL for 0..n-1 (the caller checks n against the limit then). Returns 0, or 1 (nothing written) when a
 * row number is out of range. Rows adjacent in memory (consecutive numbers of a dense matrix) are zeroed
 * as one run. The stores are fenced before returning, so that any later synchronisation publishes them. */
int64_t deepep_zero_rows(int64_t n, int64_t nbytes, uint8_t *dst, int64_t stride, const int64_t *rows,
                         int64_t limit) {
    if (rows && !rows_in(rows, n, 0, limit))
        return 1;
    int64_t i = 0;
    while (i < n) {
        const int64_t r = rows ? rows[i] : i;
        int64_t m = 1;
        if (stride == nbytes)
            while (i + m < n && (rows ? rows[i + m] : i + m) == r + m)
                ++m;
        zero_streaming(dst + r * stride, m * nbytes);
        i += m;
    }
    stream_fence();
    return 0;
}

/* The low-latency combine's reduction in one pass over its rows:
 *
 *   out[t] = bf16( ((+0.0 + f32(rows[idx[t,0]]) * w[t,0]) + f32(rows[idx[t,1]]) * w[t,1]) + ... )
 *
 * over the slots j = 0..k-1 of token t whose idx[t,j] >= 0, in slot order, each product rounded to
 * float32 before its add, one rounding to BF16 at the end (torch's y = f32(row) * w; acc += y;
 * acc.to(bf16), the bits of deepep_ascend.ep.low_latency's torch path). A token with no slot gets +0.0.
 *
 * rows: row r at rows + r * row_ld (elements); idx, w: [n, k] row-major (int64, float32); out row t at
 * out + t * out_ld. idx values must lie in [-1, num_rows): returns 0, or 1 (nothing written) when
 * one does not.
 */
MULTIVERSION
int64_t deepep_weighted_sum_rows_bf16(int64_t n, int64_t hidden, int64_t k, const uint16_t *rows, int64_t row_ld,
                                      int64_t num_rows, const int64_t *idx, const float *w, uint16_t *out,
                                      int64_t out_ld, uint16_t nan_bits)
{
    if (!rows_in(idx, n * k, -1, num_rows))
        return 1;
    weighted_sum_rows_into(n, hidden, k, rows, row_ld, idx, w, out, out_ld, nan_bits, NULL, 1, NULL);
    return 0;
}
