/* The normal-mode engine's fixed work on one node, by loads and stores (deepep_ascend/ep/intranode.py,
 * docs/design/data-path.md): the signals of transports' signal() and wait_until(), a call's chunk-0
 * exchange and a dispatch chunk's receive, each in one C call where the Python steps made several per peer.
 *
 *   deepep_in_signal    one full fence, then each destination's running signal value, plus one, stored
 *                        into the word this rank alone writes there
 *   deepep_in_poll      this rank's signal words polled for a bounded number of rounds until every source
 *                        reaches its value; an acquire fence after
 *   deepep_in_exchange  chunk 0 of a call: the count vector and the header stored into this rank's
 *                        current half, READY to every peer (deepep_in_signal), every source's READY
 *                        polled (deepep_in_poll), then every rank's header words gathered and compared
 *   deepep_in_gather    every source's rows for this rank out of its staged dispatch chunk, into the outputs
 *
 * A poll that runs out returns -1 having read nothing after the signals: the caller then waits the long
 * way (transports' wait_until, with its deadline and abort checks). Addresses are the caller's mapped
 * window memory; the Python side (deepep_ascend.native.intranode) checks them once, when it builds a plan.
 */
#include <stdint.h>
#include <string.h>

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
 * into idx_out, k float32 weights at offs[3] into w_out (k == 0: neither), and first[s] + t into src_out.
 * got[s] = the rows of s; at[s] += got[s]. Returns 1, writing nothing, when a source's rows would pass
 * out_rows or start before 0. */
int64_t deepep_in_gather(const int64_t *plan, const int64_t *offs, const int64_t *rows, const int64_t *first,
                         int64_t xb, int64_t sb, int64_t k, uint8_t *x_out, uint8_t *s_out, int64_t *idx_out,
                         float *w_out, int32_t *src_out, int64_t *at, int64_t out_rows, int64_t *got)
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
            src_out[row] = (int32_t)(first[s] + t);
            row++;
        }
        at[s] = row;
    }
    return 0;
}
