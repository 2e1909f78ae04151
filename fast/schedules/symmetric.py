"""The torch symmetric-memory setup shared by the layers over real ranks
(``fast.schedules.dep_peer``, ``fast.schedules.wide_peer``): one process per GPU, every
buffer a peer writes or reads in one symmetric buffer per rank, reached by unicast peer
stores and loads through the addresses the rendezvous hands back (``buffer_ptrs``);
nothing here creates or reads a multicast object.

* :func:`pack`: the byte layout of a buffer's fields, each on a 256-byte boundary;
* :func:`process_group`: the process group, this rank and the rank count (refused before
  ``torch.distributed`` is initialised);
* :class:`SymmetricBuffer`: one rank's buffer, allocated, zeroed and rendezvoused over
  the group (collective), its fields as views and the peers' addresses of a field;
* :func:`meet`: the device's work done, then a barrier of the group.

Each helper takes ``who``, the name its errors start with (the layer or scratch that
called it).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ALIGN", "pack", "process_group", "SymmetricBuffer", "meet"]

#: Every field of a symmetric buffer starts on this many bytes.
ALIGN = 256


def pack(fields: dict) -> tuple[dict, int]:
    """Lay ``fields`` (``{name: (shape, dtype)}``) out one after another in their order,
    each starting on an :data:`ALIGN` boundary: ``({name: (byte offset, shape, dtype)},
    size)`` (the size a multiple of :data:`ALIGN`)."""
    layout, at = {}, 0
    for name, (shape, dtype) in fields.items():
        layout[name] = (at, shape, dtype)
        at += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return layout, at


def process_group(who: str, group=None) -> tuple:
    """``(group, rank, ranks)``: ``group`` (default the world), this process's rank in it
    and its size. Raises a RuntimeError saying how to launch when ``torch.distributed``
    is not initialised."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised (launch with "
                           "torchrun and call init_process_group('nccl'))")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


class SymmetricBuffer:
    """One rank's symmetric buffer of ``layout`` (:func:`pack`), ``size`` bytes on
    ``device``: allocated with ``torch.distributed._symmetric_memory.empty`` (uint8),
    zeroed, then rendezvoused over ``group`` (collective: every rank of the group
    constructs its own, with the same layout).

    * ``tensor``: the whole buffer, uint8 ``[size]``;
    * ``views``: ``{name: tensor}``, each field as its dtype and shape (views of
      ``tensor``);
    * ``peers``: every rank's base address of its buffer (the handle's ``buffer_ptrs``,
      in group rank order; this rank's own among them).
    """

    def __init__(self, layout: dict, size: int, group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.layout, self.size, self.device = layout, size, device
        self.tensor = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self.tensor.zero_()
        handle = symm_mem.rendezvous(self.tensor, group.group_name)
        self.peers = [int(p) for p in handle.buffer_ptrs]
        self.views = {
            name: self.tensor[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, (at, shape, dtype) in layout.items()}

    def address(self, peer: int, name: str, index: int = 0) -> int:
        """The address of byte ``index`` of field ``name`` in rank ``peer``'s buffer."""
        return self.peers[peer] + self.layout[name][0] + index

    def table(self, name: str, index: int = 0) -> torch.Tensor:
        """int64 ``[N]`` on the buffer's device: :meth:`address` of ``(name, index)`` in
        every rank's buffer, in rank order (the tables the kernels write and read
        through)."""
        return torch.tensor([self.address(o, name, index) for o in range(len(self.peers))],
                            dtype=torch.int64, device=self.device)


def meet(group, device: torch.device) -> None:
    """Wait for this rank's device work, then for every rank of ``group`` (a barrier)."""
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    dist.barrier(group)
