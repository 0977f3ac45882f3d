/* Streaming (non-temporal) stores: copies into memory that is not cached and will not be read back soon. */
#ifndef DEEPEP_ASCEND_STREAM_H
#define DEEPEP_ASCEND_STREAM_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Copy n bytes from src to dst (not overlapping). A plain store into a line that is not cached first reads the
 * line from memory (read for ownership) and later writes it back; a streaming store writes whole lines without
 * reading them, and leaves the cache to other data. So a copy into cold destination lines moves about two
 * thirds of the bytes a memcpy moves; a destination read back soon is then read from memory rather than from
 * the cache (docs/design/data-path.md, "Streaming stores into `recv_x`", measures both sides). The aligned body
 * by 16-byte streaming stores, the ends and short copies by memcpy. The stores are weakly ordered: the caller issues stream_fence()
 * before it publishes them (this core's own loads see them in program order). */
static inline void copy_streaming(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__)
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

/* Order every earlier streaming store before the stores that follow. */
static inline void stream_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

#endif
