"""The shared reduction of combine: rows gathered from several sources summed per token in float32, in
source order, rounded once to bf16 (DeepEP's arithmetic, docs/semantics/deepep-api.md §4.6).

:func:`accumulate_rows` picks the cheapest exact route for the rows at hand: the native one-pass kernel
(:func:`deepep_ascend.native.sum_rows`), a scatter when no token has two rows, run-wise BF16 adds for two
sources, ``embedding_bag`` sums, or the float32 chain; every route gives the same bits. Used by the
normal-mode engines (:mod:`.intranode`, :mod:`.internode`) and by MegaMoE's combine.
"""

from __future__ import annotations

import torch

from .. import native as _native
from .memory import outside_inference_mode

_COMBINE_BLOCK_BYTES = 2 << 20  # float32 accumulator block of combine: stays in cache
_BAG_MIN_TOKENS = 8  # fewest tokens per block for which _sum_by_bags is used by default


def accumulate_rows(out, sources, acc, tmp, bias=None, bias_offset: int = 0, edges=None, bounds=None,
                    clean=None, max_runs: int | None = None, bags: bool | None = None, disjoint: bool = True,
                    native: bool = True, keys=None) -> None:
    """``out = bf16(f32(bias0) + f32(bias1) + Σ_sources f32(row))`` per row, sources in the given order.

    ``out`` ``[m, H]`` bf16; ``sources``: ``(rows [cnt, H] bf16, tokens [cnt] int64)`` — row ``i``
    adds to ``out[tokens[i]]``, ``tokens`` ascending in ``[0, m)``; ``bias``: ``None`` (the sum
    starts from +0.0) or a pair whose rows ``bias_offset + t`` go with ``out[t]`` (second may be
    None). Works through cache-sized blocks of the float32 scratch ``acc`` ``[block, H]`` (``tmp``
    the same size converts scattered rows), one rounding at the end, so every element gets its
    additions in exactly the order of ``sources`` (DeepEP's ascending rank). ``edges``/``bounds``:
    block edges and each source's ``searchsorted`` of them, if the caller has them. ``clean``:
    per source, True if its rows hold no ``-0.0`` (lets the sign-of-zero fix-up below be skipped).
    ``max_runs``: passed to :func:`_sum_two_by_runs` (0 declines it; with ``bags=False`` that forces the
    float32 chain, as ``bench.combine_sum`` does).
    ``bags``: :func:`_sum_by_bags` for two or more sources without bias (two: if the run-wise path
    declines) if None (the default) while a block of the scratch ``acc`` holds enough tokens, also
    for one source and smaller blocks if True, never if False (``bench.combine_sum`` times the
    paths against each other). ``disjoint``: :func:`_copy_disjoint` where no token has two rows
    (False: never; the tests force each path this way). ``native``: the one-pass C kernel
    :func:`deepep_ascend.native.sum_rows` (the float32 chain itself, each row read once) first,
    where it was built, for bias or any source with rows (one source too: one pass, where
    :func:`_copy_disjoint` scatters the rows, then fixes signed zeros in a second pass); False: only the torch
    paths below, as
    ``bench.combine_sum`` and the tests compare them.
    ``keys``: None (every token's rows add in source order), or per source ``[cnt]`` int64 sort
    keys, one row per token per source: each token's rows then add in ascending key, ties in source
    order (``EPBuffer.combine`` adds each rank's row at its last top-k slot,
    docs/semantics/deepep-api.md §13.5); through the native kernel, else :func:`_sum_by_keys`.

    The torch paths, where the kernel is not built or declines (same bits as the float32 chain; a
    NaN stays a NaN, its payload may become the canonical one): without bias, at most two sources
    whose tokens form long runs go through :func:`_sum_two_by_runs` (one BF16 ``add`` per run:
    torch computes a BF16 sum in float32 and rounds once, and the float32 sum of two BF16 values
    is that same float32 value); sources that never share a token through :func:`_copy_disjoint`
    (one scatter per source); the others through :func:`_sum_by_bags` (one float32
    ``embedding_bag`` sum per block).
    The float32 chain starts from a copy of its first row instead of ``+0.0 + row``. Both differ
    from the reference only where every term is ``-0.0`` (the reference's ``+0.0`` start gives
    ``+0.0``), which one ``+ 0.0`` repairs unless a term covering those tokens is known clean.
    """
    m = out.size(0)
    block = acc.size(0)
    if keys is not None:
        if not (native and _native.sum_rows(out, sources, bias, bias_offset, keys=keys)):
            _sum_by_keys(out, sources, keys, acc, bias, bias_offset)
        return
    clean = [False] * len(sources) if clean is None else list(clean)
    live = any(tokens.numel() for _, tokens in sources)
    if native and (live or bias is not None) and _native.sum_rows(out, sources, bias, bias_offset):
        return
    if bias is None and _sum_two_by_runs(out, sources, clean, max_runs):
        return
    if bias is None and disjoint and _copy_disjoint(out, sources, clean):
        return
    if bias is None and bags is not False and _sum_by_bags(out, sources, acc, force=bags is True):
        return
    if edges is None:
        edges = torch.arange(0, m + block, block).clamp_(max=m)
    if bounds is None:
        bounds = [torch.searchsorted(tokens, edges).tolist() for _, tokens in sources]
    for b in range(len(edges) - 1):
        a_t, b_t = int(edges[b]), int(edges[b + 1])
        if b_t <= a_t:
            continue
        parts = [(rows[bnd[b]:bnd[b + 1]], tokens[bnd[b]:bnd[b + 1]], bnd[b + 1] - bnd[b] == b_t - a_t, cl)
                 for (rows, tokens), bnd, cl in zip(sources, bounds, clean) if bnd[b + 1] > bnd[b]]
        blk = acc[:b_t - a_t]
        signed_zero = False  # blk may hold a -0.0 that the reference's +0.0 start would not
        if bias is not None:  # f32(bias0) + f32(bias1), a missing one being +0.0, exactly as DeepEP
            blk.copy_(bias[0][bias_offset + a_t:bias_offset + b_t])
            if bias[1] is not None:
                blk.add_(bias[1][bias_offset + a_t:bias_offset + b_t])
            else:
                blk.add_(0.0)
        elif parts and parts[0][2]:
            blk.copy_(parts[0][0])
            signed_zero = not parts[0][3]
            parts = parts[1:]
        else:
            blk.zero_()
        for rows, tokens, full, cl in parts:
            if full:
                blk.add_(rows)
                signed_zero = signed_zero and not cl
            else:
                t = tmp[:rows.size(0)]
                t.copy_(rows)
                blk.index_add_(0, tokens - a_t, t)
        if signed_zero:
            blk.add_(0.0)
        out[a_t:b_t].copy_(blk)


def _sum_by_keys(out, sources, keys, acc, bias, bias_offset: int) -> None:
    """:func:`accumulate_rows` with sort keys, in torch: per block of tokens, the float32 sum starts
    from the bias (or +0.0) and takes the rows key by key, ascending, sources in order within a key
    (one ``index_add_`` per key and source: a token has at most one row per source)."""
    m = out.size(0)
    block = acc.size(0)
    for a_t in range(0, m, block):
        b_t = min(m, a_t + block)
        blk = acc[:b_t - a_t]
        if bias is not None:
            blk.copy_(bias[0][bias_offset + a_t:bias_offset + b_t])
            if bias[1] is not None:
                blk.add_(bias[1][bias_offset + a_t:bias_offset + b_t])
            else:
                blk.add_(0.0)  # a missing bias is +0.0, as in the native kernel
        else:
            blk.zero_()
        parts = []
        for (rows, tokens), key in zip(sources, keys):
            lo, hi = torch.searchsorted(tokens, torch.tensor([a_t, b_t], dtype=tokens.dtype)).tolist()
            if hi > lo:
                parts.append((rows[lo:hi], tokens[lo:hi] - a_t, key[lo:hi]))
        if parts:
            for value in torch.unique(torch.cat([key for _, _, key in parts])).tolist():
                for rows, tokens, key in parts:
                    sel = torch.nonzero(key == value).squeeze(1)
                    if sel.numel():
                        blk.index_add_(0, tokens[sel], rows[sel].float())
        out[a_t:b_t].copy_(blk)


def _copy_disjoint(out, sources, clean) -> bool:
    """:func:`accumulate_rows` without bias when no token has rows from two sources: each source's
    rows are scattered into ``out`` (``index_copy_``), tokens without a row are zero, and one
    ``+ 0.0`` pass turns ``-0.0`` into the reference's ``+0.0`` unless every source is clean. The
    float32 sum of one row from ``+0.0`` is that row (up to the sign of zero), so the bits are the
    chain's with no float32 pass: MegaMoE combines (token, expert) pairs this way, one row each.
    Returns False (nothing written) when some token has two or more rows.
    """
    live = [(rows, tokens, cl) for (rows, tokens), cl in zip(sources, clean) if tokens.numel()]
    m = out.size(0)
    total = sum(tokens.numel() for _, tokens, _ in live)
    if not live or total > m:
        return False
    if int(torch.bincount(torch.cat([tokens for _, tokens, _ in live]), minlength=m).max()) > 1:
        return False  # some token has rows from two sources
    if total < m:
        out.zero_()
    for rows, tokens, _ in live:
        out.index_copy_(0, tokens, rows)
    if not all(cl for _, _, cl in live):
        out.add_(0.0)
    return True


def two_source_run_limit(m: int, hidden: int) -> int:
    """Most runs for which :func:`_sum_two_by_runs` is used on ``[m, hidden]``: about half the run
    count at which it stops beating the float32 chain (one torch thread).

    Measured on the development VM (``python -m bench combine-sum``, two runs): a run costs
    9-10 µs of Python and torch call overhead, and the run-wise sum saves 0.6-0.7 ns per element
    over the float32 chain, so the two break even near ``m * hidden / 15000`` runs; half of that
    keeps a margin. (The limit used to be
    ``m / 64``: at 2 ranks on DeepSeek-V3 shapes a rank whose tokens miss the other rank a few
    dozen times fell to the float32 chain, about twice as slow there.)
    """
    return max(8, m * hidden // 32768)


def source_runs(m: int, token_lists) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of tokens ``[0, m)`` covered by the same sources (at most 7).

    ``token_lists``: per source, the int64 token ids it has a row for. Returns ``code`` ``[m]`` int8
    (bit ``i`` set: source ``i`` has the token) and ``starts`` int64, the first token of every run
    but the first (so there are ``starts.numel() + 1`` runs).
    """
    code = torch.zeros(m, dtype=torch.int8)
    for bit, tokens in enumerate(token_lists):
        code[tokens] += 1 << bit
    return code, torch.nonzero(code[1:] != code[:-1]).squeeze(1).add_(1)


def _sum_two_by_runs(out, sources, clean, max_runs: int | None = None) -> bool:
    """:func:`accumulate_rows` without bias for at most two non-empty sources, one torch call per
    run of tokens with the same sources (both: one BF16 ``add``; one: a copy; none: zeros).

    At two ranks nearly every token has both sources, so a whole round is a few dozen to a few
    hundred long runs, with no float32 pass and no gather of a source that misses a few tokens.
    Returns False (nothing written) when it does not apply or there are more runs than
    ``max_runs`` (default :func:`two_source_run_limit`).
    """
    # per source: rows, tokens, clean (went through + 0.0: no -0.0, NaNs as the chain's), no -0.0
    live = [[rows, tokens, cl, cl] for (rows, tokens), cl in zip(sources, clean) if tokens.numel()]
    m = out.size(0)
    if len(live) > 2 or not m:
        return False
    code, starts = source_runs(m, [tokens for _, tokens, _, _ in live])
    if starts.numel() + 1 > (two_source_run_limit(m, out.size(1)) if max_runs is None else max_runs):
        return False
    if len(live) == 2 and not (live[0][2] or live[1][2]):
        # The sum of two rows needs the + 0.0 fix-up below only where both are -0.0. -0.0 is int16's
        # minimum (0x8000), so one min() pass over the smaller source (about a third of the fix-up
        # pass) can show that it holds none, which spares the fix-up after every two-row add.
        i = int(live[1][0].size(0) < live[0][0].size(0))
        live[i][3] = int(live[i][0].view(torch.int16).min()) != -32768
    bounds = [0] + starts.tolist() + [m]
    codes = code[bounds[:-1]].tolist()
    # position of the first row of each run in each source: tokens before the run start
    firsts = [torch.searchsorted(tokens, torch.tensor(bounds[:-1])).tolist() for _, tokens, _, _ in live]
    for r, c in enumerate(codes):
        t0, t1 = bounds[r], bounds[r + 1]
        dst = out[t0:t1]
        segs = [(rows[firsts[i][r]:firsts[i][r] + t1 - t0], cl, nz)
                for i, (rows, _, cl, nz) in enumerate(live) if c >> i & 1]
        if not segs:
            dst.zero_()
        elif len(segs) == 1 and segs[0][1]:
            dst.copy_(segs[0][0])
        elif len(segs) == 1:
            torch.add(segs[0][0], 0.0, out=dst)
        else:
            torch.add(segs[0][0], segs[1][0], out=dst)
            if not (segs[0][2] or segs[1][2]):
                dst.add_(0.0)
    return True


def _sum_by_bags(out, sources, scratch, force: bool = False) -> bool:
    """:func:`accumulate_rows` without bias as ``embedding_bag(mode="sum")`` over float32 rows.

    ``scratch`` ``[R, H]`` float32. Tokens go in blocks of ``R // S`` (``S`` sources with rows):
    each source's rows of the block are converted into ``scratch`` (one pass, in cache), then one
    ``embedding_bag`` sums every token's bag (its rows in source order) into float32, which is
    rounded once into ``out``. ``embedding_bag`` adds a bag's rows one after the other to a +0.0
    start, in the order of ``indices``: the reference's float32 chain, signed zeros included, in
    a single pass (FBGEMM's kernel, torch's on x86, keeps each token's sum in registers; the chain
    reads and writes its accumulator once per source). Returns False (nothing written) for fewer
    than two sources with rows unless ``force`` (two sources reach it only when their runs are too
    many for :func:`_sum_two_by_runs`), and when a block would hold fewer than
    ``_BAG_MIN_TOKENS`` tokens (``force``: fewer than one, i.e. more sources than scratch rows):
    per-block call overhead then outweighs the gain (``python -m bench combine-sum --sources
    8,16,32,64`` prints the tokens per block with both times).
    """
    live = [(rows, tokens) for rows, tokens in sources if tokens.numel()]
    m, hidden = out.shape
    if len(live) < (1 if force else 2) or not m:
        return False
    S = len(live)
    B = scratch.size(0) // S  # tokens per block: S * B rows always fit the scratch
    if B < (1 if force else _BAG_MIN_TOKENS):
        return False
    edges = torch.arange(0, m + B, B).clamp_(max=m)
    nb = edges.numel() - 1
    bounds = torch.stack([torch.searchsorted(tokens, edges) for _, tokens in live])  # [S, nb + 1]
    cnt = bounds.diff(dim=1)  # [S, nb] rows of each source in each block
    base = cnt.cumsum(0) - cnt  # [S, nb] where each source's rows start in the block's scratch
    pos, keys = [], []
    for j, (_, tokens) in enumerate(live):
        blk = tokens // B
        pos.append(base[j][blk] + torch.arange(tokens.numel()) - bounds[j][blk])
        keys.append(tokens * S + j)
    sorted_keys, order = torch.sort(torch.cat(keys))  # by token, then source: bags in ascending source order
    indices = torch.cat(pos)[order]
    starts = torch.searchsorted(sorted_keys, torch.arange(m) * S)  # first entry of each token's bag
    first = starts[edges[:-1]].tolist() + [indices.numel()]  # first entry of each block
    offsets = starts - torch.repeat_interleave(starts[edges[:-1]], edges.diff())  # bag offsets within a block
    bl, cl, bs = bounds.tolist(), cnt.tolist(), base.tolist()
    el = edges.tolist()
    for b in range(nb):
        a_t, b_t = el[b], el[b + 1]
        n = 0
        for j, (rows, _) in enumerate(live):
            c = cl[j][b]
            if c:
                scratch[bs[j][b]:bs[j][b] + c].copy_(rows[bl[j][b]:bl[j][b] + c])
                n = bs[j][b] + c
        if not n:
            out[a_t:b_t].zero_()
            continue
        out[a_t:b_t].copy_(torch.nn.functional.embedding_bag(
            indices[first[b]:first[b + 1]], scratch[:n], offsets[a_t:b_t], mode="sum"))
    return True


class CombineScratch:
    """Two float32 ``[block, hidden]`` blocks for :func:`accumulate_rows` (accumulator, converted
    rows), ~2 MiB each so a block stays in cache; kept across calls (fresh memory costs page faults)."""

    def __init__(self, rows: int | None = None):
        self._bufs = None
        self._rows = rows  # block rows; None: ~2 MiB per block (tests pass a few rows to get many blocks)

    @outside_inference_mode
    def get(self, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bufs is None or self._bufs[0].size(1) != hidden:
            block = self._rows or max(32, _COMBINE_BLOCK_BYTES // max(1, 4 * hidden))
            self._bufs = tuple(torch.empty(block, hidden, dtype=torch.float32) for _ in range(2))
        return self._bufs
