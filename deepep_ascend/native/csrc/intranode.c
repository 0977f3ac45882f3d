/* The normal-mode engine's fixed work on one node, by loads and stores (deepep_ascend/ep/intranode.py,
 * docs/design/data-path.md): the signals of transports' signal() and wait_until(), a call's chunk-0
 * exchange and a dispatch or combine chunk's receive, each in one C call where the Python steps made several per peer.
 *
 *   deepep_in_signal    one full fence, then each destination's running signal value, plus one, stored
 *                        into the word this rank alone writes there
 *   deepep_in_poll      this rank's signal words polled for a bounded number of rounds until every source
 *                        reaches its value; an acquire fence after
 *   deepep_in_exchange  chunk 0 of a call: the count vector and the header stored into this rank's
 *                        current half, READY to every peer (deepep_in_signal), every source's READY
 *                        polled (deepep_in_poll), then every rank's header words gathered and compared
 *   deepep_in_gather    every source's rows for this rank out of its staged dispatch chunk, into the outputs
 *   deepep_in_vectors   every rank's count vector, gathered
 *   deepep_in_stage     rows of a call's fields copied into this rank's current half
 *   deepep_in_store     dispatch's direct stores: each receiver's rows of x into its recv_x
 *   deepep_in_combine   a combine round's receive: every source's rows for this origin's tokens found,
 *                        checked against the counts the sources sent, summed (deepep_sum_rows_bf16) with
 *                        the bias, and the top-k weights summed
 *   deepep_in_dispatch_tail  a one-round dispatch on the direct path after its counts: the stores, XDATA,
 *                        the gather, CONSUMED, the receive's channel prefix and the XDATA poll in one call
 *   deepep_in_combine_tail   a one-round combine after its headers: the receive (deepep_in_combine), CONSUMED
 *                        and, when the peers read x in place, their CONSUMED polled, in one call
 *
 * A poll that runs out returns -1 having read nothing after the signals: the caller then waits the long
 * way (transports' wait_until, with its deadline and abort checks). Addresses are the caller's mapped
 * window memory; the Python side (deepep_ascend.native.intranode) checks them once, when it builds a plan.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "stream.h"

void deepep_local_experts(int64_t *idx, float *weights, int64_t count, int64_t first, int64_t local);
int64_t deepep_recv_channel_prefix(const int32_t *src, const int64_t *starts, const int64_t *num_tokens, int64_t r,
                                   int64_t num_channels, int32_t *out);

/* The plan: int64 words, written once by deepep_ascend.native.intranode.IntranodePlan. */
enum {
    CTL_RANKS,      /* R */
    CTL_ME,         /* this rank */
    CTL_HALF,       /* bytes of one half of a rank's window data region */
    CTL_HDR_WORDS,  /* int64 words of a header (the first ones of a half) */
    CTL_VEC_OFF,    /* byte offset of the count vector in a half */
    CTL_BASES,      /* address of [R] int64: each rank's window data region */
    CTL_STAGED,     /* address of [R] int64: chunks staged so far by each rank (the half in use: staged & 1) */
    CTL_PEERS,      /* address of [R - 1] int64: the other ranks, ascending */
    CTL_READY_SENT, /* address of [R] int64: the READY value last stored at each rank */
    CTL_READY_ADDR, /* address of [R] int64: this rank's READY word at each rank (0 for itself) */
    CTL_READY_OWN,  /* address of this rank's own READY words, [R] int64 */
    CTL_WORDS
};

#define PTR(plan, field, type) ((type)(intptr_t)(plan)[field])

/* Nanoseconds of CLOCK_MONOTONIC: the steps of a fused call that a caller times (its phase breakdown). */
static inline int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void pause_once(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* One full fence (every store before it, rows and headers, is visible before any signal: the release of
 * transports' signal()), then for each of the n destinations d = dsts[i]: sent[d] += 1 stored at addrs[d],
 * and, with counters, the int64 at address counters[d] += 1 (the transport's signal count of d). Returns 1,
 * writing nothing, when a destination lies outside [0, num_ranks) or has a zero address. */
int64_t deepep_in_signal(int64_t n, const int64_t *dsts, int64_t num_ranks, int64_t *sent, const int64_t *addrs,
                          const int64_t *counters)
{
    for (int64_t i = 0; i < n; i++)
        if (dsts[i] < 0 || dsts[i] >= num_ranks || !addrs[dsts[i]])
            return 1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < n; i++) {
        const int64_t d = dsts[i];
        __atomic_store_n((int64_t *)(intptr_t)addrs[d], ++sent[d], __ATOMIC_RELAXED);
        if (counters)
            ++*(int64_t *)(intptr_t)counters[d];
    }
    return 0;
}

/* Polls words[s] (written by source s alone) for each s = srcs[i] up to `polls` rounds until it reads at
 * least (need ? need[s] : 0) + add. Returns 0 after an acquire fence (the data those signals released may be
 * loaded), or -1 when a source is still short. */
int64_t deepep_in_poll(const int64_t *words, int64_t n, const int64_t *srcs, const int64_t *need, int64_t add,
                        int64_t polls)
{
    int64_t i = 0;
    for (int64_t round = 0; i < n; round++) {
        const int64_t s = srcs[i];
        if (__atomic_load_n(words + s, __ATOMIC_RELAXED) >= (need ? need[s] : 0) + add) {
            i++;
            continue;
        }
        if (round >= polls)
            return -1;
        pause_once();
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return 0;
}

/* Chunk 0 of a call, once this rank's rows are staged in its current half: vec_bytes of vec at CTL_VEC_OFF
 * of the half, then the header, `nwords` words of hdr followed by zeros up to CTL_HDR_WORDS; READY to every
 * peer (deepep_in_signal, counting with counters when given); each peer's READY polled until it reads
 * staged[p] + 1 (deepep_in_poll). Returns -1 when one is still short after `polls` rounds (nothing read).
 * Else copies the first `out_words` words of every rank's header (in its current half) into out[R, out_words]
 * and returns 0 when every rank's words at the ncols columns cols[] equal this rank's, 1 when not. */
int64_t deepep_in_exchange(const int64_t *plan, const int64_t *hdr, int64_t nwords, const void *vec,
                            int64_t vec_bytes, const int64_t *counters, int64_t polls, int64_t *out,
                            int64_t out_words, const int64_t *cols, int64_t ncols)
{
    const int64_t R = plan[CTL_RANKS], me = plan[CTL_ME], half = plan[CTL_HALF], hw = plan[CTL_HDR_WORDS];
    const int64_t *bases = PTR(plan, CTL_BASES, const int64_t *), *staged = PTR(plan, CTL_STAGED, const int64_t *);
    const int64_t *peers = PTR(plan, CTL_PEERS, const int64_t *);
    uint8_t *own = (uint8_t *)(intptr_t)bases[me] + (staged[me] & 1) * half;
    if (vec_bytes > 0)
        memcpy(own + plan[CTL_VEC_OFF], vec, (size_t)vec_bytes);
    memcpy(own, hdr, (size_t)nwords * sizeof *hdr);
    memset(own + nwords * sizeof *hdr, 0, (size_t)(hw - nwords) * sizeof *hdr);
    deepep_in_signal(R - 1, peers, R, PTR(plan, CTL_READY_SENT, int64_t *), PTR(plan, CTL_READY_ADDR, const int64_t *),
                      counters);
    if (deepep_in_poll(PTR(plan, CTL_READY_OWN, const int64_t *), R - 1, peers, staged, 1, polls))
        return -1;
    for (int64_t p = 0; p < R; p++)
        memcpy(out + p * out_words, (const uint8_t *)(intptr_t)bases[p] + (staged[p] & 1) * half,
               (size_t)out_words * sizeof *out);
    const int64_t *mine = out + me * out_words;
    for (int64_t p = 0; p < R; p++)
        for (int64_t c = 0; c < ncols; c++)
            if (out[p * out_words + cols[c]] != mine[cols[c]])
                return 1;
    return 0;
}

/* A dispatch chunk's receive, every source at once: for each s with rows[s] > 0, the tokens t < rows[s] of its
 * chunk (in its current half) whose routing-mask byte (row t, column me of R, at offs[4]) is nonzero, in
 * ascending t, land at rows at[s], at[s] + 1, ... of the outputs: xb bytes of the token's row at offs[0] into
 * x_out (row stride xb; xb == 0: x not gathered), sb bytes at offs[1] into s_out, k int64 top-k ids at offs[2]
 * into idx_out, k float32 weights at offs[3] into w_out (k == 0: neither), and first + t into src_out (first: the round's first token, alike for every source).
 * With num_local > 0 the ids become this rank's local ones on the way: id - first_expert where that lies in
 * [0, num_local), else -1 with weight 0 (deepep_local_experts). got[s] = the rows of s; at[s] += got[s].
 * Returns 1, writing nothing, when a source's rows would pass out_rows or start before 0. */
int64_t deepep_in_gather(const int64_t *plan, const int64_t *offs, const int64_t *rows, int64_t first,
                         int64_t xb, int64_t sb, int64_t k, uint8_t *x_out, uint8_t *s_out, int64_t *idx_out,
                         float *w_out, int32_t *src_out, int64_t *at, int64_t out_rows, int64_t *got,
                         int64_t first_expert, int64_t num_local)
{
    const int64_t R = plan[CTL_RANKS], me = plan[CTL_ME], half = plan[CTL_HALF];
    const int64_t *bases = PTR(plan, CTL_BASES, const int64_t *), *staged = PTR(plan, CTL_STAGED, const int64_t *);
    for (int64_t s = 0; s < R; s++) {
        got[s] = 0;
        if (rows[s] <= 0)
            continue;
        const uint8_t *mask = (const uint8_t *)(intptr_t)bases[s] + (staged[s] & 1) * half + offs[4];
        for (int64_t t = 0; t < rows[s]; t++)
            got[s] += mask[t * R + me] != 0;
        if (at[s] < 0 || at[s] + got[s] > out_rows)
            return 1;
    }
    for (int64_t s = 0; s < R; s++) {
        if (!got[s])
            continue;
        const uint8_t *half_base = (const uint8_t *)(intptr_t)bases[s] + (staged[s] & 1) * half;
        const uint8_t *mask = half_base + offs[4];
        int64_t row = at[s];
        for (int64_t t = 0; t < rows[s]; t++) {
            if (!mask[t * R + me])
                continue;
            if (xb)
                memcpy(x_out + row * xb, half_base + offs[0] + t * xb, (size_t)xb);
            if (sb)
                memcpy(s_out + row * sb, half_base + offs[1] + t * sb, (size_t)sb);
            if (k) {
                memcpy(idx_out + row * k, half_base + offs[2] + t * k * 8, (size_t)k * 8);
                memcpy(w_out + row * k, half_base + offs[3] + t * k * 4, (size_t)k * 4);
            }
            src_out[row] = (int32_t)(first + t);
            row++;
        }
        if (k && num_local > 0)  /* the source's rows at once: the kernel's vector loop, not k ids at a time */
            deepep_local_experts(idx_out + at[s] * k, w_out + at[s] * k, (row - at[s]) * k, first_expert, num_local);
        at[s] = row;
    }
    return 0;
}

int64_t deepep_sum_rows_bf16(int64_t m, int64_t hidden, int64_t num_sources, const int64_t *const *tokens,
                             const int64_t *counts, const uint16_t *const *rows, const int64_t *row_ld,
                             const int64_t *const *row_index, const int64_t *const *row_key, const uint16_t *bias0,
                             int64_t bias0_ld, const uint16_t *bias1, int64_t bias1_ld, uint16_t *out,
                             int64_t out_ld, uint16_t nan_bits);

/* A combine round's receive, every source at once, for this origin's tokens [lo, lo + m): source j's tokens are
 * the t whose routing-mask byte mask[t * R + j] is nonzero (ascending); j's count vector (int32 [R] at
 * CTL_VEC_OFF of its current half) must say it returned that many rows here, else returns j + 1 with got[j] =
 * the routed count and want[j] = the returned one (nothing written). j's rows are at rows_at[j] (row stride
 * ld[j] elements) when nonzero, else staged in its half at offs[0] after the rows it returned to lower origins
 * (row stride hidden); its top-k weight rows (wcols > 0) likewise at w_at[j] (stride w_ld[j]) or at offs[1].
 * Then out[t] = bf16(f32(bias0[t]) + f32(bias1[t]) + the rows) (deepep_sum_rows_bf16; a bias NULL: +0.0), the
 * rows in ascending j, or with order ([>= lo + m, R] int64) in ascending order[lo + t, j], ties in j; and, with
 * w_out, w_out[t] = +0.0 + each source's weight row in ascending j. tokens: scratch of 2 * R * m int64. got[j] =
 * rows of j. Returns -2 - j, writing nothing, when source j's rows would lie outside what can be read: past
 * cap[j] rows at rows_at[j] (and w_at[j]), or past its half; -1 if the row sum ran out of memory. */
int64_t deepep_in_combine(const int64_t *plan, const int64_t *offs, int64_t lo, int64_t m, int64_t hidden,
                          const uint8_t *mask, const int64_t *rows_at, const int64_t *ld, const int64_t *cap, int64_t wcols,
                          const int64_t *w_at, const int64_t *w_ld, const uint16_t *bias0, int64_t bias0_ld,
                          const uint16_t *bias1, int64_t bias1_ld, uint16_t *out, int64_t out_ld, float *w_out,
                          const int64_t *order, int64_t *tokens, int64_t *got, int64_t *want, uint16_t nan_bits)
{
    const int64_t R = plan[CTL_RANKS], me = plan[CTL_ME], half = plan[CTL_HALF], vec_off = plan[CTL_VEC_OFF];
    const int64_t *bases = PTR(plan, CTL_BASES, const int64_t *), *staged = PTR(plan, CTL_STAGED, const int64_t *);
    for (int64_t j = 0; j < R; j++)
        got[j] = 0;
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = 0; j < R; j++)
            if (mask[(lo + t) * R + j])
                tokens[j * m + got[j]++] = t;
    for (int64_t j = 0; j < R; j++) {
        const int32_t *sizes = (const int32_t *)((const uint8_t *)(intptr_t)bases[j] + (staged[j] & 1) * half + vec_off);
        want[j] = sizes[me];
        if (want[j] != got[j])
            return j + 1;
    }
    const int64_t *tok[R > 0 ? R : 1], *key[R > 0 ? R : 1];
    const uint16_t *row[R > 0 ? R : 1];
    int64_t cnt[R > 0 ? R : 1], row_ld[R > 0 ? R : 1], n = 0;
    const float *wrow[R > 0 ? R : 1];
    int64_t wld[R > 0 ? R : 1];
    for (int64_t j = 0; j < R; j++) {  /* each source's rows, every one checked to lie where it may be read */
        if (!got[j])
            continue;
        const uint8_t *half_base = (const uint8_t *)(intptr_t)bases[j] + (staged[j] & 1) * half;
        const int32_t *sizes = (const int32_t *)(half_base + vec_off);
        int64_t before = 0; /* rows j staged for lower origins than this one (its own are not staged) */
        for (int64_t s = 0; s < me; s++)
            before += s == j ? 0 : sizes[s] < 0 ? half : sizes[s];
        if ((rows_at[j] && got[j] > cap[j]) || (w_at[j] && got[j] > cap[j])
            || (!rows_at[j] && offs[0] + (before + got[j]) * 2 * hidden > half)
            || (wcols > 0 && !w_at[j] && offs[1] + (before + got[j]) * 4 * wcols > half))
            return -2 - j;
        tok[n] = tokens + j * m;
        cnt[n] = got[j];
        if (order) {
            int64_t *k = tokens + (R + j) * m;
            for (int64_t r = 0; r < got[j]; r++)
                k[r] = order[(lo + tok[n][r]) * R + j];
            key[n] = k;
        }
        row[n] = rows_at[j] ? (const uint16_t *)(intptr_t)rows_at[j]
                            : (const uint16_t *)(half_base + offs[0]) + before * hidden;
        row_ld[n] = rows_at[j] ? ld[j] : hidden;
        wrow[n] = w_at[j] ? (const float *)(intptr_t)w_at[j] : (const float *)(half_base + offs[1]) + before * wcols;
        wld[n] = w_at[j] ? w_ld[j] : wcols;
        n++;
    }
    const int64_t status = deepep_sum_rows_bf16(m, hidden, n, tok, cnt, row, row_ld, NULL, order ? key : NULL, bias0,
                                                bias0_ld, bias1, bias1_ld, out, out_ld, nan_bits);
    if (status)
        return -1;
    if (w_out && wcols > 0) {
        memset(w_out, 0, (size_t)(m * wcols) * sizeof *w_out);
        for (int64_t i = 0; i < n; i++)
            for (int64_t r = 0; r < cnt[i]; r++)
                for (int64_t c = 0; c < wcols; c++)
                    w_out[tok[i][r] * wcols + c] += wrow[i][r * wld[i] + c];
    }
    return 0;
}

/* Rows of n fields staged into this rank's current half, the pieces [lo[i], hi[i]) one after the other: field
 * f's row r (row_bytes[f] bytes at src[f] + r * src_ld[f], bytes) to offs[f] + (its place among the pieces' rows)
 * * row_bytes[f]; then, with vec, vec_ints int32 of it at CTL_VEC_OFF. With stream_side >= 0 the rows go by
 * streaming stores when that side's mode says so for their bytes (deepep_ll_streams; a combine's returned rows),
 * fenced before the return. Returns 1, writing nothing, when a piece is reversed or a field or the vector would
 * pass the half. */
int64_t deepep_in_stage(const int64_t *plan, int64_t n, const int64_t *src, const int64_t *src_ld,
                        const int64_t *row_bytes, const int64_t *offs, int64_t npieces, const int64_t *lo,
                        const int64_t *hi, const int32_t *vec, int64_t vec_ints, int64_t stream_side)
{
    const int64_t me = plan[CTL_ME], half = plan[CTL_HALF], vec_off = plan[CTL_VEC_OFF];
    const int64_t *bases = PTR(plan, CTL_BASES, const int64_t *), *staged = PTR(plan, CTL_STAGED, const int64_t *);
    int64_t rows = 0;
    for (int64_t i = 0; i < npieces; i++) {
        if (lo[i] < 0 || hi[i] < lo[i])
            return 1;
        rows += hi[i] - lo[i];
    }
    for (int64_t f = 0; f < n; f++)
        if (offs[f] < 0 || row_bytes[f] < 0 || offs[f] + rows * row_bytes[f] > half)
            return 1;
    if (vec && (vec_ints < 0 || vec_off + vec_ints * 4 > half))
        return 1;
    uint8_t *own = (uint8_t *)(intptr_t)bases[me] + (staged[me] & 1) * half;
    int64_t total = 0;
    for (int64_t f = 0; f < n; f++)
        total += rows * row_bytes[f];
    const int stream = stream_side >= 0 && deepep_ll_streams(stream_side, total);
    for (int64_t f = 0; f < n; f++) {
        uint8_t *d = own + offs[f];
        for (int64_t i = 0; i < npieces; i++) {
            const uint8_t *s = (const uint8_t *)(intptr_t)src[f] + lo[i] * src_ld[f];
            const int64_t k = hi[i] - lo[i];
            if (src_ld[f] == row_bytes[f]) {
                copy_maybe_streaming(d, s, (size_t)(k * row_bytes[f]), stream);
            } else {
                for (int64_t r = 0; r < k; r++)
                    copy_maybe_streaming(d + r * row_bytes[f], s + r * src_ld[f], (size_t)row_bytes[f], stream);
            }
            d += k * row_bytes[f];
        }
    }
    if (stream)
        stream_fence();
    if (vec)
        memcpy(own + vec_off, vec, (size_t)vec_ints * 4);
    return 0;
}

/* Dispatch's direct stores: the n rows of x (xb bytes each, row stride x_ld bytes) routed to rank j (mask[t * R
 * + j] nonzero), ascending, stored from address dst[j] on, for each rank j of order[0..R) with dst[j] nonzero
 * (entries outside [0, R) and repeats skipped); token by token, each row to its receivers in that order. got[j]:
 * the rows routed to j. Returns j + 1, storing nothing, when the rows routed to some rank j are not want[j]. */
int64_t deepep_in_store(int64_t n, int64_t num_ranks, const uint8_t *x, int64_t x_ld, int64_t xb,
                        const uint8_t *mask, const int64_t *order, const int64_t *dst, const int64_t *want,
                        int64_t *got)
{
    for (int64_t j = 0; j < num_ranks; j++)
        got[j] = 0;
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < num_ranks; j++)
            got[j] += mask[t * num_ranks + j] != 0;
    for (int64_t j = 0; j < num_ranks; j++)
        if (got[j] != want[j])
            return j + 1;
    /* got[j] holds (the first i with order[i] == j) << 32 | the rows stored at j so far: a rank listed again is
     * skipped, its rows stored once, without memory of the kernel's own. */
    for (int64_t i = num_ranks - 1; i >= 0; i--)
        if (order[i] >= 0 && order[i] < num_ranks)
            got[order[i]] = i << 32;
    /* Each row to all its receivers while it is in cache: x is read once, not once per receiver. */
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *row = x + t * x_ld, *m = mask + t * num_ranks;
        for (int64_t i = 0; i < num_ranks; i++) {
            const int64_t j = order[i];
            if (j < 0 || j >= num_ranks || !dst[j] || !m[j] || got[j] >> 32 != i)
                continue;
            memcpy((uint8_t *)(intptr_t)dst[j] + (got[j]++ & 0xffffffff) * xb, row, (size_t)xb);
        }
    }
    for (int64_t j = 0; j < num_ranks; j++)  /* the rows routed to each rank, as checked above */
        got[j] = want[j];
    return 0;
}

/* Every rank's count vector (n int32 at CTL_VEC_OFF of its current half) into out[R, n]. Returns 1, copying
 * nothing, when n ints pass the half. */
int64_t deepep_in_vectors(const int64_t *plan, int64_t n, int32_t *out)
{
    const int64_t R = plan[CTL_RANKS], half = plan[CTL_HALF], vec_off = plan[CTL_VEC_OFF];
    const int64_t *bases = PTR(plan, CTL_BASES, const int64_t *), *staged = PTR(plan, CTL_STAGED, const int64_t *);
    if (n < 0 || vec_off + n * 4 > half)
        return 1;
    for (int64_t p = 0; p < R; p++)
        memcpy(out + p * n, (const uint8_t *)(intptr_t)bases[p] + (staged[p] & 1) * half + vec_off, (size_t)n * 4);
    return 0;
}

/* A one-round dispatch's tail on the direct path, once every rank's counts are exchanged, in the order the engine's
 * steps take (deepep_ascend.ep.intranode, IntranodeEngine.dispatch):
 *   1. deepep_in_store of the n rows of x (xb bytes, row stride x_ld) by mask into every receiver's recv_x
 *      (ops[5] order, ops[6] dst, ops[7] want; ops[8] gets the rows routed to each rank);
 *   2. XDATA raised at every peer (xd_sent, xd_addrs: its slot's words, as deepep_in_signal);
 *   3. deepep_in_gather of every source's chunk 0 (ops[0] field offsets, ops[1] rows, ops[3] first output row of
 *      each source, ops[4] gets the rows of each; x is not gathered: it was stored);
 *   4. CONSUMED raised at every peer (cs_sent, cs_addrs) and every rank's staged count + 1 (chunk 0 is read);
 *   5. deepep_recv_channel_prefix of src_out (ops[9]: the R + 1 first rows of each source's block; ops[1], each
 *      source's staged tokens, its token count) into rcp [R, num_channels];
 *   6. every peer's XDATA polled (xd_own) up to `polls` rounds until it reads xd_need (deepep_in_poll).
 * counters: as deepep_in_signal's, for both signals. ns (NULL: not timed): the nanoseconds of steps 1 + 3, 2 + 4,
 * 5 and 6. Returns 0 when done; -1 when a peer's XDATA is still short (steps 1-5 done: the caller waits the long
 * way); 1 + j when the mask routes ops[8][j] rows to rank j, not ops[7][j] (nothing written); R + 1 when the
 * gather refused (a source's rows pass out_rows; steps 1-2 done); R + 2 when the channel prefix refused (steps 1-4
 * done, rcp unwritten). */
int64_t deepep_in_dispatch_tail(const int64_t *plan, int64_t n, const uint8_t *x, int64_t x_ld, int64_t xb,
                                const uint8_t *mask, int64_t *const *ops, int64_t *xd_sent, const int64_t *xd_addrs,
                                const int64_t *xd_own, int64_t xd_need, int64_t *cs_sent, const int64_t *cs_addrs,
                                const int64_t *counters, int64_t sb, int64_t k, uint8_t *s_out, int64_t *idx_out,
                                float *w_out, int32_t *src_out, int64_t out_rows, int64_t first_expert,
                                int64_t num_local, int64_t num_channels, int32_t *rcp, int64_t polls, int64_t *ns)
{
    const int64_t R = plan[CTL_RANKS];
    int64_t *staged = PTR(plan, CTL_STAGED, int64_t *);
    const int64_t *peers = PTR(plan, CTL_PEERS, const int64_t *);
    int64_t t[7] = {0};
    if (ns)
        t[0] = now_ns();
    const int64_t status = deepep_in_store(n, R, x, x_ld, xb, mask, ops[5], ops[6], ops[7], ops[8]);
    if (status)
        return status;
    if (ns)
        t[1] = now_ns();
    deepep_in_signal(R - 1, peers, R, xd_sent, xd_addrs, counters);
    if (ns)
        t[2] = now_ns();
    if (deepep_in_gather(plan, ops[0], ops[1], 0, 0, sb, k, NULL, s_out, idx_out, w_out, src_out, ops[3], out_rows,
                         ops[4], first_expert, num_local))
        return R + 1;
    if (ns)
        t[3] = now_ns();
    deepep_in_signal(R - 1, peers, R, cs_sent, cs_addrs, counters);
    for (int64_t p = 0; p < R; p++)
        staged[p] += 1;
    if (ns)
        t[4] = now_ns();
    if (deepep_recv_channel_prefix(src_out, ops[9], ops[1], R, num_channels, rcp))
        return R + 2;
    if (ns)
        t[5] = now_ns();
    const int64_t rc = deepep_in_poll(xd_own, R - 1, peers, NULL, xd_need, polls);
    if (ns) {
        t[6] = now_ns();
        ns[0] = (t[1] - t[0]) + (t[3] - t[2]);
        ns[1] = (t[2] - t[1]) + (t[4] - t[3]);
        ns[2] = t[5] - t[4];
        ns[3] = t[6] - t[5];
    }
    return rc;
}

/* A one-round combine's tail once every rank's headers are read: deepep_in_combine (its operands as there), then
 * CONSUMED raised at every peer (cs_sent, cs_addrs, counters: as deepep_in_signal's) and every rank's staged count
 * + 1, then, with cs_need > 0, every peer's CONSUMED word (cs_own) polled up to `polls` rounds until it reads
 * cs_need (the peers that read this rank's x in place are done with it). ns (NULL: not timed): the nanoseconds of
 * the receive, the signals and the poll. Returns deepep_in_combine's status when it is not 0 (nothing signalled),
 * R + 1 when a peer's CONSUMED is still short (the rest done), else 0. */
int64_t deepep_in_combine_tail(const int64_t *plan, const int64_t *offs, int64_t lo, int64_t m, int64_t hidden,
                               const uint8_t *mask, const int64_t *rows_at, const int64_t *ld, const int64_t *cap,
                               int64_t wcols, const int64_t *w_at, const int64_t *w_ld, const uint16_t *bias0,
                               int64_t bias0_ld, const uint16_t *bias1, int64_t bias1_ld, uint16_t *out,
                               int64_t out_ld, float *w_out, const int64_t *order, int64_t *tokens, int64_t *got,
                               int64_t *want, uint16_t nan_bits, int64_t *cs_sent, const int64_t *cs_addrs,
                               const int64_t *counters, const int64_t *cs_own, int64_t cs_need, int64_t polls,
                               int64_t *ns)
{
    const int64_t R = plan[CTL_RANKS];
    int64_t *staged = PTR(plan, CTL_STAGED, int64_t *);
    const int64_t *peers = PTR(plan, CTL_PEERS, const int64_t *);
    const int64_t t0 = ns ? now_ns() : 0;
    const int64_t status = deepep_in_combine(plan, offs, lo, m, hidden, mask, rows_at, ld, cap, wcols, w_at, w_ld,
                                             bias0, bias0_ld, bias1, bias1_ld, out, out_ld, w_out, order, tokens, got,
                                             want, nan_bits);
    if (status)
        return status;
    const int64_t t1 = ns ? now_ns() : 0;
    deepep_in_signal(R - 1, peers, R, cs_sent, cs_addrs, counters);
    for (int64_t p = 0; p < R; p++)
        staged[p] += 1;
    const int64_t t2 = ns ? now_ns() : 0;
    const int64_t short_ = cs_need > 0 && deepep_in_poll(cs_own, R - 1, peers, NULL, cs_need, polls);
    if (ns)
        ns[0] = t1 - t0, ns[1] = t2 - t1, ns[2] = now_ns() - t2;
    return short_ ? R + 1 : 0;
}
