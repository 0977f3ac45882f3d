"""``deepep_ascend.moe.MoE`` over expert parallelism against a single-process dense reference.

Every rank gathers all ranks' inputs, the full set of expert weights and the loss weights, and
computes the same MoE in plain torch — gate written out again here, every expert applied to the
tokens routed to it, no Buffer — with bf16 roundings where the EP layer has them (the dispatched
input, each receiving rank's weighted partial, the combined output). The forward output and the
gradients of the input, the gate weight, the shared expert and this rank's experts must match
within ``rtol = atol_rel = 2e-2`` (float32 experts) or ``5e-2`` (BF16 grouped GEMMs), where
``atol = atol_rel · max|expected|``: bf16 has 8 significant bits, and a different float32
summation order may flip a rounding by one bf16 ulp (0.4-0.8 %) here and there. Dense
parameters are replicated, so their per-rank gradients are summed over ranks before the
comparison (what the data-parallel all-reduce does). Routing cases: softmax without groups;
sigmoid with group-limited routing, routed scaling and a selection bias that sends no token to
the last rank's experts, whose rank also has no tokens of its own (their gradients must be
exact zeros, not ``None``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from buffer_helpers import BF16, Checker, all_ranks_ok, coll
from mpi_utils import gather_all, world

from deepep_ascend import Buffer
from deepep_ascend.moe import MoE

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

E, H, I, MAX_TOKENS = 16, 32, 24, 16
CASES = {
    "softmax": dict(score_func="softmax", top_k=2, impl="loop"),
    "sigmoid_groups": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           skew=True, impl="loop"),
    "sigmoid_groups_grouped_gemm": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, skew=True, impl="grouped"),
}


@pytest.fixture(scope="module")
def buf():
    comm = world()
    b = coll(lambda: Buffer(comm, Buffer.get_normal_buffer_size_hint(MAX_TOKENS, H, comm.Get_size(), 3, E),
                            explicitly_destroy=True), what="Buffer()")
    yield b
    coll(b.destroy, what="destroy")


def ref_gate(h, weight, score_func, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0, bias=None):
    """DeepSeek MoEGate, written out independently: returns (topk_idx, weights)."""
    logits = h.float() @ weight.t()
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores.detach().clone()
    if bias is not None:
        choice += bias
    if n_group > 1:
        n, per = h.size(0), E // n_group
        g = choice.view(n, n_group, per)
        gs = g.max(-1).values if score_func == "softmax" else g.sort(-1, descending=True).values[..., :2].sum(-1)
        keep = torch.zeros(n, n_group, dtype=torch.bool)
        keep.scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        choice[~keep.repeat_interleave(per, dim=1)] = float("-inf")
    idx = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * routed_scaling_factor


def ref_expert(x, w1, w3, w2, bf16_gemm: bool):
    if bf16_gemm:  # the grouped path: bf16 operands and activation, float32 accumulation
        b = lambda t: t.to(BF16).float()
        h1, h3 = b(b(x) @ b(w1).t()), b(b(x) @ b(w3).t())
        return b(b(F.silu(h1) * h3) @ b(w2).t())
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def ref_moe(h, gate_w, W1, W3, W2, shared, cfg, num_ranks, bias):
    """Dense MoE output for one origin rank's tokens ``h [N, H]`` (float32, differentiable)."""
    L = E // num_ranks
    idx, w = ref_gate(h, gate_w, cfg["score_func"], cfg["top_k"], cfg.get("n_group", 1), cfg.get("topk_group", 1),
                      cfg.get("routed_scaling_factor", 1.0), bias)
    hb = h.to(BF16)
    total = torch.zeros_like(h)
    for s in range(num_ranks):  # each receiving rank's partial, rounded to bf16, summed in rank order
        part = torch.zeros_like(h)
        for k in range(idx.size(1)):
            for e in range(s * L, (s + 1) * L):
                rows = (idx[:, k] == e).nonzero().flatten()
                if rows.numel():
                    y = ref_expert(hb[rows].float(), W1[e], W3[e], W2[e], cfg["impl"] == "grouped")
                    part = part.index_add(0, rows, y * w[rows, k:k + 1])
        total = total + part.to(BF16).float()
    out = total.to(BF16).float()
    if shared is not None:
        s1, s3, s2 = shared
        out = out + F.linear(F.silu(F.linear(h, s1)) * F.linear(h, s3), s2)
    return out


def _close(chk, actual, expected, what, tol):
    if actual is None:
        chk.check(False, f"{what}: gradient is None")
        return
    a, e = actual.float(), expected.float()
    if a.shape != e.shape:
        chk.check(False, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}")
        return
    scale = float(e.abs().max()) if e.numel() else 0.0
    bad = (a - e).abs() > tol * max(scale, 1e-6) + tol * e.abs()  # (torch.testing imports torch._dynamo: slow)
    if bool(bad.any()):
        worst = float(((a - e).abs() / max(scale, 1e-6)).max())
        chk.check(False, f"{what}: {int(bad.sum())}/{bad.numel()} elements off, worst |diff|/max|expected| {worst:.3g}")


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_dense_reference(buf, comm, case):
    cfg = CASES[case]
    r, R = comm.Get_rank(), comm.Get_size()
    L = E // R
    skew = cfg.get("skew", False) and R > 1
    torch.manual_seed(1234)  # gate and shared expert identical on every rank
    layer = MoE(buf, H, I, E, cfg["top_k"], num_shared_experts=1, seed=7, experts_impl=cfg["impl"],
                score_func=cfg["score_func"], n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
                routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0), use_selection_bias=skew)
    if skew:  # nobody picks the last rank's experts
        layer.gate.e_score_correction_bias[-L:] = -1e3
    n = 0 if (skew and r == R - 1) else 10 + r
    gen = torch.Generator().manual_seed(99 + r)
    x0 = torch.randn(n, H, generator=gen)
    G = torch.randn(n, H, generator=gen)

    def run():
        x = x0.clone().requires_grad_(True)
        out = layer(x)
        (out * G).sum().backward()
        return x, out

    x, out = coll(run, what="MoE forward/backward")
    chk = Checker(r)
    tol = 5e-2 if cfg["impl"] == "grouped" else 2e-2
    # The reference, from everything gathered.
    xs, Gs = gather_all(x0), gather_all(G)
    W1 = torch.cat(gather_all(layer.experts.w1.detach())).requires_grad_(True)
    W3 = torch.cat(gather_all(layer.experts.w3.detach())).requires_grad_(True)
    W2 = torch.cat(gather_all(layer.experts.w2.detach())).requires_grad_(True)
    gate_w = layer.gate.weight.detach().clone().requires_grad_(True)
    chk.check(all(torch.equal(t, gate_w) for t in gather_all(gate_w.detach())), "gate weights differ across ranks")
    sh = layer.shared_experts
    shared = [p.detach().clone().requires_grad_(True) for p in (sh.w1.weight, sh.w3.weight, sh.w2.weight)]
    bias = layer.gate.e_score_correction_bias
    xr = [t.clone().requires_grad_(True) for t in xs]
    outs = [ref_moe(xr[o], gate_w, W1, W3, W2, shared, cfg, R, bias) for o in range(R)]
    sum((o * g).sum() for o, g in zip(outs, Gs)).backward()

    _close(chk, out.detach(), outs[r].detach(), "forward output", tol)
    _close(chk, x.grad, xr[r].grad, "x.grad", tol)
    _close(chk, torch.stack(gather_all(layer.gate.weight.grad)).sum(0), gate_w.grad, "gate.weight.grad", tol)
    for mine, ref, name in zip((sh.w1.weight, sh.w3.weight, sh.w2.weight), shared, ("w1", "w3", "w2")):
        _close(chk, torch.stack(gather_all(mine.grad)).sum(0), ref.grad, f"shared_experts.{name}.grad", tol)
    sl = slice(r * L, (r + 1) * L)
    for mine, ref, name in zip((layer.experts.w1, layer.experts.w3, layer.experts.w2), (W1, W3, W2),
                               ("w1", "w3", "w2")):
        _close(chk, mine.grad, ref.grad[sl], f"experts.{name}.grad", tol)
        if skew and r == R - 1:
            chk.check(mine.grad is not None and not mine.grad.any(), f"experts.{name}.grad must be zeros here")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:6]))


# ----------------------------------------------------------------------------------------------
# training: a few steps on synthetic text, checkpoint round trip, routing trace (scripts/train_moe.py)


def _train_module():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "train_moe.py")
    spec = importlib.util.spec_from_file_location("train_moe_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_smoke_checkpoint_and_trace(comm):
    """scripts/train_moe.py for 6 tiny steps on synthetic text: the loss falls; a run resumed from the
    step-3 checkpoint reproduces steps 4-6 bit for bit; the routing trace loads with bench's loader."""
    from bench.common import load_routing

    tm = _train_module()
    r, R = comm.Get_rank(), comm.Get_size()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="train_moe_test_") if r == 0 else None, root=0)
    base = ["--text", "synthetic", "--steps", "6", "--batch", "2", "--seq", "32", "--d-model", "32", "--layers", "2",
            "--heads", "2", "--experts", str(2 * R), "--topk", "2", "--expert-dim", "32", "--lr", "1e-2",
            "--warmup", "1", "--no-progress", "--log-every", "0"]
    trace = os.path.join(tmp, "trace.npz")
    full = coll(tm.run, tm.parse_args(base + ["--save-dir", os.path.join(tmp, "ck"), "--save-every", "3",
                                              "--save-trace", trace, "--trace-every", "2"]), comm,
                what="train 6 steps")
    resumed = coll(tm.run, tm.parse_args(base + ["--resume", os.path.join(tmp, "ck", "step000003")]), comm,
                   what="resume from step 3")
    chk = Checker(r)
    losses = full["losses"]
    chk.check(len(losses) == 6 and resumed["first_step"] == 3 and len(resumed["losses"]) == 3, "step counts")
    chk.check(sum(losses[-2:]) / 2 < losses[0] - 0.3, f"loss did not fall: {losses}")
    chk.check(resumed["losses"] == losses[3:], f"resumed losses {resumed['losses']} != {losses[3:]}")
    chk.check(os.path.exists(os.path.join(tmp, "ck", "step000006", "dense.pt"))
              and os.path.exists(os.path.join(tmp, "ck", "step000003", f"experts_ep{r}.pt")), "checkpoint files")
    comm.Barrier()
    idx, _, meta = load_routing(trace, r, R, step=1)
    chk.check(meta["num_steps"] == 8 and meta["num_topk"] == 2 and meta["num_experts"] == 2 * R
              and tuple(idx.shape) == (64, 2), f"trace meta {meta}, shape {tuple(idx.shape)}")  # steps 0,2,4,5 x 2 layers
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:6]))


def test_stdlib_corpus_loads():
    """The real-text corpus of scripts/train_moe.py: stdlib .py files, no site-packages, bytes of Python."""
    tm = _train_module()
    files = tm.stdlib_files()
    assert files and not any("site-packages" in f for f in files)
    data = tm.load_stdlib_bytes(0.05)
    assert data.dtype == torch.uint8 and data.numel() == 50_000
    text = bytes(data[:20_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    x, y = tm.get_batch(data, 3, 16, seed=0, step=5, rank=1)
    x2, _ = tm.get_batch(data, 3, 16, seed=0, step=5, rank=1)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])
