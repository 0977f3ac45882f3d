"""Child job of ``tests/ep/test_errors.py``: one rank's program ends with an uncaught exception while its peer is in a
call.

Launched as ``mpiexec -n 2 python -m tests.ep.uncaught_exception_job MODE``. Rank 1 builds the Buffer, waits until
rank 0 has entered its call, then raises ``ValueError`` out of the script. Rank 0 prints one line,
``PEER-SAW <exception class> <seconds waited>: <message>`` (or ``PEER-SAW none ...``), then ``JOB DONE 0``.

Modes:
  normal   a normal-mode ``Buffer(timeout_s=120)``: rank 0 is in ``dispatch``'s count exchange, and must
           raise ``TransportAborted`` naming the uncaught exception, long before the deadline;
  shrink   a low-latency ``Buffer(enable_shrink=True, timeout_s=1.5)``: rank 0 is in ``low_latency_dispatch``, and
           must mask rank 1 at the deadline and complete the call (no abort: the owner masks lost ranks).
  chained  as ``normal``, but the program installs its own ``sys.excepthook`` after the first Buffer, calling the
           hook it replaced (it prints ``USER-HOOK`` once), then builds a second Buffer;
  badstr   as ``normal``, with an exception whose ``__str__`` raises;
  exit     as ``normal``, but rank 1 leaves with ``sys.exit(3)`` (no exception reaches the hook): its exit teardown
           finds rank 0 waiting for it and aborts, after a 1 s grace;
  done     no failure: both ranks make the dispatch, then rank 1's script ends while rank 0 computes for 2 s before
           its own end (not waiting for rank 1: nobody is aborted, the job exits 0).
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
from mpi4py import MPI

from deepep_ascend import Buffer

torch.set_num_threads(1)
MODE = sys.argv[1]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
E, H, K, M = 8, 128, 2, 4
if MODE != "shrink":
    buf = Buffer(None, 1 << 22, 0, comm=comm, timeout_s=120.0)
    if MODE == "chained":
        previous = sys.excepthook

        def user_hook(exc_type, exc, tb):
            print(f"USER-HOOK {rank}", flush=True)
            previous(exc_type, exc, tb)

        sys.excepthook = user_hook
        second = Buffer(None, 1 << 20, 0, comm=comm, timeout_s=120.0)
else:
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, 2, E), low_latency_mode=True, comm=comm,
                 enable_shrink=True, timeout_s=1.5)
topk_idx = torch.arange(K).repeat(M, 1) + 4 * (1 - rank)  # every token to the other rank's experts
comm.Barrier()
if MODE == "done":
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    buf.dispatch(torch.ones(M, H, dtype=torch.bfloat16), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                 num_tokens_per_expert=per_expert)
    if rank == 0:
        time.sleep(2.0)
    print(f"JOB DONE {rank}", flush=True)
    sys.exit(0)
if rank == 1:
    time.sleep(0.5)  # rank 0 is in its call by now
    if MODE == "exit":
        sys.exit(3)
    if MODE == "badstr":
        class Unprintable(ValueError):
            def __str__(self):
                raise RuntimeError("no message")

        raise Unprintable()
    raise ValueError("a bug in rank 1's own code")
start = time.monotonic()
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if MODE != "shrink":
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
            buf.dispatch(torch.ones(M, H, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        else:
            buf.low_latency_dispatch(torch.ones(M, H, dtype=torch.bfloat16), topk_idx, M, E, use_fp8=False)
            mask = torch.zeros(2, dtype=torch.int32)
            buf.low_latency_query_mask_buffer(mask)
            print(f"MASK {mask.tolist()}", flush=True)
    print(f"PEER-SAW none {time.monotonic() - start:.1f}: -", flush=True)
except Exception as exc:  # noqa: BLE001 - reported to the parent test
    print(f"PEER-SAW {type(exc).__name__} {time.monotonic() - start:.1f}: {exc}", flush=True)
print(f"JOB DONE {rank}", flush=True)
