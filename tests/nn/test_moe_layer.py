"""``deepep_ascend.nn.moe.MoE`` over expert parallelism against a single-process dense reference.

Every rank gathers all ranks' inputs, the full set of expert weights and the loss weights, and
computes the same MoE in plain torch — gate written out again here, every expert applied to the
tokens routed to it, no Buffer — with bf16 roundings where the EP layer has them (normal path:
the dispatched input, each receiving rank's weighted partial, the combined output; low-latency
path: the dispatched input, each slot's expert output, the combined output). The forward output
and the gradients of the input, the gate weight, the shared expert and this rank's experts must
match within ``rtol = atol_rel = 2e-2`` (float32 experts) or ``5e-2`` (BF16 grouped GEMMs), where
``atol = atol_rel · max|expected|``: bf16 has 8 significant bits, and a different float32
summation order may flip a rounding by one bf16 ulp (0.4-0.8 %) here and there. Dense
parameters are replicated, so their per-rank gradients are summed over ranks before the
comparison (what the data-parallel all-reduce does). Routing cases: softmax without groups;
sigmoid with group-limited routing, routed scaling and a selection bias that sends no token to
the last rank's experts, whose rank also has no tokens of its own (their gradients must be
exact zeros, not ``None``). Each case runs on the normal path (``dispatch``/``combine``) and on
the low-latency path (``low_latency_dispatch``/``low_latency_combine``, experts on the packed
layout: masked grouped GEMM or per-expert loop).

Local float64 checks (end of file): ``torch.autograd.gradcheck`` of the gate (softmax; sigmoid
with group-limited routing, scaling and a selection bias) and of the float64 per-expert SwiGLU on
both layouts; the BF16 grouped GEMMs' autograd (contiguous and masked) equal float64 autograd
exactly on integer-valued data. The communication ops' gradients are checked in
``test_autograd.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F

from deepep_ascend import Buffer
from deepep_ascend.nn import moe as moe_mod
from deepep_ascend.nn.moe import MoE
from tests.support import REPO_ROOT
from tests.support.buffer_helpers import (
    BF16,
    Checker,
    all_ranks_ok,
    capture,
    coll,
)
from tests.support.mpi_utils import gather_all, only_sizes, up_to_four_ranks, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

E, H, I, MAX_TOKENS = 16, 32, 24, 16
LL_M = 24  # num_max_dispatch_tokens_per_rank of the low-latency layer (ranks send 10 + r <= 17 tokens)
MODES = ["normal", "low_latency"]
CASES = {
    "softmax": dict(score_func="softmax", top_k=2, impl="loop"),
    "sigmoid_groups": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           skew=True, impl="loop"),
    "sigmoid_groups_grouped_gemm": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, skew=True, impl="grouped"),
    "top1_last_rank_empty": dict(score_func="softmax", top_k=1, impl="loop", empty_last=True),
}


@pytest.fixture(scope="module")
def buf(buffers):
    return buffers(Buffer.get_normal_buffer_size_hint(MAX_TOKENS, H, world().Get_size(), 3, E))


@pytest.fixture(scope="module")
def ll_buf(buffers):
    return buffers.low_latency(LL_M, H, E)


def make_layer(buf, ll_buf, mode, cfg, skew=False, **kw):
    """The layer under test on ``mode``'s Buffer (gate and shared expert from torch's RNG, seed 1234)."""
    torch.manual_seed(1234)  # gate and shared expert identical on every rank
    ll = mode == "low_latency"
    return MoE(ll_buf if ll else buf, H, I, E, cfg["top_k"], num_shared_experts=1, seed=7, experts_impl=cfg["impl"],
               mode=mode, num_max_dispatch_tokens_per_rank=LL_M if ll else None, score_func=cfg["score_func"],
               n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
               routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0), use_selection_bias=skew, **kw)


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


def ref_moe(h, gate_w, W1, W3, W2, shared, cfg, num_ranks, bias, mode="normal"):
    """Dense MoE output for one origin rank's tokens ``h [N, H]`` (float32, differentiable).

    Roundings: ``normal`` rounds each receiving rank's weighted partial to bf16 and sums them in
    rank order; ``low_latency`` rounds each slot's expert output to bf16 and sums ``y · w`` in
    top-k order. Both round the input before and the total after."""
    L = E // num_ranks
    idx, w = ref_gate(h, gate_w, cfg["score_func"], cfg["top_k"], cfg.get("n_group", 1), cfg.get("topk_group", 1),
                      cfg.get("routed_scaling_factor", 1.0), bias)
    hb = h.to(BF16)
    ll = mode == "low_latency"
    total = torch.zeros_like(h)
    for s in range(1 if ll else num_ranks):
        part = torch.zeros_like(h)
        for k in range(idx.size(1)):
            for e in range(E) if ll else range(s * L, (s + 1) * L):
                rows = (idx[:, k] == e).nonzero().flatten()
                if rows.numel():
                    y = ref_expert(hb[rows].float(), W1[e], W3[e], W2[e], cfg["impl"] == "grouped")
                    y = y.to(BF16).float() if ll else y
                    part = part.index_add(0, rows, y * w[rows, k:k + 1])
        total = total + (part if ll else part.to(BF16).float())
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_dense_reference(buf, ll_buf, comm, case, mode):
    cfg = CASES[case]
    r, R = comm.Get_rank(), comm.Get_size()
    L = E // R
    skew = cfg.get("skew", False) and R > 1
    layer = make_layer(buf, ll_buf, mode, cfg, skew)
    chk = Checker(r)
    chk.check(layer.mode == mode, f"layer.mode {layer.mode!r}")
    if skew:  # nobody picks the last rank's experts
        layer.gate.e_score_correction_bias[-L:] = -1e3
    n = 0 if ((skew or cfg.get("empty_last")) and r == R - 1 and R > 1) else 10 + r
    gen = torch.Generator().manual_seed(99 + r)
    x0 = torch.randn(n, H, generator=gen)
    G = torch.randn(n, H, generator=gen)

    def run():
        x = x0.clone().requires_grad_(True)
        out = layer(x)
        (out * G).sum().backward()
        return x, out

    x, out = coll(run, what="MoE forward/backward")
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
    outs = [ref_moe(xr[o], gate_w, W1, W3, W2, shared, cfg, R, bias, mode) for o in range(R)]
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


@pytest.mark.parametrize("mode", MODES)
def test_moe_layer_under_inference_mode(buf, ll_buf, comm, mode):
    """The serving context: a forward under ``torch.inference_mode()`` on inputs made there gives the bits of the
    same forward under ``no_grad``, and a training step outside it still works afterwards."""
    r = comm.Get_rank()
    layer = make_layer(buf, ll_buf, mode, CASES["softmax"])
    x0 = torch.randn(10 + r, H, generator=torch.Generator().manual_seed(5 + r))
    with torch.no_grad():
        want = coll(lambda: layer(x0), what="no_grad forward")
    with torch.inference_mode():
        x = x0.clone()
        got, exc = capture(lambda: layer(x))
    errors = [f"inference_mode forward: {exc!r}"] if exc is not None else []
    if exc is None and not torch.equal(got, want):
        errors.append("inference_mode forward differs from the no_grad one")
    _, exc = capture(lambda: layer(x0.clone().requires_grad_(True)).sum().backward())
    if exc is not None:
        errors.append(f"training step afterwards: {exc!r}")
    all_ranks_ok(comm, not errors, f"rank {r}: " + "; ".join(errors))


@pytest.mark.parametrize("mode", MODES)
def test_moe_layer_takes_bf16_inputs_on_float32_weights(buf, ll_buf, comm, mode):
    """bf16 ``x`` on a float32 layer with a shared expert: the output (and ``x.grad``) come in ``x``'s dtype and
    match the same forward on ``x`` converted to float32 (exactly: bf16 -> float32 is exact), up to bf16
    rounding."""
    r = comm.Get_rank()
    layer = make_layer(buf, ll_buf, mode, CASES["softmax"])
    x0 = torch.randn(10 + r, H, generator=torch.Generator().manual_seed(8 + r)).to(BF16)
    x = x0.clone().requires_grad_(True)
    got, exc = capture(lambda: layer(x))
    if exc is None:
        _, exc = capture(lambda: got.float().sum().backward())
    want = coll(lambda: layer(x0.float()).detach(), what="float32 forward")
    errors = [f"bf16 forward/backward: {exc!r}"] if exc is not None else []
    if exc is None:
        if got.dtype != BF16 or x.grad is None or x.grad.dtype != BF16:
            errors.append(f"dtypes: out {got.dtype}, x.grad {getattr(x.grad, 'dtype', None)}")
        elif not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2):
            errors.append(f"bf16 forward differs from the float32 one by {(got.float() - want).abs().max():.3g}")
    all_ranks_ok(comm, not errors, f"rank {r}: " + "; ".join(errors))


@pytest.mark.parametrize("mode", MODES)
def test_moe_layer_refuses_bad_x_on_every_rank_and_copies(buf, ll_buf, comm, mode):
    """An ``x`` whose last dimension is not ``hidden`` (or not floating) on one rank: that rank raises naming ``x``,
    its peers a ``ConsensusError`` naming it, at once (not at the deadline), and
    the layer works afterwards. ``copy.deepcopy`` of the layer shares its Buffer and computes the same output; the
    gate's logits stay float32 under autocast."""
    import copy

    from deepep_ascend import ConsensusError
    r, R = comm.Get_rank(), comm.Get_size()
    layer = make_layer(buf, ll_buf, mode, CASES["softmax"])
    bad = torch.randn(4, 2 * H) if r == R - 1 else torch.randn(4, H)
    _, exc = capture(lambda: layer(bad))
    if r == R - 1:
        ok = isinstance(exc, ValueError) and f"hidden={H}" in str(exc)
    else:
        ok = isinstance(exc, ConsensusError) and f"rank {R - 1}" in str(exc)
    _, exc = capture(lambda: layer(torch.ones(4, H, dtype=torch.int64)))  # every rank
    ok &= isinstance(exc, TypeError) and "floating" in str(exc)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(r))
    with torch.no_grad():
        want = coll(lambda: layer(x), what="forward after the refusals")
        twin = copy.deepcopy(layer)
        ok &= twin.buffer is layer.buffer and twin.gate.weight is not layer.gate.weight
        ok &= torch.equal(coll(lambda: twin(x), what="the copy's forward"), want)
        with torch.autocast("cpu", dtype=BF16):
            idx, w = layer.gate(x)
        ok &= w.dtype == torch.float32 and torch.equal(idx, layer.gate(x)[0])
    all_ranks_ok(comm, ok, f"rank {r}: bad x refused everywhere, deepcopy, autocast gate")


def test_low_latency_layer_refusals_and_too_many_tokens(buf, ll_buf, comm):
    """Constructor checks (local); a batch above num_max_dispatch_tokens_per_rank on the last rank fails the
    forward on every rank, with a ValueError naming the limit there, and the layer works afterwards."""
    r, R = comm.Get_rank(), comm.Get_size()
    cfg = CASES["softmax"]
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        make_layer(buf, buf, "low_latency", cfg)  # a normal-mode Buffer
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        MoE(ll_buf, H, I, E, 2)  # mode inferred from the Buffer, M missing
    with pytest.raises(ValueError, match="MoE.get_low_latency_rdma_size_hint"):
        MoE(ll_buf, H, I, E, 2, num_max_dispatch_tokens_per_rank=2 * LL_M)  # window sized for LL_M
    with pytest.raises(ValueError, match="mode must be"):
        make_layer(buf, ll_buf, "fast", cfg)
    layer = make_layer(buf, ll_buf, "low_latency", cfg)
    n = LL_M + 1 if r == R - 1 else 3
    _, exc = capture(lambda: layer(torch.randn(n, H)))
    chk = Checker(r)
    chk.check(exc is not None, "a forward with too many tokens on one rank must fail on every rank")
    if r == R - 1:
        chk.check(isinstance(exc, ValueError) and f"{LL_M + 1} tokens" in str(exc)
                  and f"num_max_dispatch_tokens_per_rank={LL_M}" in str(exc), f"error on the rank at fault: {exc!r}")
    else:  # the Buffer's consensus error names the rank at fault and its reason
        chk.check(f"rank {R - 1}" in str(exc) and f"num_max_dispatch_tokens_per_rank={LL_M}" in str(exc),
                  f"error on a peer: {exc!r}")
    out = coll(lambda: layer(torch.randn(LL_M, H)), what="LL forward after the refusal")
    chk.check(out.shape == (LL_M, H) and bool(out.isfinite().all()), "forward after the refusal")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:6]))


# ----------------------------------------------------------------------------------------------
# training: a few steps on synthetic text, checkpoint round trip, routing trace (scripts/train_moe.py)


def _train_module():
    path = os.path.join(REPO_ROOT, "scripts", "train_moe.py")
    spec = importlib.util.spec_from_file_location("train_moe_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", MODES)
@up_to_four_ranks()
def test_training_smoke_checkpoint_and_trace(comm, mode):
    """scripts/train_moe.py for 6 tiny steps on synthetic text (``--moe-mode``: normal or low-latency
    dispatch/combine): the loss falls; a run resumed from the step-3 checkpoint reproduces steps 4-6 bit
    for bit; the routing trace loads with bench's loader."""
    from bench.routing import load_routing

    tm = _train_module()
    r, R = comm.Get_rank(), comm.Get_size()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="train_moe_test_") if r == 0 else None, root=0)
    base = ["--text", "synthetic", "--steps", "6", "--batch", "2", "--seq", "32", "--d-model", "32", "--layers", "2",
            "--heads", "2", "--experts", str(2 * R), "--topk", "2", "--expert-dim", "32", "--lr", "1e-2",
            "--warmup", "1", "--no-progress", "--log-every", "0", "--moe-mode", mode]
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
              and tuple(idx.shape) == (64, 2),  # steps 0,2,4,5 x 2 layers
              f"trace meta {meta}, shape {tuple(idx.shape)}")
    comm.Barrier()  # every rank has read the trace
    if r == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:6]))


def test_training_script_usage_errors():
    """scripts/train_moe.py refuses model options the gate or the attention cannot take, and checkpoint options that
    would do nothing, as usage errors (exit 2) before any rank builds anything, not tracebacks and MPI_Abort."""
    tm = _train_module()
    base = ["--experts", "8", "--d-model", "32", "--heads", "2"]
    for bad in (["--topk", "9"], ["--topk", "0"], ["--n-group", "3"], ["--n-group", "2", "--topk-group", "1",
                "--topk", "5"], ["--heads", "3"], ["--save-every", "2"], ["--steps", "3", "--stop-at", "5"],
                ["--ep", "0"]):
        with pytest.raises(SystemExit) as ei:
            tm.parse_args(base + bad)
        assert ei.value.code == 2, bad
    assert tm.parse_args(base + ["--n-group", "2", "--topk-group", "1", "--topk", "4"]).topk == 4


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


# ----------------------------------------------------------------------------------------------
# float64 gradient checks of the layer's local parts (the communication ops: test_autograd.py).
# Local and independent of the rank count: run in the 1-rank job only.

local_only = only_sizes(1, reason="local float64 checks: run in the 1-rank job only")

GATE_CASES = {
    "softmax": dict(score_func="softmax", top_k=2),
    "sigmoid_groups": dict(score_func="sigmoid", top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           use_selection_bias=True),
}


@local_only
@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gate_gradcheck_float64(case):
    """MoEGate's top-k weights, float64, against finite differences w.r.t. x and the gate weight (routing
    fixed by the data: no score lies within the finite-difference step of a tie)."""
    gate = moe_mod.MoEGate(8, E, **GATE_CASES[case]).double()
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E, dtype=torch.float64))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = gate.weight.detach().clone().requires_grad_(True)

    def weights(x, w):
        _, tw = torch.func.functional_call(gate, {"weight": w}, (x,))
        assert tw.dtype == torch.float64
        return tw

    assert torch.autograd.gradcheck(weights, (x, w), eps=1e-6, atol=1e-7)


class _Packed(torch.nn.Module):
    """``forward`` = ``LocalExperts.forward_packed`` (so ``functional_call`` can swap its weights)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, recv_count):
        return self.experts.forward_packed(x, recv_count)


@local_only
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
def test_local_experts_gradcheck_float64(layout):
    """The per-expert SwiGLU loop in float64 against finite differences w.r.t. its input rows, the top-k
    weights (contiguous layout) and w1/w3/w2, on normal dispatch's layout (rows with local ids / -1) and on
    low-latency dispatch's packed layout (recv_count valid rows per expert, one expert without rows)."""
    L, h, inter = 3, 4, 3
    module = _Packed(moe_mod.LocalExperts(L, h, inter, impl="loop").double())
    gen = torch.Generator().manual_seed(11)
    weights = [p.detach().clone().requires_grad_(True) for p in module.experts.parameters()]  # w1, w3, w2
    if layout == "contiguous":
        idx = torch.tensor([[0, 2], [-1, 1], [2, -1], [0, 1], [-1, -1]])
        x = torch.randn(5, h, generator=gen, dtype=torch.float64, requires_grad=True)
        tw = torch.rand(5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
        module, inputs, call = module.experts, (x, tw), lambda x, tw: (x, idx, tw)
    else:
        count = torch.tensor([2, 0, 3], dtype=torch.int32)
        x = torch.randn(L, 4, h, generator=gen, dtype=torch.float64)
        x = x.masked_fill(torch.arange(4).view(1, 4, 1) >= count.view(L, 1, 1), 0).requires_grad_(True)
        inputs, call = (x,), lambda x: (x, count)
    prefix = "experts." if isinstance(module, _Packed) else ""

    def f(*args):
        *data, w1, w3, w2 = args
        params = {prefix + "w1": w1, prefix + "w3": w3, prefix + "w2": w2}
        return torch.func.functional_call(module, params, call(*data))

    assert torch.autograd.gradcheck(f, (*inputs, *weights), eps=1e-6, atol=1e-7)


@local_only
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_grouped_gemm_autograd_equals_float64(layout):
    """The experts' BF16 grouped GEMMs with their hand-written backward (m-grouped contiguous with psum
    ends for the normal path, m-grouped masked for the low-latency path; k-grouped for the weights)
    against float64 autograd, exactly: integer data keep every bf16 operand, product and sum exact.
    Padding rows (between groups, past masked_m) stay 0 and get no gradient."""
    from deepep_ascend.gemm import grouped as gg

    G, K, N, counts = 3, 8, 5, [3, 0, 4]
    gen = torch.Generator().manual_seed(3)
    ints = lambda *shape, lo=-3, hi=4: torch.randint(lo, hi, shape, generator=gen).float()
    w = ints(G, N, K, lo=-2, hi=3).requires_grad_(True)
    if layout == "contiguous":
        align = gg.get_mk_alignment_for_contiguous_layout()
        starts, end = [], 0
        for c in counts:  # psum layout: group g starts at align(end of group g - 1)
            starts.append(-(-end // align) * align)
            end = starts[-1] + c
        rows = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
        group = torch.cat([torch.full((c,), g) for g, c in enumerate(counts)])
        ends = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int32)
        a = torch.zeros(end + 2, K).index_copy(0, rows, ints(len(rows), K))
        fn = lambda a, w: moe_mod._GroupedLinear.apply(a, w, ends)
    else:
        mmax = 6
        masked_m = torch.tensor(counts, dtype=torch.int32)
        valid = torch.arange(mmax).view(1, mmax) < masked_m.view(G, 1)
        group, rows = valid.nonzero(as_tuple=True)
        rows = group * mmax + rows  # flat row index
        a = torch.zeros(G * mmax, K)
        a[rows] = ints(len(rows), K)
        a = a.view(G, mmax, K)
        fn = lambda a, w: moe_mod._MaskedLinear.apply(a, w, masked_m)
    a = a.to(BF16).requires_grad_(True)
    d = fn(a, w)
    grad_d = ints(*d.shape)
    (d.float() * grad_d).sum().backward()
    # float64 reference: each valid row times its group's weight; nothing else.
    a64 = a.detach().double().reshape(-1, K)[rows].requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    d64 = torch.einsum("rk,rnk->rn", a64, w64[group])
    (d64 * grad_d.double().reshape(-1, N)[rows]).sum().backward()
    exp_d = torch.zeros(d.numel() // N, N, dtype=torch.float64).index_copy(0, rows, d64.detach())
    assert torch.equal(d.double().reshape(-1, N), exp_d)
    exp_ga = torch.zeros(a.numel() // K, K, dtype=torch.float64).index_copy(0, rows, a64.grad)
    assert a.grad.dtype == BF16 and torch.equal(a.grad.double().reshape(-1, K), exp_ga)
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad.double(), w64.grad)
    assert not w.grad[1].any()  # the group without rows: zeros, not None
