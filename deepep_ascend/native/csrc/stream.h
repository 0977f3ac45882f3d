/* Streaming (non-temporal) stores: copies and zeroing into memory that is not cached and will not be read back
 * soon. */
#ifndef DEEPEP_ASCEND_STREAM_H
#define DEEPEP_ASCEND_STREAM_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copy n bytes from src to dst (not overlapping). A plain store into a line that is not cached first reads the
 * line from memory (read for ownership) and later writes it back; a streaming store writes whole lines without
 * reading them, and leaves the cache to other data. So a copy into cold destination lines moves about two
 * thirds of the bytes a memcpy moves; a destination read back soon is then read from memory rather than from
 * the cache (docs/design/data-path.md, "Streaming stores into `recv_x`" and "Streaming stores of the combine's
 * returned rows", measure both sides). The aligned body by 16-byte streaming stores, the ends and copies under
 * 256 bytes by memcpy. The stores are weakly ordered: the caller issues stream_fence() before it publishes them
 * (this core's own loads see them in program order). */
static inline void copy_streaming(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__SSE2__)
    const size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (n < 256) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        const __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Rows from this many bytes on are zeroed with streaming stores. */
#define ZERO_STREAM_BYTES 1024

/* Zero nbytes at p. Long runs by streaming stores of whole 64-byte lines: zeroing an expanded layout's padding
 * (tens of MB no one reads before the experts' GEMMs, python -m bench ep --expand --zero-padding) moves half the
 * bytes a memset moves and leaves the cache to the rows around it. The partial lines at either end, and short
 * runs, by memset. The caller fences (stream_fence) once after its last run. */
static inline void zero_streaming(uint8_t *p, int64_t nbytes)
{
#if defined(__SSE2__)
    if (nbytes >= ZERO_STREAM_BYTES) {
        const int64_t head = (int64_t)((64 - ((uintptr_t)p & 63)) & 63);
        memset(p, 0, (size_t)head);
        uint8_t *q = p + head;
        const int64_t body = (nbytes - head) & ~(int64_t)63;
        const __m128i z = _mm_setzero_si128();
        for (int64_t i = 0; i < body; i += 64) {
            _mm_stream_si128((__m128i *)(q + i), z);
            _mm_stream_si128((__m128i *)(q + i + 16), z);
            _mm_stream_si128((__m128i *)(q + i + 32), z);
            _mm_stream_si128((__m128i *)(q + i + 48), z);
        }
        memset(q + body, 0, (size_t)(nbytes - head - body));
        return;
    }
#endif
    memset(p, 0, (size_t)nbytes);
}

/* Copy n bytes by streaming stores (copy_streaming) when stream is nonzero, else by memcpy: a call decides once
 * (deepep_ll_streams) and copies each of its rows with this. */
static inline void copy_maybe_streaming(uint8_t *dst, const uint8_t *src, size_t n, int stream)
{
    if (stream)
        copy_streaming(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* Whether side's stores of a call's rows_bytes bytes of rows are streaming stores, under the mode in force: sides
 * and modes in ll_calls.c (deepep_ll_stream_rows), which keeps them. */
int64_t deepep_ll_streams(int64_t side, int64_t rows_bytes);

/* Order every earlier streaming store before the stores that follow. */
static inline void stream_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

#endif
