"""The byte codec of the schedules' real-process collectives: any list of tensors as one
uint8 tensor and back, bit-exactly for every dtype the layer moves (FP8 codes, E8M0
scales, BF16, FP32, integer ids, masks).

Layout: an int64 count, then per tensor a header of 8 int64 (dtype index in
:data:`DTYPES`, number of dimensions, the shape padded to :data:`MAX_DIMS`) and its bytes.
:class:`~reference.schedules.groups.TorchGroup` gathers these buffers with
``torch.distributed.all_gather`` and decodes every rank's.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["DTYPES", "MAX_DIMS", "encode", "decode"]

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.bool,
]  # fmt: skip
MAX_DIMS = 6



def encode(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one uint8 tensor: per tensor a header of 8 int64 (dtype index, ndim,
    shape padded to 6) then its bytes. Bit-exact for every dtype in ``DTYPES``."""
    chunks = [torch.tensor([len(tensors)], dtype=torch.int64).view(torch.uint8)]
    for t in tensors:
        if t.dim() > MAX_DIMS:
            raise ValueError(f"_encode: {t.dim()} dims > {MAX_DIMS}")
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        head = torch.tensor([DTYPES.index(t.dtype), t.dim(), *shape], dtype=torch.int64)
        chunks.append(head.view(torch.uint8))
        chunks.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
    return torch.cat(chunks)


def decode(raw: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    raw = raw.cpu()
    count = int(raw[:8].clone().view(torch.int64).item())
    pos, out = 8, []
    for _ in range(count):
        head = raw[pos : pos + 64].clone().view(torch.int64).tolist()
        pos += 64
        dtype, ndim = DTYPES[head[0]], head[1]
        shape = head[2 : 2 + ndim]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        body = raw[pos : pos + nbytes].clone()
        pos += nbytes
        out.append(body.view(dtype).reshape(shape).to(device))
    return out
