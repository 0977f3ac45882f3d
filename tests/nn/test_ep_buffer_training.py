"""Training on an ``EPBuffer`` (DeepEP V2.5): ``deepep_ascend.nn.autograd.ep_dispatch`` / ``ep_combine`` and
``MoE(EPBuffer)`` on the expanded layout.

Autograd pair: integer data (``x``, loss coefficients) and quarter-integer weights keep every bf16 / float32
sum exact, so the forward outputs and the gradients of ``x``, ``topk_weights`` and the biases are compared
**bit for bit** with a dense float64 ``torch.autograd`` model of the same maps, built on one process from
every rank's gathered inputs (received rows ordered by source rank and token; expanded rows grouped by
local expert at aligned starts). Loss: ``Σ recv_x·A + Σ recv_w·B + Σ combined·C + Σ combined_w·D`` through
dispatch → a power-of-two scale per rank → combine, compact layout (with a bias) and expanded layout
(with a bias pair); uniform and skewed routing; with more than one rank the last has no tokens.

MoE layer: ``MoE(EPBuffer)`` against ``MoE(Buffer)`` (same seeds, same inputs) and against a dense
single-process reference written out again here (the gate and experts of ``test_moe_layer.py``; the
combine with the expanded path's roundings: each (token, slot)'s weighted output rounded to bf16, each
rank's slots of a token summed in slot order and rounded, the ranks' rows added in the order of their
last slot and rounded once more). Forward output and gradients of the input, gate, shared expert and
this rank's experts:

* vs ``MoE(Buffer)`` with ``top_k = 1``: **bit for bit** (every sum has one term: the same reduction
  order; the expanded layout at the GEMMs' alignment is the normal path's GEMM layout row for row);
* vs ``MoE(Buffer)`` with ``top_k > 1``: within ``2e-2 · max|expected|`` (the two paths round and order
  the per-token sums differently, docs/semantics/deepep-api.md §13.5 vs §4.6: a bf16 ulp is 0.4-0.8 %);
* vs the dense reference: within ``5e-2`` (BF16 grouped GEMMs) or ``2e-2`` (float32 loop) of
  ``max|expected|``, the tolerances of ``test_moe_layer.py`` (float32 GEMMs sum in another order).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer, EPBuffer
from deepep_ascend.nn import autograd as ag
from deepep_ascend.nn.moe import MoE
from tests.nn.test_moe_layer import _close, ref_expert, ref_gate
from tests.support.buffer_helpers import BF16, Checker, all_ranks_ok, coll, make_topk_idx
from tests.support.mpi_utils import gather_all, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

E, K, H, I, MAX_TOKENS = 16, 3, 32, 24, 24  # ranks send up to 9 + 2r tokens (23 at 8 ranks)
ALIGN = 4  # expert_alignment of the autograd test's expanded layout


@pytest.fixture(scope="module")
def ep():
    buf = coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=MAX_TOKENS, hidden=H, num_topk=K,
                                explicitly_destroy=True), what="EPBuffer()")
    yield buf
    coll(buf.destroy, what="destroy EPBuffer")


@pytest.fixture(scope="module")
def v1(buffers):
    return buffers(Buffer.get_normal_buffer_size_hint(MAX_TOKENS, H, world().Get_size(), K, E))


def _ints(shape, lo, hi, gen, dtype=torch.float32):
    return torch.randint(lo, hi, shape, generator=gen).to(dtype)


def _received(idxs, s, L, expand):
    """Rank ``s``'s received rows from every rank's ``topk_idx``: ``(src [rows] flat token index into the
    concatenated inputs (-1: gap row), slot [rows] (-1: compact or gap), local [rows, K] bool (compact)``."""
    offs = [0]
    for t in idxs:
        offs.append(offs[-1] + t.size(0))
    if not expand:
        src, local = [], []
        for o, t in enumerate(idxs):
            mine = (t >= s * L) & (t < (s + 1) * L)
            rows = torch.nonzero(mine.any(1)).squeeze(1)
            src.append(rows + offs[o])
            local.append(mine[rows])
        return torch.cat(src), None, torch.cat(local)
    src, slot = [], []
    for e in range(L):
        pairs = [(offs[o] + t, j) for o, ti in enumerate(idxs) for t, j in (ti == s * L + e).nonzero().tolist()]
        pad = -len(pairs) % ALIGN
        src += [p[0] for p in pairs] + [-1] * pad
        slot += [p[1] for p in pairs] + [-1] * pad
    return torch.tensor(src, dtype=torch.int64), torch.tensor(slot, dtype=torch.int64), None


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_ep_dispatch_combine_grads_exact(ep, comm, routing):
    """ep_dispatch → scale → ep_combine, compact (bias) and expanded (bias pair, zero padding) layouts:
    forward outputs and gradients of x, topk_weights and the biases equal the float64 model bit for bit;
    a rank with no tokens gets zero-size gradients, never None."""
    r, R = comm.Get_rank(), comm.Get_size()
    L = E // R
    n = 0 if (R > 1 and r == R - 1) else 9 + 2 * r
    chk = Checker(r)
    for expand in (False, True):
        gen = torch.Generator().manual_seed(31 + r + 7 * expand)
        idx = make_topk_idx(routing, n, E, K, r, R, gen)
        x0 = _ints((n, H), -4, 5, gen, BF16)
        w0 = _ints((n, K), 1, 8, gen) / 4
        b0 = [_ints((n, H), -2, 3, gen, BF16) for _ in range(2 if expand else 1)]
        C = _ints((n, H), -3, 4, gen)
        D = _ints((n, K), -3, 4, gen) / 4
        scale = 2.0 ** (r % 3 - 1)
        kw = dict(num_experts=E, do_expand=True, expert_alignment=ALIGN, do_zero_padding=True) if expand \
            else dict(num_experts=E)

        def run():
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            bias = [b.clone().requires_grad_(True) for b in b0]
            recv_x, recv_idx, recv_w, handle = ag.ep_dispatch(ep, x, idx, w, **kw)
            g2 = torch.Generator().manual_seed(5 + r)
            A = _ints(recv_x.shape, -3, 4, g2)
            B = _ints(recv_w.shape, -3, 4, g2) / 4
            y = (recv_x.float() * scale).to(BF16)
            combined, combined_w = ag.ep_combine(ep, y, handle, topk_weights=recv_w,
                                                 bias=tuple(bias) if expand else bias[0])
            loss = ((recv_x.float() * A).sum() + (recv_w * B).sum() + (combined.float() * C).sum()
                    + (combined_w * D).sum())
            loss.backward()
            return x, w, bias, recv_x.detach(), recv_idx, recv_w.detach(), combined.detach(), combined_w.detach(), A, B

        x, w, bias, recv_x, recv_idx, recv_w, combined, combined_w, A, B = coll(run, what=f"round trip {expand=}")
        # The float64 model from every rank's inputs.
        idxs = gather_all(idx)
        X = torch.cat(gather_all(x0)).double().requires_grad_(True)
        W = torch.cat(gather_all(w0)).double().requires_grad_(True)
        Bi = [torch.cat(gather_all(b)).double().requires_grad_(True) for b in b0]
        As, Bs, Cs, Ds = gather_all(A), gather_all(B), torch.cat(gather_all(C)), torch.cat(gather_all(D))
        idx_all = torch.cat(idxs)
        Wflat = W.reshape(-1)
        loss = 0.0
        combined_ref = sum(Bi)
        for s in range(R):
            src, slot, local = _received(idxs, s, L, expand)
            scale_s = 2.0 ** (s % 3 - 1)
            real = src >= 0
            rows = torch.zeros(src.numel(), H, dtype=torch.float64).index_copy(
                0, torch.nonzero(real).squeeze(1), X[src[real]])
            if expand:
                wr = torch.zeros(src.numel(), dtype=torch.float64).index_copy(
                    0, torch.nonzero(real).squeeze(1), Wflat[src[real] * K + slot[real]])
                # every slot row of a token returns its scaled row
                combined_ref = combined_ref.index_add(0, src[real], rows[real] * scale_s)
            else:
                wr = torch.where(local, W[src], 0.0)
                combined_ref = combined_ref.index_add(0, src, rows * scale_s)
            if s == r:
                chk.same_bits(recv_x, rows.detach().to(BF16), f"recv_x ({expand=})")
                chk.same_bits(recv_w, wr.detach().float(), f"recv_topk_weights ({expand=})")
                if not expand:
                    chk.same_bits(recv_idx, torch.where(local, idx_all[src] - s * L, -1), "recv_topk_idx")
            loss = loss + (rows * As[s].double()).sum() + (wr * Bs[s].double()).sum()
        combined_w_ref = torch.where(idx_all >= 0, W, 0.0)
        loss = loss + (combined_ref * Cs.double()).sum() + (combined_w_ref * Ds.double()).sum()
        loss.backward()
        mine = slice(sum(t.size(0) for t in idxs[:r]), sum(t.size(0) for t in idxs[:r + 1]))
        chk.same_bits(combined, combined_ref[mine].detach().to(BF16), f"combined_x ({expand=})")
        chk.same_bits(combined_w, combined_w_ref[mine].detach().float(), f"combined_topk_weights ({expand=})")
        chk.same_bits(x.grad, X.grad[mine].to(BF16), f"x.grad ({expand=})")
        chk.same_bits(w.grad, W.grad[mine].float(), f"topk_weights.grad ({expand=})")
        for i, (b, ref) in enumerate(zip(bias, Bi)):
            chk.same_bits(b.grad, ref.grad[mine].to(BF16), f"bias[{i}].grad ({expand=})")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:8]))


def test_ep_autograd_refusals(ep, comm):
    """Refusals before data moves: non-bf16 x, asynchronous keywords, a bias that is not a pair."""
    x = torch.zeros(2, H)
    with pytest.raises(TypeError, match="bfloat16"):
        ag.ep_dispatch(ep, x, torch.zeros(2, K, dtype=torch.int64), None, num_experts=E)
    with pytest.raises(TypeError, match="async_with_compute_stream"):
        ag.ep_dispatch(ep, x.bfloat16(), torch.zeros(2, K, dtype=torch.int64), None, num_experts=E,
                       async_with_compute_stream=True)
    with pytest.raises(TypeError, match="defer_epilogue"):
        ag.ep_combine(ep, x.bfloat16(), None, defer_epilogue=True)
    with pytest.raises(ValueError, match="pair"):
        ag.ep_combine(ep, x.bfloat16(), None, bias=(None, None, None))


def test_one_rank_refusal_raises_on_every_rank(ep, v1, comm):
    """A wrapper's own check failing on rank 0 only (float32 x, a cached dispatch with top-k, topk_idx out of
    range for the layout, a refused keyword, a bias that is not a pair): rank 0 raises its own error, every
    other rank a ConsensusError naming rank 0 (no wait), and both buffers then give the same results as before."""
    from deepep_ascend import ConsensusError

    r = comm.Get_rank()
    bad = r == 0
    gen = torch.Generator().manual_seed(70 + r)
    n = 4
    x = _ints((n, H), -3, 4, gen).to(BF16)
    idx = torch.randint(0, E, (n, K), generator=gen)
    w = torch.rand(n, K, generator=gen)

    def good_round():
        recv, _, _, _, h1 = ag.dispatch(v1, x, idx, w, E)
        out1, _ = ag.combine(v1, recv, h1)
        erecv, _, _, h2 = ag.ep_dispatch(ep, x, idx, w, num_experts=E)
        out2, _ = ag.ep_combine(ep, erecv, h2)
        return recv, h1, out1, erecv, h2, out2

    recv, h1, out1, erecv, h2, out2 = good_round()
    cases = [  # (name, call, this rank's error type on rank 0, its message)
        ("dispatch f32", lambda: ag.dispatch(v1, x.float() if bad else x, idx, w, E), TypeError, "bfloat16"),
        ("dispatch topk_idx", lambda: ag.dispatch(v1, x, idx + E if bad else idx, w, E), ValueError, "topk_idx"),
        ("cached dispatch with top-k", lambda: ag.dispatch(v1, x, idx if bad else None, None, None, handle=h1),
         ValueError, "cached"),
        ("combine f32", lambda: ag.combine(v1, recv.float() if bad else recv, h1), TypeError, "bfloat16"),
        ("ep_dispatch f32", lambda: ag.ep_dispatch(ep, x.float() if bad else x, idx, w, num_experts=E),
         TypeError, "bfloat16"),
        ("ep_dispatch keyword", lambda: ag.ep_dispatch(ep, x, idx, w, num_experts=E,
                                                       **({"defer_epilogue": True} if bad else {})),
         TypeError, "defer_epilogue"),
        ("ep_combine f32", lambda: ag.ep_combine(ep, erecv.float() if bad else erecv, h2), TypeError, "bfloat16"),
        ("ep_combine bias", lambda: ag.ep_combine(ep, erecv, h2, bias=(x, x, x) if bad else None),
         ValueError, "pair"),
    ]
    problems = []
    for name, call, exc_type, match in cases:
        try:
            call()
            problems.append(f"{name}: no error")
        except Exception as exc:  # noqa: BLE001 - the type is the assertion
            if bad and not (type(exc) is exc_type and match in str(exc)):
                problems.append(f"{name}: rank 0 raised {type(exc).__name__}: {exc}")
            if not bad and not (isinstance(exc, ConsensusError) and "rank 0" in str(exc) and match in str(exc)):
                problems.append(f"{name}: raised {type(exc).__name__}: {exc}")
    again = good_round()
    for label, before, after in (("v1 combine", out1, again[2]), ("ep combine", out2, again[5]),
                                 ("v1 dispatch", recv, again[0]), ("ep dispatch", erecv, again[3])):
        if not torch.equal(before, after):
            problems.append(f"{label} after the refusals differs from before")
    all_ranks_ok(comm, not problems, f"rank {r}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# MoE(EPBuffer)

MOE_CASES = {  # top_k = 1: one term per sum, bitwise against MoE(Buffer)
    "top1_grouped": dict(score_func="softmax", top_k=1, impl="grouped"),
    "top2_loop": dict(score_func="softmax", top_k=2, impl="loop"),
    "top3_sigmoid_groups_grouped": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, skew=True, impl="grouped"),
}


def ref_moe_expanded(h, gate_w, W1, W3, W2, shared, cfg, num_ranks, bias):
    """Dense MoE output for one origin rank's tokens ``h [N, H]`` with the expanded path's roundings."""
    L = E // num_ranks
    idx, w = ref_gate(h, gate_w, cfg["score_func"], cfg["top_k"], cfg.get("n_group", 1), cfg.get("topk_group", 1),
                      cfg.get("routed_scaling_factor", 1.0), bias)
    hb = h.to(BF16)
    n, k = idx.shape
    slot_rows = []  # [N, H] per slot: bf16(w · expert(x))
    for j in range(k):
        yj = torch.zeros_like(h)
        for e in range(E):
            rows = (idx[:, j] == e).nonzero().flatten()
            if rows.numel():
                y = ref_expert(hb[rows].float(), W1[e], W3[e], W2[e], cfg["impl"] == "grouped")
                yj = yj.index_add(0, rows, y * w[rows, j:j + 1])
        slot_rows.append(yj.to(BF16).float())
    rank = torch.div(idx, L, rounding_mode="floor")
    parts = []  # per rank: its slots of each token in slot order, rounded
    for s in range(num_ranks):
        acc = torch.zeros_like(h)
        for j in range(k):
            acc = acc + torch.where((rank[:, j] == s)[:, None], slot_rows[j], 0.0)
        parts.append(acc.to(BF16).float())
    parts = torch.stack(parts)
    out = torch.zeros_like(h)
    for j in range(k):  # each rank's row at its last slot
        last = ~(rank[:, j + 1:] == rank[:, j:j + 1]).any(1)
        out = out + torch.where(last[:, None], parts[rank[:, j], torch.arange(n)], 0.0)
    out = out.to(BF16).float()
    s1, s3, s2 = shared
    return out + torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(h, s1))
                                            * torch.nn.functional.linear(h, s3), s2)


def _layer(buf, cfg, skew):
    torch.manual_seed(1234)  # gate and shared expert identical on every rank and for both buffers
    return MoE(buf, H, I, E, cfg["top_k"], num_shared_experts=1, seed=7, experts_impl=cfg["impl"],
               score_func=cfg["score_func"], n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
               routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0), use_selection_bias=skew)


def _grads(layer):
    sh, ex = layer.shared_experts, layer.experts
    return {"gate.weight": layer.gate.weight.grad, "shared.w1": sh.w1.weight.grad, "shared.w3": sh.w3.weight.grad,
            "shared.w2": sh.w2.weight.grad, "experts.w1": ex.w1.grad, "experts.w3": ex.w3.grad,
            "experts.w2": ex.w2.grad}


def test_moe_on_ep_buffer_matches_buffer_and_reference(ep, v1, comm):
    """MoE(EPBuffer) (mode 'expanded') against MoE(Buffer) and the dense reference, every case of MOE_CASES
    (see the module docstring for which comparisons are bitwise); the skewed case sends nothing to the
    last rank's experts and gives that rank no tokens (its expert gradients: zeros, not None)."""
    r, R = comm.Get_rank(), comm.Get_size()
    L = E // R
    chk = Checker(r)
    for case, cfg in MOE_CASES.items():
        skew = cfg.get("skew", False) and R > 1
        n = 0 if (skew and r == R - 1) else 10 + r
        gen = torch.Generator().manual_seed(99 + r)
        x0, G = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
        got = {}
        for name, buf in (("ep", ep), ("v1", v1)):
            layer = _layer(buf, cfg, skew)
            if skew:
                layer.gate.e_score_correction_bias[-L:] = -1e3
            chk.check(layer.mode == ("expanded" if name == "ep" else "normal"), f"{case}: mode {layer.mode!r}")

            def run(layer=layer):
                x = x0.clone().requires_grad_(True)
                out = layer(x)
                (out * G).sum().backward()
                return x, out

            x, out = coll(run, what=f"MoE({name}) {case}")
            got[name] = (layer, {"forward": out.detach(), "x.grad": x.grad, **_grads(layer)})
        layer, mine = got["ep"]
        for what, value in got["v1"][1].items():
            if cfg["top_k"] == 1:
                chk.same_bits(mine[what], value, f"{case}: {what} vs MoE(Buffer)")
            else:
                _close(chk, mine[what], value, f"{case}: {what} vs MoE(Buffer)", 2e-2)
        if skew and r == R - 1:
            chk.check(all(not mine[f"experts.{w}"].any() for w in ("w1", "w3", "w2")), f"{case}: expert grads not 0")
        # the dense reference
        W = [torch.cat(gather_all(getattr(layer.experts, w).detach())).requires_grad_(True) for w in ("w1", "w3", "w2")]
        gate_w = layer.gate.weight.detach().clone().requires_grad_(True)
        sh = layer.shared_experts
        shared = [p.detach().clone().requires_grad_(True) for p in (sh.w1.weight, sh.w3.weight, sh.w2.weight)]
        xr = [t.clone().requires_grad_(True) for t in gather_all(x0)]
        outs = [ref_moe_expanded(xr[o], gate_w, *W, shared, cfg, R, layer.gate.e_score_correction_bias)
                for o in range(R)]
        sum((o * g).sum() for o, g in zip(outs, gather_all(G))).backward()
        tol = 5e-2 if cfg["impl"] == "grouped" else 2e-2
        _close(chk, mine["forward"], outs[r].detach(), f"{case}: forward vs reference", tol)
        _close(chk, mine["x.grad"], xr[r].grad, f"{case}: x.grad vs reference", tol)
        dense = {"gate.weight": gate_w, "shared.w1": shared[0], "shared.w3": shared[1], "shared.w2": shared[2]}
        for what, ref in dense.items():  # replicated: the data-parallel sum over ranks
            _close(chk, torch.stack(gather_all(mine[what])).sum(0), ref.grad, f"{case}: {what} vs reference", tol)
        for w, ref in zip(("w1", "w3", "w2"), W):
            _close(chk, mine[f"experts.{w}"], ref.grad[r * L:(r + 1) * L], f"{case}: experts.{w} vs reference", tol)
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:8]))


def test_moe_mode_follows_the_buffer(ep, v1):
    """Local: an EPBuffer layer runs 'expanded' only; a Buffer layer refuses 'expanded'; the grouped experts
    refuse an expanded layout at another alignment than the GEMMs'."""
    cfg = MOE_CASES["top1_grouped"]
    with pytest.raises(ValueError, match="needs a deepep_ascend.Buffer"):
        MoE(ep, H, I, E, 1, mode="normal")
    with pytest.raises(ValueError, match="needs a deepep_ascend.EPBuffer"):
        MoE(v1, H, I, E, 1, mode="expanded")
    layer = _layer(ep, cfg, False)
    with pytest.raises(ValueError, match="needs a deepep_ascend.Buffer"):
        layer.mode = "low_latency"
    with pytest.raises(ValueError, match="expert_alignment=4 must equal"):
        layer.experts.forward_expanded(torch.zeros(8, H, dtype=BF16), torch.zeros(8),
                                       torch.zeros(layer.num_local_experts, dtype=torch.int32), 4)
