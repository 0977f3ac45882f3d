/* The low-latency calls' fixed work, one C call per step: what deepep_ascend.ep.low_latency's torch path
 * spreads over some sixty small torch ops per call (each costs microseconds whatever its size; at the
 * few tokens of a decode step they, not the bytes, are the call's time).
 *
 *   deepep_ll_route          one pass over topk_idx: its value range, the most selections of one expert,
 *                            per-expert counts and each (token, slot)'s row among its expert's rows
 *   deepep_ll_dispatch_send  each routed token's index into its slot of every mapped destination's index
 *                            table, and the per-expert counts into the destinations' count words
 *   deepep_ll_dispatch_recv  counts -> recv_count, layout_range; every routed row loaded from its source's
 *                            send region -> recv_x, scales, src_info; then the sources' stamps (seqlock)
 *   deepep_ll_stream_rows    whether deepep_ll_dispatch_recv (one side) and deepep_ll_combine_send (the other)
 *                            store their rows by streaming stores (stream.h)
 *   deepep_ll_streams        whether one side's call of so many bytes of rows does, under its mode in force
 *   deepep_ll_combine_send   every returned row of every mapped destination straight into its slot, and
 *                            the counts
 *   deepep_ll_combine_recv   the counts against the route's, then the weighted sum of the returned rows
 *   deepep_ll_headers_agree  every live source's call header against this rank's
 *   deepep_ll_publish        a call's header into every destination's header slot, one fence, then every
 *                            destination's signal word (the signals of transports' signal(), by stores)
 *   deepep_ll_await          every live source's signal polled for a bounded number of rounds, then the
 *                            headers (deepep_ll_headers_agree): the receive's wait when the peers are on time
 *
 * Window memory is addressed by plain byte addresses (the caller's mapped segments, one per rank, 0 where
 * a rank is not mapped); the caller derives every offset from the layout it checked against the window's
 * size. Row numbers the caller cannot vouch for (counts read from a peer, layout_range values) are checked
 * here before anything is written: the kernel then returns nonzero and writes nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "stream.h"

/* topk_idx [n, k] (row-major, int64) in one pass: stats = {min, max} of all values (0, 0 when n*k == 0);
 * returns 1 (nothing else written) when a value lies outside [-1, num_experts). Else stats[2] / stats[3]
 * = the most selections of one expert and the first expert selected that often (counting every slot);
 * counts[e] = selections of expert e; slots[t*k + j] = e*m + (the pair's row among expert e's pairs, in
 * (token, slot) order), or -1 for idx -1. Returns 2 when an expert is selected more than m times
 * (stats and counts written, slots not). */
int64_t deepep_ll_route(int64_t n, int64_t k, const int64_t *idx, int64_t num_experts, int64_t m,
                        int32_t *counts, int64_t *slots, int64_t *stats)
{
    const int64_t total = n * k;
    int64_t lo = total ? idx[0] : 0, hi = lo;
    for (int64_t i = 0; i < total; i++) {
        lo = idx[i] < lo ? idx[i] : lo;
        hi = idx[i] > hi ? idx[i] : hi;
    }
    stats[0] = lo;
    stats[1] = hi;
    stats[2] = stats[3] = 0;
    if (lo < -1 || hi >= num_experts)
        return 1;
    memset(counts, 0, (size_t)num_experts * sizeof *counts);
    for (int64_t i = 0; i < total; i++)
        if (idx[i] >= 0)
            counts[idx[i]]++;
    int64_t most = 0, arg = 0;
    for (int64_t e = 0; e < num_experts; e++)
        if (counts[e] > most) {
            most = counts[e];
            arg = e;
        }
    stats[2] = most;
    stats[3] = arg;
    if (most > m)
        return 2;
    memset(counts, 0, (size_t)num_experts * sizeof *counts);
    for (int64_t i = 0; i < total; i++)
        slots[i] = idx[i] < 0 ? -1 : idx[i] * m + counts[idx[i]]++;
    return 0;
}

/* Whether rank p is reached here: mapped (bases[p] != 0) and not masked. */
static inline int reached(const int64_t *bases, const int32_t *mask, int64_t p)
{
    return bases[p] != 0 && !(mask && mask[p]);
}

/* A dispatch's route to every reached destination: its receivers load the rows themselves from this rank's
 * send region (deepep_ll_dispatch_recv), so only where to find them moves here. Pair (t, j) with slots[t*k + j]
 * = e*m + r >= 0 (see deepep_ll_route) goes to rank d = e / L, local expert le = e % L: the int32 t at
 * bases[d] + index_off + ((le*R + me)*m + r) * 4. Then counts[d*L .. d*L + L) (int32) at bases[d] +
 * counts_off. sent[d] = pairs routed to d. Returns 1 (nothing written) when a slot lies outside [-1, L*R*m). */
int64_t deepep_ll_dispatch_send(int64_t n, int64_t k, const int64_t *slots, int64_t m, int64_t num_local,
                                int64_t num_ranks, int64_t me, const int64_t *bases, const int32_t *mask,
                                int64_t index_off, int64_t counts_off, const int32_t *counts, int64_t *sent)
{
    const int64_t total = n * k;
    for (int64_t i = 0; i < total; i++)
        if (slots[i] < -1 || slots[i] >= num_local * num_ranks * m)
            return 1;
    for (int64_t d = 0; d < num_ranks; d++)
        sent[d] = 0;
    for (int64_t i = 0; i < total; i++) {
        const int64_t s = slots[i];
        if (s < 0)
            continue;
        const int64_t e = s / m, r = s % m, d = e / num_local, le = e % num_local;
        if (!reached(bases, mask, d))
            continue;
        const int32_t token = (int32_t)(i / k);
        memcpy((uint8_t *)(intptr_t)bases[d] + index_off + ((le * num_ranks + me) * m + r) * 4, &token, 4);
        sent[d]++;
    }
    for (int64_t d = 0; d < num_ranks; d++)
        if (reached(bases, mask, d))
            memcpy((uint8_t *)(intptr_t)bases[d] + counts_off, counts + d * num_local,
                   (size_t)num_local * sizeof *counts);
    return 0;
}

/* When the low-latency calls store their rows with streaming stores (stream.h), per side: STREAM_SIDE_RECEIVE,
 * deepep_ll_dispatch_recv's rows into recv_x; STREAM_SIDE_SEND, a combine's returned rows (deepep_ll_combine_send's
 * into the destinations' windows, and those intranode.c's deepep_in_stage stages for a normal-mode combine). Each
 * side has its mode, STREAM_NEVER, STREAM_LARGE (the default: when the call's rows
 * take at least the side's threshold, past a size the cache cannot keep them for their reader anyway and
 * streaming then wins both ways; docs/design/data-path.md, "Streaming stores") or STREAM_ALWAYS, and its
 * threshold. The library sets them from its settings when it loads. */
enum { STREAM_NEVER, STREAM_LARGE, STREAM_ALWAYS };
enum { STREAM_SIDE_RECEIVE, STREAM_SIDE_SEND, STREAM_SIDES };
static int64_t stream_rows[STREAM_SIDES] = {STREAM_LARGE, STREAM_LARGE};
static int64_t stream_min_bytes[STREAM_SIDES] = {(int64_t)16 << 20, (int64_t)2 << 20};

/* Set side's mode (0, 1, 2 as above; another value leaves it) and, when min_bytes >= 0, its STREAM_LARGE
 * threshold; returns the side's mode in force (-1 for a side out of range, nothing set), and its threshold in
 * *min_bytes_out (when not NULL). */
int64_t deepep_ll_stream_rows(int64_t side, int64_t mode, int64_t min_bytes, int64_t *min_bytes_out)
{
    if (side < 0 || side >= STREAM_SIDES)
        return -1;
    if (mode >= STREAM_NEVER && mode <= STREAM_ALWAYS)
        stream_rows[side] = mode;
    if (min_bytes >= 0)
        stream_min_bytes[side] = min_bytes;
    if (min_bytes_out)
        *min_bytes_out = stream_min_bytes[side];
    return stream_rows[side];
}

/* Whether side's stores of a call's rows_bytes bytes of rows are streaming stores, under its mode in force (0 for
 * a side out of range). */
int64_t deepep_ll_streams(int64_t side, int64_t rows_bytes)
{
    if (side < 0 || side >= STREAM_SIDES)
        return 0;
    return stream_rows[side] == STREAM_ALWAYS ||
           (stream_rows[side] == STREAM_LARGE && rows_bytes >= stream_min_bytes[side]);
}

/* A dispatch's receive, loading every row from its source's window. sig: int32 [R][L], source s's count of
 * local expert e at sig[s*L + e] (masked sources count 0); index: int32 [L][R][m], the token of message i of
 * (e, s) at index[(e*R + s)*m + i] (written by deepep_ll_dispatch_send). Source s's message of token t lies
 * at bases[s] + send_off + t * mb: [16 header bytes | xb payload bytes | sw int32 scale words].
 * Returns 1 (nothing written) when a count lies outside [0, m]; 4 (nothing written; bad = {s, e, i}) when a
 * live source with a count is not mapped (bases[s] == 0, i = -1) or a token index lies outside [0, m).
 * Else recv_count[e] = sum over s, layout_range[e*R + s] = begin << 32 | count with begin the exclusive
 * prefix over s; message i of (e, s) lands in row q = begin + i of expert e: its payload at recv_x + (e*R*m +
 * q) * xb, its token at src_info[e*R*m + q], its scale words at scales[(e*sw + w)*R*m + q] (channels-first;
 * NULL: no scales). stale[0..2] (each NULL or int32 [L]): rows [0, stale[i][e]) of expert e of recv_x,
 * scales, src_info hold an earlier call's data; the rows of them this call does not write are zeroed.
 * Returns 2 (nothing written) when a stale count lies outside [0, R*m].
 * Seqlock: a source stamps its int64 word stamps[s] (an address; 0: not checked) with the number of the call
 * before it rewrites its send region. After every load, each checked source's stamp must still read want:
 * else the rows may be torn, bad = {s, stamp read}, and this returns 3 (outputs written). */
int64_t deepep_ll_dispatch_recv(int64_t num_local, int64_t num_ranks, int64_t m, const int32_t *sig,
                                const int32_t *mask, const int32_t *index, const int64_t *bases, int64_t send_off,
                                const int64_t *stamps, int64_t want, int64_t mb, int64_t xb, int64_t sw,
                                uint8_t *recv_x, int32_t *scales, int32_t *src_info, int32_t *recv_count,
                                int64_t *layout_range, const int32_t *const *stale, int64_t *bad)
{
    const int64_t L = num_local, R = num_ranks, rm = R * m;
    for (int64_t s = 0; s < R; s++) {
        if (mask && mask[s])
            continue;
        for (int64_t e = 0; e < L; e++)
            if (sig[s * L + e] < 0 || sig[s * L + e] > m)
                return 1;
    }
    for (int64_t i = 0; i < 3; i++)
        for (int64_t e = 0; stale[i] && e < L; e++)
            if (stale[i][e] < 0 || stale[i][e] > rm)
                return 2;
    for (int64_t s = 0; s < R; s++) {
        if (mask && mask[s])
            continue;
        for (int64_t e = 0; e < L; e++) {
            const int64_t c = sig[s * L + e];
            if (c && !bases[s]) {
                bad[0] = s, bad[1] = e, bad[2] = -1;
                return 4;
            }
            for (int64_t i = 0; i < c; i++) {
                const int32_t t = index[(e * R + s) * m + i];
                if (t < 0 || t >= m) {
                    bad[0] = s, bad[1] = e, bad[2] = i;
                    return 4;
                }
            }
        }
    }
    int64_t rows = 0;
    for (int64_t s = 0; s < R; s++)
        for (int64_t e = 0; !(mask && mask[s]) && e < L; e++)
            rows += sig[s * L + e];
    const int stream = (int)deepep_ll_streams(STREAM_SIDE_RECEIVE, rows * xb);
    for (int64_t e = 0; e < L; e++) {
        int64_t begin = 0;
        for (int64_t s = 0; s < R; s++) {
            const int64_t c = (mask && mask[s]) ? 0 : sig[s * L + e];
            layout_range[e * R + s] = (begin << 32) | c;
            const int32_t *tok = index + (e * R + s) * m;
            const uint8_t *src = c ? (const uint8_t *)(intptr_t)bases[s] + send_off : NULL;
            for (int64_t i = 0; i < c; i++) {
                const int64_t q = e * rm + begin + i;
                const uint8_t *msg = src + tok[i] * mb;
                copy_maybe_streaming(recv_x + q * xb, msg + 16, (size_t)xb, stream);
                src_info[q] = tok[i];
            }
            /* the scales word-major: each of the run's sw destination lines written in one go */
            for (int64_t w = 0; scales && w < sw; w++) {
                int32_t *dst = scales + (e * sw + w) * rm + begin;
                for (int64_t i = 0; i < c; i++)
                    memcpy(dst + i, src + tok[i] * mb + 16 + xb + 4 * w, 4);
            }
            begin += c;
        }
        recv_count[e] = (int32_t)begin;
        /* an earlier call's rows past this call's last one */
        if (stale[0] && stale[0][e] > begin)
            memset(recv_x + (e * rm + begin) * xb, 0, (size_t)((stale[0][e] - begin) * xb));
        for (int64_t w = 0; scales && stale[1] && stale[1][e] > begin && w < sw; w++)
            memset(scales + (e * sw + w) * rm + begin, 0, (size_t)(stale[1][e] - begin) * 4);
        if (stale[2] && stale[2][e] > begin)
            memset(src_info + e * rm + begin, 0, (size_t)(stale[2][e] - begin) * 4);
    }
    if (stream)
        stream_fence();
    /* every load above before the stamps' (a source stamps before it rewrites: an unchanged stamp read after
     * the loads proves none of them saw a later call's bytes) */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (int64_t s = 0; s < R; s++) {
        if ((mask && mask[s]) || !stamps[s])
            continue;
        const int64_t got = __atomic_load_n((const int64_t *)(intptr_t)stamps[s], __ATOMIC_RELAXED);
        if (got != want) {
            bad[0] = s, bad[1] = got;
            return 3;
        }
    }
    return 0;
}

/* A combine's sends to every reached destination d: for each local expert e, with count c and begin b of
 * layout_range[e*R + d], rows b .. b + c - 1 of src[e] (row r of expert e at src + e * stride_e + r *
 * stride_r, row_bytes each) into rows 0 .. c - 1 of slot me*L + e at bases[d] + recv_off (slot g row i at
 * (g*m + i) * row_bytes); then the L counts (int32) at bases[d] + counts_off. sent[d] = rows written to d.
 * keep: 0 copies every row; 1 leaves this rank's own rows in src (its receive reads them there, through
 * deepep_ll_combine_recv's sources) and writes only their counts, sent[me] = 0; 2 leaves every row in src
 * (a zero-copy combine whose receivers read them from this rank's send region) and writes only the counts,
 * sent[d] = the rows d reads from here (sent[me] = 0). The rows go by streaming stores when the send side's mode
 * says so for the bytes this call copies (deepep_ll_streams), fenced before the return. Returns 1 (nothing
 * written) when a reached destination's count exceeds m or its run leaves [0, R*m). */
int64_t deepep_ll_combine_send(int64_t num_local, int64_t num_ranks, int64_t m, int64_t row_bytes, int64_t me,
                               const int64_t *layout_range, const uint8_t *src, int64_t stride_e, int64_t stride_r,
                               const int64_t *bases, const int32_t *mask, int64_t recv_off, int64_t counts_off,
                               int64_t keep, int64_t *sent)
{
    const int64_t L = num_local, R = num_ranks;
    int64_t copied = 0; /* rows this call copies */
    for (int64_t d = 0; d < R; d++) {
        if (!reached(bases, mask, d))
            continue;
        for (int64_t e = 0; e < L; e++) {
            const int64_t c = layout_range[e * R + d] & 0xFFFFFFFF, b = layout_range[e * R + d] >> 32;
            if (c > m || b < 0 || b + c > R * m)
                return 1;
            copied += (d == me && keep) || keep == 2 ? 0 : c;
        }
    }
    const int stream = (int)deepep_ll_streams(STREAM_SIDE_SEND, copied * row_bytes);
    for (int64_t d = 0; d < R; d++) {
        sent[d] = 0;
        if (!reached(bases, mask, d))
            continue;
        uint8_t *base = (uint8_t *)(intptr_t)bases[d];
        for (int64_t e = 0; e < L; e++) {
            const int64_t c = layout_range[e * R + d] & 0xFFFFFFFF, b = layout_range[e * R + d] >> 32;
            uint8_t *slot = base + recv_off + (me * L + e) * m * row_bytes;
            const int32_t c32 = (int32_t)c;
            memcpy(base + counts_off + e * 4, &c32, 4);
            if (d == me && keep)
                continue;
            if (keep == 2) {
                sent[d] += c;
                continue;
            }
            for (int64_t i = 0; i < c; i++)
                copy_maybe_streaming(slot + i * row_bytes, src + e * stride_e + (b + i) * stride_r, (size_t)row_bytes,
                                     stream);
            sent[d] += c;
        }
    }
    if (stream) /* the rows before the caller's signal (its publish) */
        stream_fence();
    return 0;
}

/* A combine's receive. First the counts: got[g] = sig[g] (int32 [R*L], source g / L's rows of expert g)
 * against expected[g] for every g whose rank g / L is not masked; the first g that differs -> bad = {g,
 * got, expected}, return 2, nothing written. Then, for every token t,
 *
 *   out[t] = bf16( ((+0.0 + f32(rows[idx[t,0]]) * w[t,0]) + f32(rows[idx[t,1]]) * w[t,1]) + ... )
 *
 * over the slots j whose idx[t,j] >= 0 and whose expert idx[t,j] / m lives on an unmasked rank, in slot
 * order, each product rounded to float32 before its add, one rounding to BF16 at the end (the torch path's
 * y = f32(row) * w; acc += y; acc.to(bf16)). rows: row r at rows + r * row_ld (elements), num_rows of
 * them; idx values outside [-1, num_rows) -> return 1, nothing written. src_addr (NULL: none) names the
 * ranks whose rows lie elsewhere (struct row_redirect): rank d with src_addr[d] != 0 has row i of local
 * expert e, i < sig[d*L + e], at src_addr[d] + e * src_ld[2d] + (src_begin[d*L + e] + i) * src_ld[2d + 1]
 * (elements): this rank's own rows where its combine send left them (keep 1), a zero-copy source's in its
 * send region (keep 2). A src_begin outside [0, rows_per_expert - sig[d*L + e]] for an unmasked such rank,
 * or a slot of such a rank at or past its count -> return 1, nothing written (a masked rank's words are not
 * read: the sum skips its slots). */
MULTIVERSION
int64_t deepep_ll_combine_recv(int64_t n, int64_t k, int64_t hidden, int64_t m, int64_t num_local, int64_t num_ranks,
                               const int32_t *sig, const int32_t *mask, const int32_t *expected, const uint16_t *rows,
                               int64_t row_ld, int64_t num_rows, const int64_t *idx, const float *w, uint16_t *out,
                               int64_t out_ld, uint16_t nan_bits, const int64_t *src_addr, const int64_t *src_ld,
                               const int64_t *src_begin, int64_t rows_per_expert, int64_t *bad)
{
    const int64_t E = num_local * num_ranks;
    for (int64_t g = 0; g < E; g++) {
        if (mask && mask[g / num_local])
            continue;
        if (sig[g] != expected[g]) {
            bad[0] = g;
            bad[1] = sig[g];
            bad[2] = expected[g];
            return 2;
        }
    }
    for (int64_t i = 0; i < n * k; i++)
        if (idx[i] < -1 || idx[i] >= num_rows)
            return 1;
    struct row_redirect alt = {m, num_local, src_addr, src_ld, src_begin};
    if (src_addr) {
        for (int64_t g = 0; g < E; g++) {
            if (!src_addr[g / num_local] || (mask && mask[g / num_local]))
                continue;
            if (src_begin[g] < 0 || src_begin[g] > rows_per_expert - sig[g])
                return 1;
        }
        for (int64_t i = 0; i < n * k; i++) {
            const int64_t d = idx[i] / (m * num_local);
            if (idx[i] >= 0 && src_addr[d] && !(mask && mask[d]) && idx[i] % m >= sig[idx[i] / m])
                return 1;
        }
    }
    weighted_sum_rows_into(n, hidden, k, rows, row_ld, idx, w, out, out_ld, nan_bits, mask, m * num_local,
                           src_addr ? &alt : NULL);
    return 0;
}

/* The call headers (int64 words, one header every hdr_words words; word 0 = seq << 16 | flags << 8 | op << 4
 * | status, word 1 = M, E, H, word 2's high half = the dispatch a combine's handle came from, 0 if not known)
 * of every source s with mask[s] == 0 (mask NULL: all): 1 when each reads call seq of op with status 0 and
 * the flags (but the bits of ignore_flags, a per-source choice) and word 1 of this rank's own header (source
 * me), and the nonzero dispatch numbers are all one, plus 2 when one of them sets a bit of ignore_flags;
 * else 0. */
int64_t deepep_ll_headers_agree(int64_t num_ranks, int64_t me, const int64_t *hdr, int64_t hdr_words,
                                const int32_t *mask, int64_t seq, int64_t op, int64_t ignore_flags)
{
    const int64_t flags = 0xFF00 & ~(ignore_flags << 8);
    const int64_t mine0 = hdr[me * hdr_words] & flags, mine1 = hdr[me * hdr_words + 1];
    int64_t ignored = 0, dispatch = 0;
    for (int64_t s = 0; s < num_ranks; s++) {
        if (mask && mask[s])
            continue;
        const int64_t w0 = hdr[s * hdr_words], w1 = hdr[s * hdr_words + 1];
        if ((w0 >> 16) != seq || ((w0 >> 4) & 0xF) != op || (w0 & 0xF) != 0 || (w0 & flags) != mine0 || w1 != mine1)
            return 0;
        const int64_t d = hdr_words > 2 ? hdr[s * hdr_words + 2] >> 32 : 0;
        if (d && dispatch && d != dispatch)
            return 0;
        dispatch = d ? d : dispatch;
        ignored |= (w0 >> 8) & ignore_flags;
    }
    return ignored ? 3 : 1;
}

/* Publish a call to the n destinations order[0..n): this rank's header (hdr_words, `words` int64) stored at
 * hdr_addrs[d] of each, then one full fence (every store before, rows, counts and headers, is visible before
 * any signal: the release of transports' signal()), then `value` stored at sig_addrs[d], the destination's
 * signal word this rank alone writes (one 8-byte store: a poller reads the old value or the new one).
 * Returns 1 (nothing written) when a destination lies outside [0, num_ranks) or has a zero address. */
int64_t deepep_ll_publish(int64_t n, const int64_t *order, int64_t num_ranks, const int64_t *hdr_words,
                          int64_t words, const int64_t *hdr_addrs, const int64_t *sig_addrs, int64_t value)
{
    for (int64_t i = 0; i < n; i++)
        if (order[i] < 0 || order[i] >= num_ranks || !hdr_addrs[order[i]] || !sig_addrs[order[i]])
            return 1;
    for (int64_t i = 0; i < n; i++)
        memcpy((void *)(intptr_t)hdr_addrs[order[i]], hdr_words, (size_t)words * sizeof *hdr_words);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < n; i++)
        __atomic_store_n((int64_t *)(intptr_t)sig_addrs[order[i]], value, __ATOMIC_RELAXED);
    return 0;
}

/* The receive's wait while the peers are on time: polls this rank's signal words sig[0..num_ranks) (source s
 * writes sig[s]) up to `polls` rounds until every source with mask[s] == 0 (mask NULL: all) reads at least
 * need; returns -1 if one still does not (nothing else read: the caller waits the long way, with its deadline
 * and abort checks). Else, after an acquire fence (the headers and data the signals released), returns
 * deepep_ll_headers_agree(num_ranks, me, hdr, hdr_words, mask, seq, op, ignore_flags). */
int64_t deepep_ll_await(int64_t num_ranks, int64_t me, const int64_t *sig, const int32_t *mask, int64_t need,
                        int64_t polls, const int64_t *hdr, int64_t hdr_words, int64_t seq, int64_t op,
                        int64_t ignore_flags)
{
    int64_t s = 0;
    for (int64_t round = 0; s < num_ranks; round++) {
        if ((mask && mask[s]) || __atomic_load_n(sig + s, __ATOMIC_RELAXED) >= need) {
            s++;
            continue;
        }
        if (round >= polls)
            return -1;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return deepep_ll_headers_agree(num_ranks, me, hdr, hdr_words, mask, seq, op, ignore_flags);
}
