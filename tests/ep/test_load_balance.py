"""``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads`` (redundant experts, docs/semantics/deepep-api.md §13.9)
against references computed here from the mapping alone: every slot's bytes after a prefetch (unused slots
keep a sentinel), every owner's gradients after a reduction, bit for bit in the documented order (the seed,
then one float32 addition per replica in ascending (node rank, slot) order); a tiny expert with replicas
trained by SGD through both calls equals a single-copy reference; bad input fails on every rank before a
byte moves. On one node, and at 4 and 8 ranks also as two simulated nodes (hybrid and direct mode: each
node is its own domain with its own mapping).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_load_balance.py`` (N = 1, 2, 4, 8).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from deepep_ascend import EPBuffer
from deepep_ascend.ep.allocator import BufferAllocator, get_num_allocation_alignment
from tests.support.buffer_helpers import all_ranks_ok, capture, coll
from tests.support.mpi_utils import world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

SLOTS = 3  # redundant slots per rank
LOCAL = 2  # experts per rank
HIDDEN = 40  # gradient row (float32)
D_OUT, D_IN = 4, 8  # the trained expert: one linear map, a row of 32 float32
SENTINEL = 0xA5
# weights and scales moved together: (dtype, trailing shape of the originals, of the slots), same bytes
PAYLOADS = ((torch.bfloat16, (4, 24), (96,)), (torch.uint8, (32,), (2, 16)), (torch.float32, (2, 3, 4), (24,)))


class Setup:
    """One EPBuffer with an LB plan: weight payloads, gradient rows, and the trained expert's pools."""

    def __init__(self, nodes: int, hybrid: bool):
        R = world().Get_size()
        self.rank = world().Get_rank()
        self.rpn = R // nodes
        self.node, self.local = self.rank // self.rpn, self.rank % self.rpn
        plan = BufferAllocator()
        self.weights = [plan.allocate((SLOTS, *slot), dtype) for dtype, _, slot in PAYLOADS]
        self.grads = plan.allocate((SLOTS, HIDDEN), torch.float32)
        self.train_w = plan.allocate((SLOTS, D_OUT * D_IN), torch.float32)
        self.train_g = plan.allocate((SLOTS, D_OUT * D_IN), torch.float32)
        self.buf = coll(lambda: EPBuffer(world(), num_bytes=get_num_allocation_alignment(),
                                         lb_allocation_plan_or_num_bytes=plan, allow_hybrid_mode=hybrid,
                                         explicitly_destroy=True, ranks_per_node=self.rpn), what="EPBuffer()")
        self.plan = plan

    def destroy(self):
        self.weights = self.grads = self.train_w = self.train_g = self.plan = None
        coll(self.buf.destroy, what="destroy")


CONFIGS = [(1, True), (2, True), (2, False)]  # (nodes, allow_hybrid_mode)


@pytest.fixture(scope="module")
def setups():
    R = world().Get_size()
    built = {cfg: Setup(*cfg) for cfg in CONFIGS if cfg[0] == 1 or R >= 4}
    yield built
    for s in built.values():
        s.destroy()


def mapping(n: int, seed: int, empty: float = 0.25) -> torch.Tensor:
    """A random ``[n, SLOTS]`` mapping of one node: slot ``c`` of node rank ``l`` holds an expert of another node
    rank, or -1; the same on every rank (seeded)."""
    if n == 1:
        return torch.full((1, SLOTS), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, (n - 1) * LOCAL, (n, SLOTS), generator=g)
    table += (table >= torch.arange(n)[:, None] * LOCAL).to(torch.int64) * LOCAL  # skip the row's own block
    table[torch.rand(n, SLOTS, generator=g) < empty] = -1
    return table.to(torch.int32)


def blob(node: int, expert: int, idx: int, nbytes: int, seed: int) -> torch.Tensor:
    """Bytes of payload ``idx`` of a node's expert (random, distinct per key)."""
    g = torch.Generator().manual_seed(((seed * 7 + node) * 97 + expert) * 5 + idx)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def row(key: tuple, n: int) -> torch.Tensor:
    """``n`` random float32 values keyed by ``key`` (the same on every rank: no salted ``hash``)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(n, generator=g)


def _views(s: Setup, reshape: bool) -> list[torch.Tensor]:
    return [w.view(SLOTS, *orig) if reshape else w for w, (_, orig, _) in zip(s.weights, PAYLOADS)]


def test_prefetch_and_reduce_bitwise(setups):
    """Two rounds per configuration (random mappings, 3-D views in the second, ``previous_event`` given):
    prefetch fills each slot with its expert's bytes and leaves unused slots alone; reduction adds each
    replica's row in ascending (node rank, slot) order onto the seed, leaving the replicas' rows unchanged."""
    comm = world()
    problems = []
    for (nodes, hybrid), s in setups.items():
        n = s.rpn
        for rnd in range(2):
            seed = 10 * rnd + nodes + 3 * hybrid
            m = mapping(n, seed + 1000 * s.node)  # each node its own mapping
            # prefetch: originals of this rank's experts, sentinel in every slot
            originals = []
            for i, (dtype, orig, _) in enumerate(PAYLOADS):
                nb = s.weights[i][0].nbytes
                data = torch.stack([blob(s.node, s.local * LOCAL + e, i, nb, seed) for e in range(LOCAL)])
                originals.append(data.view(dtype).view(LOCAL, *orig))
                s.weights[i].view(torch.uint8).fill_(SENTINEL)
            ev = coll(lambda: s.buf.lb_prefetch_weights(_views(s, rnd == 1), originals, m,
                                                        previous_event=s.buf.capture() if rnd else None),
                      what="lb_prefetch_weights")
            assert ev.wait() is None
            for i in range(len(PAYLOADS)):
                got = s.weights[i].view(torch.uint8).view(SLOTS, -1)
                for c in range(SLOTS):
                    e = int(m[s.local, c])
                    exp = (torch.full_like(got[c], SENTINEL) if e < 0
                           else blob(s.node, e, i, got.size(1), seed))
                    if not torch.equal(got[c], exp):
                        problems.append(f"{nodes} node(s) hybrid={hybrid} round {rnd}: payload {i} slot {c} "
                                        f"(expert {e})")
            # reduction: seed rows and replica rows
            seed_rows = torch.stack([row(("seed", seed, s.node, s.local * LOCAL + e), HIDDEN) for e in range(LOCAL)])
            for c in range(SLOTS):
                s.grads[c] = row(("replica", seed, s.node, s.local, c), HIDDEN)
            replicas_before = s.grads.clone()
            expert_grads = seed_rows.clone()
            coll(lambda: s.buf.lb_reduce_grads(s.grads, expert_grads, m, num_sms=4,
                                               previous_event=s.buf.capture() if rnd else None).wait(),
                 what="lb_reduce_grads")
            expected = seed_rows.clone()
            for ln in range(n):
                for c in range(SLOTS):
                    e = int(m[ln, c])
                    if e >= 0 and e // LOCAL == s.local:
                        expected[e % LOCAL] = expected[e % LOCAL] + row(("replica", seed, s.node, ln, c), HIDDEN)
            if not torch.equal(expert_grads, expected):
                problems.append(f"{nodes} node(s) hybrid={hybrid} round {rnd}: expert_grads differ in "
                                f"{int((expert_grads != expected).sum())} elements")
            if not torch.equal(s.grads, replicas_before):
                problems.append(f"{nodes} node(s) hybrid={hybrid} round {rnd}: redundant_expert_grads written")
    all_ranks_ok(comm, not problems, "; ".join(problems) or "bitwise")


def _grad(w: torch.Tensor, key: tuple) -> torch.Tensor:
    """The gradient of one instance's loss ``mean((x W^T - y)^2)`` on its own batch (5 rows, seeded by key)."""
    x, y = row(key + ("x",), 5 * D_IN).view(5, D_IN), row(key + ("y",), 5 * D_OUT).view(5, D_OUT)
    leaf = w.detach().clone().view(D_OUT, D_IN).requires_grad_(True)
    (g,) = torch.autograd.grad((x @ leaf.t() - y).pow(2).mean(), leaf)
    return g.reshape(-1)


def test_redundant_expert_training_matches_single_copy(setups):
    """Three SGD steps of tiny experts (a linear map each), every expert with up to ``SLOTS`` replicas on peers:
    weights reach the replicas through ``lb_prefetch_weights``, each replica's gradient on its own batch comes
    back through ``lb_reduce_grads``. The owners' weights (and the replicas' prefetched copies, every step)
    equal a single-copy reference bit for bit (its gradient summed in the documented order) and the
    single-copy autograd of the total loss to float32 rounding."""
    comm = world()
    lr, steps = 0.1, 3
    problems = []
    for (nodes, hybrid), s in setups.items():
        n = s.rpn
        m = torch.tensor([[((ln + 1 + c % (n - 1)) % n) * LOCAL + c % LOCAL if n > 1 else -1 for c in range(SLOTS)]
                          for ln in range(n)], dtype=torch.int32)
        m[0, SLOTS - 1] = -1  # an unused slot
        init = {e: row(("w0", s.node, e), D_OUT * D_IN) for e in range(n * LOCAL)}
        # the single-copy reference of the experts this rank owns or holds a replica of
        needed = {s.local * LOCAL + e for e in range(LOCAL)} | {int(e) for e in m[s.local] if e >= 0}
        init = {e: w for e, w in init.items() if e in needed}
        ref = dict(init)
        autograd_ref = dict(init)
        instances = {e: [(ln, c) for ln in range(n) for c in range(SLOTS) if int(m[ln, c]) == e] for e in ref}
        ref_history = []
        for step in range(steps):
            ref_history.append(dict(ref))
            for e in ref:
                g = _grad(ref[e], ("orig", step, s.node, e))
                for ln, c in instances[e]:
                    g = g + _grad(ref[e], ("replica", step, s.node, ln, c))
                ref[e] = ref[e] - lr * g
                w = autograd_ref[e].detach().clone().requires_grad_(True)
                total = 0
                for key in [("orig", step, s.node, e)] + [("replica", step, s.node, ln, c) for ln, c in instances[e]]:
                    x = row(key + ("x",), 5 * D_IN).view(5, D_IN)
                    y = row(key + ("y",), 5 * D_OUT).view(5, D_OUT)
                    total = total + (x @ w.view(D_OUT, D_IN).t() - y).pow(2).mean()
                (gt,) = torch.autograd.grad(total, w)
                autograd_ref[e] = autograd_ref[e] - lr * gt
        # the distributed run: this rank's experts and its replica slots
        weights = torch.stack([init[s.local * LOCAL + e] for e in range(LOCAL)])
        for step in range(steps):
            s.train_w.fill_(float("nan"))
            coll(lambda: s.buf.lb_prefetch_weights(s.train_w, weights, m).wait(), what="lb_prefetch_weights")
            for c in range(SLOTS):
                e = int(m[s.local, c])
                if e >= 0 and not torch.equal(s.train_w[c], ref_history[step][e]):
                    problems.append(f"{nodes} node(s) hybrid={hybrid} step {step}: replica slot {c} of expert {e}")
                s.train_g[c] = _grad(s.train_w[c], ("replica", step, s.node, s.local, c)) if e >= 0 else 0.0
            expert_grads = torch.stack([_grad(weights[e], ("orig", step, s.node, s.local * LOCAL + e))
                                        for e in range(LOCAL)])
            coll(lambda: s.buf.lb_reduce_grads(s.train_g, expert_grads, m).wait(), what="lb_reduce_grads")
            weights = weights - lr * expert_grads
        for e in range(LOCAL):
            mine = s.local * LOCAL + e
            if not torch.equal(weights[e], ref[mine]):
                problems.append(f"{nodes} node(s) hybrid={hybrid}: expert {mine} differs from the ordered reference")
            if not torch.allclose(weights[e], autograd_ref[mine], rtol=1e-5, atol=1e-6):
                problems.append(f"{nodes} node(s) hybrid={hybrid}: expert {mine} differs from autograd's")
    all_ranks_ok(comm, not problems, "; ".join(problems) or "training")


def _expect_everywhere(fn, exc_type, needle: str, what: str) -> None:
    _, err = capture(fn)
    ok = isinstance(err, exc_type) and needle in str(err)
    all_ranks_ok(world(), ok, f"{what}: expected {exc_type.__name__} with {needle!r}, got {err!r}")


def test_bad_input_fails_everywhere_before_any_byte_moves(setups):
    """Each bad call raises on every rank (the bad rank its own error, the others one naming it); the slots
    keep their bytes; the buffer keeps working."""
    s = setups[(1, True)]
    R, rank = world().Get_size(), world().Get_rank()
    m = mapping(R, 7, empty=0.0)
    w = s.train_w
    src = torch.ones(LOCAL, D_OUT * D_IN)
    g = torch.zeros(LOCAL, D_OUT * D_IN)
    w.fill_(-3.0)
    last = rank == R - 1
    cases = [
        ("outside the LB region", lambda: s.buf.lb_prefetch_weights(torch.zeros_like(w) if last else w, src, m),
         ValueError, "LB region" if last else f"rank {R - 1} refused"),
        ("pair of different bytes", lambda: s.buf.lb_prefetch_weights(w, src[:, :-1].contiguous() if last else src, m),
         ValueError, "bytes per expert" if last else "refused"),
        ("int64 mapping", lambda: s.buf.lb_prefetch_weights(w, src, m.long()), ValueError, "int32"),
        ("own expert in own slot", lambda: s.buf.lb_prefetch_weights(w, src, torch.zeros(R, SLOTS, dtype=torch.int32)),
         ValueError, "own experts"),
        ("expert id out of range", lambda: s.buf.lb_reduce_grads(s.train_g, g, torch.full((R, SLOTS), R * LOCAL,
                                                                                        dtype=torch.int32)),
         ValueError, "expert ids"),
        ("bf16 gradients", lambda: s.buf.lb_reduce_grads(s.train_g, g.bfloat16(), m), ValueError, "float32"),
        ("num_sms", lambda: s.buf.lb_reduce_grads(s.train_g, g, m, num_sms=-1), ValueError, "num_sms"),
        ("empty list", lambda: s.buf.lb_prefetch_weights([], [], m), ValueError, "non-empty"),
    ]
    if R > 1:
        other = m.clone()
        other[0, 0] = -1
        cases += [
            ("mappings differ", lambda: s.buf.lb_prefetch_weights(w, src, other if last else m), ValueError,
             "redundancy_mapping"),
            ("operations differ", lambda: (s.buf.lb_reduce_grads(s.train_g, g, m) if last
                                           else s.buf.lb_prefetch_weights(w, src, m)), ValueError, "operation"),
        ]
    if (2, True) in setups:  # a disagreement inside the last node raises on the first node's ranks too
        two = setups[(2, True)]
        m2 = mapping(two.rpn, 7, empty=0.0)
        odd = m2.clone()
        odd[0, 0] = -1
        src2 = torch.ones(LOCAL, D_OUT * D_IN)
        cases += [
            ("mappings differ in one node of two", lambda: two.buf.lb_prefetch_weights(
                two.train_w, src2, odd if last else m2), ValueError, "node 1: redundancy_mapping"),
            ("operations differ across nodes", lambda: (
                two.buf.lb_reduce_grads(two.train_g, torch.zeros(LOCAL, D_OUT * D_IN), m2) if last
                else two.buf.lb_prefetch_weights(two.train_w, src2, m2)), ValueError, "operation"),
        ]
    for what, fn, exc, needle in cases:
        _expect_everywhere(fn, exc, needle, what)
    all_ranks_ok(world(), bool((w == -3.0).all()), "a refused call wrote into a slot")
    coll(lambda: s.buf.lb_prefetch_weights(w, src, m).wait(), what="lb_prefetch_weights after errors")
    filled = [torch.equal(w[c], src[0]) for c in range(SLOTS) if int(m[rank, c]) >= 0]
    all_ranks_ok(world(), all(filled), "the buffer works after refused calls")
