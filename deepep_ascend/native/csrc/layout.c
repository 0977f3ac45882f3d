/* The normal path's routing counts in one pass each: get_dispatch_layout's counts and mask, the sender's
 * channel prefix matrix and send_head, the receiver's channel prefix matrix.
 *
 * Each is a handful of integer loops over small arrays (N tokens x K slots, N x R ranks); torch or numpy
 * spend a dozen operator calls on them, each costing microseconds of dispatch overhead at the token
 * counts of a decode or a small prefill step. Results are integers: the same values as the numpy paths of
 * deepep_ascend.ep.layout, which remain where the library is not built.
 *
 * Plain C, no Python headers: loaded with ctypes. The caller (deepep_ascend.native.layout) checks dtypes,
 * shapes and contiguity; the kernels check values and write nothing when one is out of range.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* topk [n, k] int64 expert ids in [-1, num_experts) (-1: none); num_experts a positive multiple of
 * num_ranks. Writes per_rank [num_ranks] int32 (tokens with an expert on each rank, once per token),
 * per_expert [num_experts] int32 ((token, slot) pairs per expert), in_rank [n, num_ranks] bool (uint8 0/1),
 * and, unless last_slot is NULL, last_slot [n, num_ranks] int64: the token's last top-k slot j on each rank,
 * -1 where it has none (EPBuffer's combine key, docs/semantics/deepep-api.md §13.5).
 * Returns 0, 1 (nothing written) when an id is out of range, or 2 (nothing written) when out of memory. */
int64_t deepep_dispatch_layout(const int64_t *topk, int64_t n, int64_t k, int64_t num_experts, int64_t num_ranks,
                               int32_t *per_rank, int32_t *per_expert, uint8_t *in_rank, int64_t *last_slot) {
    for (int64_t i = 0; i < n * k; ++i)
        if (topk[i] < -1 || topk[i] >= num_experts)
            return 1;
    const int64_t local = num_experts / num_ranks;
    /* each expert's rank from a table: an integer division per (token, slot) costs more than the rest of the
     * pass (tens of cycles each) */
    int32_t small[1024], *rank_of = num_experts <= 1024 ? small : malloc((size_t)num_experts * sizeof(int32_t));
    if (!rank_of)
        return 2;
    for (int64_t e = 0; e < num_experts; ++e)
        rank_of[e] = (int32_t)(e / local);
    memset(per_rank, 0, (size_t)num_ranks * sizeof(int32_t));
    memset(per_expert, 0, (size_t)num_experts * sizeof(int32_t));
    memset(in_rank, 0, (size_t)(n * num_ranks));
    if (last_slot)
        for (int64_t i = 0; i < n * num_ranks; ++i)
            last_slot[i] = -1;
    for (int64_t t = 0; t < n; ++t) {
        uint8_t *row = in_rank + t * num_ranks;
        int64_t *last = last_slot ? last_slot + t * num_ranks : NULL;
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = topk[t * k + j];
            if (e < 0)
                continue;
            per_expert[e] += 1;
            row[rank_of[e]] = 1;
            if (last)
                last[rank_of[e]] = j;  /* slots ascend: the last store is the largest */
        }
        for (int64_t r = 0; r < num_ranks; ++r)
            per_rank[r] += row[r];
    }
    if (rank_of != small)
        free(rank_of);
    return 0;
}

/* in_rank [n, r] bool (uint8 0/1); channel c owns tokens [c*q, min((c+1)*q, n)), q = max(1, ceil(n / C)).
 * Writes channel_prefix [r, C] int32 (this rank's tokens for rank j in channels 0..c, inclusive) and
 * send_head [n, r] int32 (token t's position among its channel's tokens for rank j, -1 if not sent).
 * scratch: 2 r int32. */
void deepep_send_layout(const uint8_t *in_rank, int64_t n, int64_t r, int64_t num_channels, int32_t *channel_prefix,
                        int32_t *send_head, int32_t *scratch) {
    int64_t q = (n + num_channels - 1) / num_channels;
    if (q < 1)
        q = 1;
    int32_t *total = scratch, *at_start = scratch + r;  /* tokens for rank j so far; at the channel's start */
    memset(scratch, 0, (size_t)(2 * r) * sizeof(int32_t));
    int64_t c = 0, end = q < n ? q : n;
    for (int64_t t = 0; t < n; ++t) {
        while (t >= end) {  /* channel c ends before token t */
            for (int64_t j = 0; j < r; ++j)
                channel_prefix[j * num_channels + c] = at_start[j] = total[j];
            ++c;
            end = (c + 1) * q < n ? (c + 1) * q : n;
        }
        const uint8_t *row = in_rank + t * r;
        int32_t *head = send_head + t * r;
        for (int64_t j = 0; j < r; ++j) {
            if (row[j]) {
                head[j] = total[j] - at_start[j];
                total[j] += 1;
            } else {
                head[j] = -1;
            }
        }
    }
    for (; c < num_channels; ++c)  /* the last channel with tokens, and the empty ones after it */
        for (int64_t j = 0; j < r; ++j)
            channel_prefix[j * num_channels + c] = total[j];
}

/* src [rows] int32: each received row's token index at its source, the rows of source s being
 * [starts[s], starts[s + 1]); num_tokens [r] int64: each source's token count (which fixes its channel
 * size q = max(1, ceil(N / C))). Writes out [r, C] int32: the first row of channel c within source s's block
 * (exclusive prefix of the rows per channel; a token past the last channel counts in none).
 * Returns 0, or 1 (nothing written) when a token index is negative or the starts are not ascending. */
int64_t deepep_recv_channel_prefix(const int32_t *src, const int64_t *starts, const int64_t *num_tokens, int64_t r,
                                   int64_t num_channels, int32_t *out) {
    for (int64_t s = 0; s < r; ++s) {
        if (starts[s + 1] < starts[s])
            return 1;
        for (int64_t i = starts[s]; i < starts[s + 1]; ++i)
            if (src[i] < 0)
                return 1;
    }
    for (int64_t s = 0; s < r; ++s) {
        int64_t q = (num_tokens[s] + num_channels - 1) / num_channels;
        if (q < 1)
            q = 1;
        int32_t *row = out + s * num_channels;
        memset(row, 0, (size_t)num_channels * sizeof(int32_t));
        /* a block's tokens ascend (the engines' order): its channel advances by comparisons, a division only
         * where a token is below the one before it */
        int64_t ch = 0, lo = 0, hi = q;  /* channel ch owns tokens [lo, hi) */
        for (int64_t i = starts[s]; i < starts[s + 1]; ++i) {
            const int64_t t = src[i];
            if (t < lo) {
                ch = t / q, lo = ch * q, hi = lo + q;
            }
            while (t >= hi && ch < num_channels)
                ++ch, lo = hi, hi += q;
            if (ch < num_channels)
                row[ch] += 1;
        }
        int32_t run = 0;
        for (int64_t ch = 0; ch < num_channels; ++ch) {
            const int32_t v = row[ch];
            row[ch] = run;
            run += v;
        }
    }
    return 0;
}

/* In place over count (token, slot) entries: global expert ids -> this rank's local ids (first .. first +
 * local - 1 -> 0 .. local - 1), -1 and weight +0.0 for every other id (-1 included). The two arrays do not
 * overlap (restrict), so the loop vectorises (8 ids per instruction in the AVX-512 clone). */
MULTIVERSION
void deepep_local_experts(int64_t *restrict idx, float *restrict weights, int64_t count, int64_t first,
                          int64_t local) {
    for (int64_t i = 0; i < count; ++i) {  /* without branches: foreign ids are as likely as local ones */
        const int64_t e = idx[i] - first;
        const int keep = (uint64_t)e < (uint64_t)local;
        idx[i] = keep ? e : -1;
        weights[i] = keep ? weights[i] : 0.0f;
    }
}
