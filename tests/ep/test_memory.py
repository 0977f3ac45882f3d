"""Single-process checks of ``deepep_ascend.ep.memory``: the output pool never hands out storage a
caller still uses, and reuses storage once every view of it is gone."""

from __future__ import annotations

import torch

from deepep_ascend.ep import memory as host

MB = 1 << 20


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_output_pool_reuses_only_dropped_storage():
    if host.storage_users(torch.empty(1)) is None:  # torch without storage use counts: no reuse at all
        pool = host.OutputPool()
        a = pool.empty((8 * MB,), torch.uint8)
        assert _ptr(pool.empty((8 * MB,), torch.uint8)) != _ptr(a)
        return
    pool = host.OutputPool(max_blocks=2)
    a = pool.empty((1024, 4096), torch.bfloat16)  # 8 MiB
    assert a.shape == (1024, 4096) and a.dtype == torch.bfloat16 and a.is_contiguous() and a._base is None
    a.fill_(1.5)
    b = pool.empty((1024, 4096), torch.bfloat16)  # a is alive: a new block
    assert _ptr(b) != _ptr(a)
    b.fill_(2.5)
    view = b[3:5].view(torch.int16)  # a view keeps b's storage in use
    ptr_b = _ptr(b)
    del b
    c = pool.empty((1000, 4096), torch.bfloat16)  # smaller request, a and view alive: no reuse
    assert _ptr(c) not in (_ptr(a), ptr_b)
    ptr_c = _ptr(c)
    assert (a == 1.5).all() and (view.view(torch.bfloat16) == 2.5).all()  # nothing overwritten
    del view, c
    d = pool.empty((900, 4096), torch.bfloat16)  # b's and c's blocks are free again: one of them
    assert _ptr(d) in (ptr_b, ptr_c)
    assert (a == 1.5).all()
    del a
    e = pool.empty((1024, 4096), torch.uint8)  # another dtype and shape on a's old block is fine
    assert e.shape == (1024, 4096) and e.dtype == torch.uint8


def test_output_pool_small_and_growing_requests():
    pool = host.OutputPool(max_blocks=1)
    small = pool.empty((3, 5), torch.float32)  # below the pool's threshold: a plain tensor
    assert small.shape == (3, 5)
    a = pool.empty((4 * MB,), torch.uint8)
    ptr = _ptr(a)
    del a
    big = pool.empty((64 * MB,), torch.uint8)  # larger than the free block: a new one
    assert big.numel() == 64 * MB and _ptr(big) != ptr
    big[-1] = 7  # the whole requested range is writable
    assert int(big[-1]) == 7


def test_output_pool_best_fit_among_blocks_of_different_sizes():
    """The best-fit block is taken out of the pool by identity: comparing tensors of different sizes
    (list.remove's ==) raised "The size of tensor a must match" once a larger free block came first."""
    if host.storage_users(torch.empty(1)) is None:
        return
    pool = host.OutputPool(max_blocks=4)
    big = pool.empty((32 * MB,), torch.uint8)
    small = pool.empty((8 * MB,), torch.uint8)
    ptr_big, ptr_small = _ptr(big), _ptr(small)
    del big, small  # both free: the 32 MiB block comes first in the pool, the 8 MiB one fits best
    t = pool.empty((6 * MB,), torch.uint8)
    assert _ptr(t) == ptr_small
    u = pool.empty((16 * MB,), torch.uint8)  # the remaining free block
    assert _ptr(u) == ptr_big
    t.fill_(1)
    u.fill_(2)
    assert int(t.sum()) == 6 * MB and int(u[-1]) == 2


def test_output_pool_reuses_mid_size_outputs_apart_from_large_blocks():
    """Outputs from 256 KiB to 4 MiB (a low-latency combine's ``combined_x``) are pooled too, in their own
    blocks: a large free block is never handed to one, nor a small block to a large request."""
    if host.storage_users(torch.empty(1)) is None:
        return
    pool = host.OutputPool(max_blocks=2)
    tiny = pool.empty((64, 1024), torch.uint8)  # 64 KiB: a plain tensor, never pooled
    del tiny
    assert not pool._blocks[False] and not pool._blocks[True]
    big = pool.empty((16 * MB,), torch.uint8)
    ptr_big = _ptr(big)
    del big  # a free large block
    mid = pool.empty((128, 7168), torch.bfloat16)  # 1.75 MiB
    assert _ptr(mid) != ptr_big and mid.shape == (128, 7168) and mid._base is None
    mid.fill_(3.0)
    ptr_mid = _ptr(mid)
    other = pool.empty((128, 7168), torch.bfloat16)  # mid is alive: another block
    assert _ptr(other) not in (ptr_mid, ptr_big)
    assert (mid == 3.0).all()
    del mid
    again = pool.empty((120, 7168), torch.bfloat16)  # mid's block, free again
    assert _ptr(again) == ptr_mid
    assert _ptr(pool.empty((8 * MB,), torch.uint8)) == ptr_big  # the large block waited for a large request
