/* A low-latency call's steps on one node in two C calls, issue and finish, instead of one per step.
 *
 * The steps are deepep_ll_*'s (ll_calls.c, ll_cast.c); what these add is that everything fixed for a buffer
 * and a call shape (window addresses, offsets, peers, traffic counters) lies in a plan the caller builds once
 * (int64 words, PLAN_* below; deepep_ascend/native/ll_fused.py builds and checks it), so a call passes only
 * what changes: its half, its number, its tensors. The caller takes this path only when every rank is mapped,
 * no rank is masked and nobody records wait times (the cases the plan does not cover take the step-by-step
 * path, with the same bytes).
 *
 *   deepep_ll_dispatch_issue   stage x (a copy, or the FP8 cast), route indices and counts into every
 *                              destination, publish (headers, fence, signals), count the traffic
 *   deepep_ll_dispatch_finish  the bounded wait and header check (deepep_ll_await), then the receive
 *                              (deepep_ll_dispatch_recv)
 *   deepep_ll_combine_issue    the returned rows and counts into every destination (or, zero-copy, the
 *                              layout published for the receivers to read the rows), publish, count
 *   deepep_ll_combine_finish   the bounded wait and header check, then the weighted sum of every row where
 *                              it lies (deepep_ll_combine_recv), then the pulled sources' stamps
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* the steps, from ll_calls.c and ll_cast.c */
int64_t deepep_ll_dispatch_send(int64_t n, int64_t k, const int64_t *slots, int64_t m, int64_t num_local,
                                int64_t num_ranks, int64_t me, const int64_t *bases, const int32_t *mask,
                                int64_t index_off, int64_t counts_off, const int32_t *counts, int64_t *sent);
int64_t deepep_ll_dispatch_recv(int64_t num_local, int64_t num_ranks, int64_t m, const int32_t *sig,
                                const int32_t *mask, const int32_t *index, const int64_t *bases, int64_t send_off,
                                const int64_t *stamps, int64_t want, int64_t mb, int64_t xb, int64_t sw,
                                uint8_t *recv_x, int32_t *scales, int32_t *src_info, int32_t *recv_count,
                                int64_t *layout_range, const int32_t *const *stale, int64_t *bad);
int64_t deepep_ll_combine_send(int64_t num_local, int64_t num_ranks, int64_t m, int64_t row_bytes, int64_t me,
                               const int64_t *layout_range, const uint8_t *src, int64_t stride_e, int64_t stride_r,
                               const int64_t *bases, const int32_t *mask, int64_t recv_off, int64_t counts_off,
                               int64_t keep, int64_t *sent);
int64_t deepep_ll_combine_recv(int64_t n, int64_t k, int64_t hidden, int64_t m, int64_t num_local, int64_t num_ranks,
                               const int32_t *sig, const int32_t *mask, const int32_t *expected, const uint16_t *rows,
                               int64_t row_ld, int64_t num_rows, const int64_t *idx, const float *w, uint16_t *out,
                               int64_t out_ld, uint16_t nan_bits, const int64_t *src_addr, const int64_t *src_ld,
                               const int64_t *src_begin, int64_t rows_per_expert, int64_t *bad);
int64_t deepep_ll_publish(int64_t n, const int64_t *order, int64_t num_ranks, const int64_t *hdr_words,
                          int64_t words, const int64_t *hdr_addrs, const int64_t *sig_addrs, int64_t value);
int64_t deepep_ll_await(int64_t num_ranks, int64_t me, const int64_t *sig, const int32_t *mask, int64_t need,
                        int64_t polls, const int64_t *hdr, int64_t hdr_words, int64_t seq, int64_t op,
                        int64_t ignore_flags);
int64_t deepep_ll_cast_messages(int64_t n, int64_t hidden, const uint16_t *x, int64_t x_ld, int64_t round_scale,
                                int64_t ue8m0, uint8_t *out, int64_t out_ld);

/* Plan words. Addresses are of int64 [R] arrays unless said otherwise; half h's words start at
 * PLAN_HALF + h * PLAN_HALF_WORDS. */
enum {
    PLAN_R, PLAN_L, PLAN_M, PLAN_H, PLAN_ME,
    PLAN_BASES,        /* every rank's window data region (all nonzero: every rank mapped) */
    PLAN_ORDER,        /* the destinations in publishing order, PLAN_NORDER of them (int64 ranks) */
    PLAN_NORDER,
    PLAN_RECV_OFF,     /* the layout's receive region, from a half's start */
    PLAN_SEND_OFF,     /* its send region */
    PLAN_PULL_OFF,     /* where a zero-copy combine publishes its layout_range, from a half's start */
    PLAN_HDR_WORDS,    /* int64 words from one source's header to the next in ll_ctl */
    PLAN_CNT_BYTES,    /* this rank's traffic counters of each peer (int64 addresses): bytes put, */
    PLAN_CNT_PUTS,     /* puts, */
    PLAN_CNT_SIGNALS,  /* signals */
    PLAN_HALF,
};
enum {
    HALF_BASE,      /* the half's offset in the window */
    HALF_STAMPS,    /* each source's send-region stamp word of this half (addresses) */
    HALF_HDR_OUT,   /* this rank's header slot in each destination's ll_ctl (addresses) */
    HALF_SIG_OUT,   /* this rank's signal word at each destination (addresses) */
    HALF_SIG_IN,    /* this rank's own signal words of the half (int64 [R], written by the sources) */
    HALF_HDR_IN,    /* this rank's header rows of the half (int64 [R][hdr_words], written by the sources) */
    PLAN_HALF_WORDS,
};

#define OP_DISPATCH 1
#define OP_COMBINE 2
#define F_PULL 8

/* Nanoseconds of CLOCK_MONOTONIC: the steps a caller times (its phase breakdown) when it passes `ns`. */
static inline int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline const int64_t *arr(const int64_t *plan, int64_t word) { return (const int64_t *)(intptr_t)plan[word]; }
static inline const int64_t *half(const int64_t *plan, int64_t h) { return plan + PLAN_HALF + h * PLAN_HALF_WORDS; }

/* Add to this rank's counters of every destination d: one put of row_bytes * sent[d] bytes when sent[d] > 0,
 * one put of the L counts, one of the header, one signal (what the step-by-step path records per peer). */
static void count_traffic(const int64_t *plan, const int64_t *sent, int64_t row_bytes, int64_t hdr_bytes)
{
    const int64_t *order = arr(plan, PLAN_ORDER), *bytes = arr(plan, PLAN_CNT_BYTES);
    const int64_t *puts = arr(plan, PLAN_CNT_PUTS), *signals = arr(plan, PLAN_CNT_SIGNALS);
    const int64_t fixed = 4 * plan[PLAN_L] + hdr_bytes;
    for (int64_t i = 0; i < plan[PLAN_NORDER]; i++) {
        const int64_t d = order[i];
        *(int64_t *)(intptr_t)bytes[d] += sent[d] * row_bytes + fixed;
        *(int64_t *)(intptr_t)puts[d] += (sent[d] > 0) + 2;
        *(int64_t *)(intptr_t)signals[d] += 1;
    }
}

/* Publish the header hdr (plan[PLAN_HDR_WORDS] words at most; `words` of them) of half h to every
 * destination with signal value `value`, then count the traffic. */
static int64_t publish(const int64_t *plan, int64_t h, const int64_t *hdr, int64_t words, int64_t value,
                       const int64_t *sent, int64_t row_bytes)
{
    const int64_t *hp = half(plan, h);
    if (deepep_ll_publish(plan[PLAN_NORDER], arr(plan, PLAN_ORDER), plan[PLAN_R], hdr, words,
                          (const int64_t *)(intptr_t)hp[HALF_HDR_OUT], (const int64_t *)(intptr_t)hp[HALF_SIG_OUT],
                          value))
        return 2;
    count_traffic(plan, sent, row_bytes, 8 * words);
    return 0;
}

/* A dispatch's sends of call `value - 1` in half h. Stages this rank's n tokens in its send region (message
 * t at send + t * mb): stage 1 copies row t of x (bf16, x_ld elements apart) to bytes [16, 16 + 2H) of
 * message t; stage 2 writes whole messages with deepep_ll_cast_messages (round_scale, ue8m0); stage 0 leaves
 * the region as it is. Then deepep_ll_dispatch_send (slots [n, k], counts [L*R], sent [R]) into every rank,
 * then the header `hdr` (`words` int64) and signal `value` to every destination, and the traffic (each
 * routed row counted as mb + 4 bytes: the message its receiver loads and its index word).
 * ns (NULL: not timed): ns[0] = the staging's nanoseconds, ns[1] = the publishing's.
 * Returns 0; 1 (nothing sent) when a slot lies outside [-1, L*R*M) or the cast refuses its shape; 2 when a
 * destination has no header slot or signal word (the plan's fault: rows and counts are written). */
int64_t deepep_ll_dispatch_issue(const int64_t *plan, int64_t h, int64_t n, int64_t k, const int64_t *slots,
                                 const int32_t *counts, int64_t *sent, int64_t stage, const uint16_t *x,
                                 int64_t x_ld, int64_t round_scale, int64_t ue8m0, int64_t mb, const int64_t *hdr,
                                 int64_t words, int64_t value, int64_t *ns)
{
    const int64_t R = plan[PLAN_R], L = plan[PLAN_L], M = plan[PLAN_M], H = plan[PLAN_H], me = plan[PLAN_ME];
    const int64_t *bases = arr(plan, PLAN_BASES);
    const int64_t base = half(plan, h)[HALF_BASE];
    uint8_t *send = (uint8_t *)(intptr_t)bases[me] + base + plan[PLAN_SEND_OFF];
    for (int64_t i = 0; i < n * k; i++)
        if (slots[i] < -1 || slots[i] >= L * R * M)
            return 1;
    const int64_t t0 = ns ? now_ns() : 0;
    if (stage == 2 && deepep_ll_cast_messages(n, H, x, x_ld, round_scale, ue8m0, send, mb))
        return 1;
    if (stage == 1)
        for (int64_t t = 0; t < n; t++)
            memcpy(send + t * mb + 16, x + t * x_ld, (size_t)(2 * H));
    const int64_t t1 = ns ? now_ns() : 0;
    if (deepep_ll_dispatch_send(n, k, slots, M, L, R, me, bases, NULL, base + plan[PLAN_RECV_OFF], base + me * L * 4,
                                counts, sent))
        return 1;
    const int64_t t2 = ns ? now_ns() : 0;
    const int64_t rc = publish(plan, h, hdr, words, value, sent, mb + 4);
    if (ns)
        ns[0] = t1 - t0, ns[1] = now_ns() - t2;
    return rc;
}

/* The bounded wait of a call `seq` of op in half h (deepep_ll_await with `polls` rounds and ignore_flags),
 * as deepep_ll_dispatch_finish and deepep_ll_combine_finish begin: -1 when a source is late (nothing read),
 * -2 when the headers disagree, else the headers' answer (1, or 3: a source set an ignored flag). */
static int64_t await_call(const int64_t *plan, int64_t h, int64_t seq, int64_t op, int64_t polls, int64_t ignore,
                          int64_t *ns)
{
    const int64_t *hp = half(plan, h);
    const int64_t t0 = ns ? now_ns() : 0;
    const int64_t rc = deepep_ll_await(plan[PLAN_R], plan[PLAN_ME], (const int64_t *)(intptr_t)hp[HALF_SIG_IN], NULL,
                                       seq + 1, polls, (const int64_t *)(intptr_t)hp[HALF_HDR_IN],
                                       plan[PLAN_HDR_WORDS], seq, op, ignore);
    if (ns)
        ns[0] = now_ns() - t0, ns[1] = 0;
    return rc == 0 ? -2 : rc;
}

/* A dispatch's receive of call seq in half h: the bounded wait (await_call: -1 late, -2 headers disagree,
 * nothing written), then deepep_ll_dispatch_recv into recv_x [L, R*M, xb] bytes, scales (channels-first,
 * sw words, or NULL), src_info, recv_count, layout_range, with stale[3] and bad[3] as it takes them; its
 * status (0 done, 1, 2, 3, 4) is returned. ns (NULL: not timed): ns = {the wait's nanoseconds, 0}. */
int64_t deepep_ll_dispatch_finish(const int64_t *plan, int64_t h, int64_t seq, int64_t polls, int64_t mb, int64_t xb,
                                  int64_t sw, uint8_t *recv_x, int32_t *scales, int32_t *src_info, int32_t *recv_count,
                                  int64_t *layout_range, const int32_t *const *stale, int64_t *bad, int64_t *ns)
{
    const int64_t rc = await_call(plan, h, seq, OP_DISPATCH, polls, 0, ns);
    if (rc < 0)
        return rc;
    const int64_t R = plan[PLAN_R], L = plan[PLAN_L], M = plan[PLAN_M], me = plan[PLAN_ME];
    const int64_t *bases = arr(plan, PLAN_BASES), *hp = half(plan, h);
    const uint8_t *own = (const uint8_t *)(intptr_t)bases[me] + hp[HALF_BASE];
    return deepep_ll_dispatch_recv(L, R, M, (const int32_t *)own, NULL,
                                   (const int32_t *)(own + plan[PLAN_RECV_OFF]), bases,
                                   hp[HALF_BASE] + plan[PLAN_SEND_OFF], (const int64_t *)(intptr_t)hp[HALF_STAMPS],
                                   seq + 1, mb, xb, sw, recv_x, scales, src_info, recv_count, layout_range, stale, bad);
}

/* A combine's sends of call `value - 1` in half h: with pull, layout_range [L, R] (int64) first published at
 * the half's pull offset of this rank's window (a zero-copy combine: src is the send region, keep 2); then
 * deepep_ll_combine_send (src rows of row_bytes, stride_e / stride_r bytes apart; keep 0, 1 or 2; sent [R]),
 * then the header and signal to every destination and the traffic (rows counted as row_bytes each).
 * ns (NULL: not timed): ns[0] = 0 (nothing is staged), ns[1] = the publishing's nanoseconds.
 * Returns 0; 1 (nothing sent) for a count above M or a run outside [0, R*M); 2 as deepep_ll_dispatch_issue. */
int64_t deepep_ll_combine_issue(const int64_t *plan, int64_t h, const int64_t *layout_range, const uint8_t *src,
                                int64_t stride_e, int64_t stride_r, int64_t row_bytes, int64_t keep, int64_t pull,
                                int64_t *sent, const int64_t *hdr, int64_t words, int64_t value, int64_t *ns)
{
    const int64_t R = plan[PLAN_R], L = plan[PLAN_L], M = plan[PLAN_M], me = plan[PLAN_ME];
    const int64_t *bases = arr(plan, PLAN_BASES);
    const int64_t base = half(plan, h)[HALF_BASE];
    for (int64_t i = 0; i < L * R; i++) {
        const int64_t c = layout_range[i] & 0xFFFFFFFF, b = layout_range[i] >> 32;
        if (c > M || b < 0 || b + c > R * M)
            return 1;
    }
    if (pull)
        memcpy((uint8_t *)(intptr_t)bases[me] + base + plan[PLAN_PULL_OFF], layout_range, (size_t)(8 * L * R));
    if (deepep_ll_combine_send(L, R, M, row_bytes, me, layout_range, src, stride_e, stride_r, bases, NULL,
                               base + plan[PLAN_RECV_OFF], base + me * L * 4, keep, sent))
        return 1;
    const int64_t t0 = ns ? now_ns() : 0;
    const int64_t rc = publish(plan, h, hdr, words, value, sent, row_bytes);
    if (ns)
        ns[0] = 0, ns[1] = now_ns() - t0;
    return rc;
}

/* A combine's receive of call seq in half h: the bounded wait (await_call, F_PULL a source's own choice: -1
 * late, -2 headers disagree, nothing written); then the weighted sum (deepep_ll_combine_recv) of n tokens'
 * k rows (slots [n, k], weights [n, k] float32, expected [E] int32) into out (bf16, out_ld elements apart):
 * a pushed source's rows from this rank's receive region, this rank's own rows from own (when not NULL: own
 * [L, R*M, H] bf16, own_ld[0..1] elements apart, rows of expert e from the begin in own_lr[e*R + me] >> 32,
 * own_lr this rank's layout_range [L, R] int64), a source whose header
 * says F_PULL from its send region through the layout_range it published. Then every such source's stamp
 * must still read seq + 1. Returns 0 done; 1 a slot or a source's run out of range (nothing written); 2 a
 * count differs (bad = {expert, got, want}; nothing written); 3 a pulled source's stamp moved (bad = {source,
 * stamp}; out written); 4 out of memory (nothing written). ns as deepep_ll_dispatch_finish's. */
int64_t deepep_ll_combine_finish(const int64_t *plan, int64_t h, int64_t seq, int64_t polls, int64_t n, int64_t k,
                                 const int64_t *slots, const float *weights, const int32_t *expected, uint16_t *out,
                                 int64_t out_ld, uint16_t nan_bits, const uint16_t *own, const int64_t *own_ld,
                                 const int64_t *own_lr, int64_t *bad, int64_t *ns)
{
    const int64_t rc = await_call(plan, h, seq, OP_COMBINE, polls, F_PULL, ns);
    if (rc < 0)
        return rc;
    const int64_t R = plan[PLAN_R], L = plan[PLAN_L], M = plan[PLAN_M], H = plan[PLAN_H], me = plan[PLAN_ME];
    const int64_t W = plan[PLAN_HDR_WORDS];
    const int64_t *bases = arr(plan, PLAN_BASES), *hp = half(plan, h);
    const int64_t *hdr = (const int64_t *)(intptr_t)hp[HALF_HDR_IN];
    const uint8_t *mine = (const uint8_t *)(intptr_t)bases[me] + hp[HALF_BASE];
    const int pulled_any = rc == 3;
    int64_t *meta = NULL;
    if (own || pulled_any) {
        /* [addr R | ld 2R | begins R*L], the sources argument of deepep_ll_combine_recv */
        meta = calloc((size_t)(R * (3 + L)), sizeof *meta);
        if (!meta)
            return 4;
        int64_t *addr = meta, *ld = meta + R, *begins = meta + 3 * R;
        if (own) {
            addr[me] = (int64_t)(intptr_t)own;
            ld[2 * me] = own_ld[0], ld[2 * me + 1] = own_ld[1];
            for (int64_t e = 0; e < L; e++)
                begins[me * L + e] = own_lr[e * R + me] >> 32;
        }
        for (int64_t d = 0; pulled_any && d < R; d++) {
            if (d == me || !((hdr[d * W] >> 8) & F_PULL))
                continue;
            const uint8_t *peer = (const uint8_t *)(intptr_t)bases[d] + hp[HALF_BASE];
            const int64_t *lr = (const int64_t *)(peer + plan[PLAN_PULL_OFF]);
            addr[d] = (int64_t)(intptr_t)(peer + plan[PLAN_SEND_OFF]);
            ld[2 * d] = R * M * H, ld[2 * d + 1] = H;
            for (int64_t e = 0; e < L; e++)
                begins[d * L + e] = lr[e * R + me] >> 32;
        }
    }
    int64_t st = deepep_ll_combine_recv(n, k, H, M, L, R, (const int32_t *)mine, NULL, expected,
                                        (const uint16_t *)(mine + plan[PLAN_RECV_OFF]), H, R * L * M, slots, weights,
                                        out, out_ld, nan_bits, meta, meta ? meta + R : NULL,
                                        meta ? meta + 3 * R : NULL, R * M, bad);
    free(meta);
    /* every load of a pulled source's rows before its stamp's (as deepep_ll_dispatch_recv); checked whatever
     * the sum's status: a rewritten source also moves its counts and begins */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const int64_t *stamps = (const int64_t *)(intptr_t)hp[HALF_STAMPS];
    for (int64_t d = 0; pulled_any && d < R; d++) {
        if (d == me || !((hdr[d * W] >> 8) & F_PULL))
            continue;
        const int64_t got = __atomic_load_n((const int64_t *)(intptr_t)stamps[d], __ATOMIC_RELAXED);
        if (got != seq + 1) {
            bad[0] = d, bad[1] = got;
            return 3;
        }
    }
    return st;
}
