"""Node-shared memory whose lifetime is that of its tensors, not of the transport.

A :class:`~transports.ubmem.SymmetricWindow` is freed by ``destroy()`` (``MPI_Win_free`` unmaps
it), so a tensor that views it must be gone first. Memory that a library hands to its caller as an
ordinary output (DeepEP's ``recv_x``) cannot promise that. A :class:`SharedSegment` is a POSIX
shared-memory file per rank (``/dev/shm``, as MPICH's own segments), mapped by every rank of the
node: each mapping is a Python ``mmap`` that every tensor made from it keeps alive
(``torch.frombuffer`` holds a reference), so a tensor stays valid however long the caller keeps
it, and the memory goes when the last tensor does. The files are unlinked as soon as every peer has
mapped them, so nothing outlives the processes.
"""

from __future__ import annotations

import itertools
import mmap
import os

import numpy as np
import torch

from .errors import TransportArgumentError, TransportRuntimeError

SHM_DIR = "/dev/shm"  # where MPICH maps its shared windows too
_SERIALS = itertools.count()


def is_integer(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class SharedSegment:
    """This rank's and its node peers' segments (build with :meth:`Transport.create_segment`).

    Attributes:
        name: label used in file names and errors.
        sizes: world rank -> size in bytes of that node peer's segment (0: it has none).
    """

    def __init__(self, tp, name: str, nbytes: int):
        topo = tp.topology
        self.name, self.rank = name, topo.rank
        self.sizes, self._maps = {}, {}
        self._bases = {}  # peer -> address of its mapping (address(), offset_of()), while mapped
        path, error, fd, created = None, None, -1, False
        bad_arg = not is_integer(nbytes) or nbytes < 0
        if bad_arg:
            error, nbytes = f"rank {self.rank}: nbytes must be a non-negative int, got {nbytes!r}", 0
        nbytes = int(nbytes)
        try:
            if nbytes:
                path = os.path.join(SHM_DIR, f"deepep_ascend.{os.getpid()}.{next(_SERIALS)}.{name}")
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    created = True
                    # Reserve the pages now: a full tmpfs is then an error here, not a SIGBUS on a later store.
                    os.posix_fallocate(fd, 0, nbytes)
                except Exception as exc:  # noqa: BLE001 - any failure must reach the peers (OverflowError: > off_t)
                    error = f"rank {self.rank}: cannot create {nbytes} B of shared memory at {path}: {exc}"
            # Every step that can fail on one rank is followed by a collective that tells all of them.
            everyone = tp.node_comm.allgather((path, nbytes, error, bad_arg))
            self._raise_if(everyone)
            error = None
            for p, (peer_path, size, _, _) in zip(topo.node_ranks(), everyone):
                self.sizes[p] = size
                try:
                    if size and error is None:
                        self._maps[p] = self._map(peer_path, size, fd if p == self.rank else -1)
                except Exception as exc:  # noqa: BLE001 - any failure must reach the peers
                    error = f"rank {self.rank}: cannot map the segment of rank {p} ({size} B): {exc}"
            # This allgather is also the barrier after which every peer has mapped every file.
            self._raise_if(tp.node_comm.allgather((None, 0, error, False)))
        except BaseException:
            self.release()
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            if created:  # never another process's file (EEXIST: a stale name from a reused pid)
                try:
                    os.unlink(path)  # mapped everywhere (or failed everywhere): the name can go
                except OSError:
                    pass

    def _raise_if(self, everyone) -> None:
        """Raise on every rank if any entry ``(path, nbytes, error, bad_arg)`` of the node holds an error."""
        errors = [e for _, _, e, _ in everyone if e]
        if errors:
            kind = TransportArgumentError if all(bad for _, _, e, bad in everyone if e) else TransportRuntimeError
            raise kind(f"rank {self.rank}: create_segment('{self.name}') failed on the node: " + "; ".join(errors))

    def _map(self, path: str, size: int, fd: int) -> mmap.mmap:
        own = fd >= 0
        if not own:
            fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if not own:
                os.close(fd)

    def view(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 tensor over bytes ``[offset, offset + nbytes)`` of ``peer``'s segment.

        The tensor has a storage of its own that keeps the mapping alive (see the module doc). It is a normal
        tensor, also under ``torch.inference_mode()``.
        Raises:
            TransportArgumentError: ``peer`` has no segment here, or the range is outside it.
        """
        size = self.sizes.get(peer, 0)
        if size and not self._maps:
            raise TransportArgumentError(f"rank {self.rank}: segment '{self.name}': view after release()")
        if peer not in self._maps or offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise TransportArgumentError(
                f"rank {self.rank}: segment '{self.name}' of rank {peer}: byte range [{offset}, {offset}+{nbytes}) "
                f"outside its {size} B" + ("" if peer in self.sizes else " (not a rank of this node)"))
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        if not torch.is_inference_mode_enabled():  # (entering the mode's context costs twice the view)
            return torch.frombuffer(self._maps[peer], dtype=torch.uint8, count=nbytes, offset=offset)
        with torch.inference_mode(False):  # a normal tensor even under it: callers keep views across calls
            return torch.frombuffer(self._maps[peer], dtype=torch.uint8, count=nbytes, offset=offset)

    def address(self, peer: int, offset: int, nbytes: int) -> int:
        """The address in this process of byte ``offset`` of ``peer``'s segment, for native code that reads or
        writes ``[offset, offset + nbytes)`` (checked as :meth:`view` checks it) while this object keeps its
        mappings: :meth:`view`'s bytes without a tensor.

        Raises:
            TransportArgumentError: as :meth:`view`; also ``offset`` or ``nbytes`` not an integer (a bool or a
                float: an address must not be computed from them).
        """
        if type(offset) is not int or type(nbytes) is not int:  # (the common case first: plain ints)
            if not (is_integer(offset) and is_integer(nbytes)):
                raise TransportArgumentError(f"rank {self.rank}: segment '{self.name}': address offset and nbytes "
                                             f"must be integers, got {offset!r} and {nbytes!r}")
            offset, nbytes = int(offset), int(nbytes)
        base = self._bases.get(peer)
        if base is None or offset < 0 or nbytes < 0 or offset + nbytes > self.sizes[peer]:
            self.view(peer, offset, nbytes)  # raises, naming the range
            base = self._base(peer)
        return base + offset

    def _base(self, peer: int) -> int:
        base = self._bases[peer] = self.view(peer, 0, 1).data_ptr()
        return base

    def offset_of(self, peer: int, tensor: torch.Tensor) -> int | None:
        """Byte offset in ``peer``'s segment where ``tensor``'s bytes start, if all of them
        (``tensor`` contiguous, non-empty) lie in this process's mapping of it; else None."""
        if peer not in self._maps or not tensor.numel() or not tensor.is_contiguous():
            return None
        base = self._bases.get(peer)
        off = tensor.data_ptr() - (self._base(peer) if base is None else base)
        nbytes = tensor.numel() * tensor.element_size()
        return off if 0 <= off and off + nbytes <= self.sizes[peer] else None

    def release(self) -> None:
        """Drop this object's mappings; tensors made by :meth:`view` keep theirs until they go."""
        self._maps.clear()
        self._bases.clear()
