"""The Marlin MoE peer harness (benchmarks/peers/marlin_moe.py) and its fetch script
(benchmarks/peers/fetch_marlin.py): everything testable without a GPU.

* always (pure PyTorch / Python): the ``float4_e2m1f`` type id; the expert map and the
  local-pair filter; vLLM's block-size heuristic and the alignment buffer length; the GPTQ
  order and the PyTorch Marlin repack (each nibble lands in the lane/slot that the
  mma.m16n8k16 fragment description gives); the E8M0 scale permutation; argument checking
  of ``MarlinMoE`` (built on the CPU with the PyTorch repack); the fetch script's
  split / join / extract and the loader's joining of parts.
* on a GPU with the extension in ``.gpu/peers/marlin`` (not on CI): ``check_fc1`` and
  ``check_forward`` (skipped elsewhere with the reason).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest
import torch

from benchmarks.peers import fetch_marlin as fm
from benchmarks.peers import marlin_moe as mm


def _weights(e=4, lat=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    u8 = dict(dtype=torch.uint8, generator=g)
    return (torch.randint(0, 256, (e, 2 * i, lat // 2), **u8), torch.randint(120, 130, (e, 2 * i, lat // 32), **u8),
            torch.randint(0, 256, (e, lat, i // 2), **u8), torch.randint(120, 130, (e, lat, i // 32), **u8))


# --------------------------------------------------------------------------------------
# type id, routing inputs, block size
# --------------------------------------------------------------------------------------

def test_float4_type_id_packs_the_fields():
    """exponent 2 | mantissa 1 << 8 | signed << 16 | finite-only << 49 (NaN repr none)."""
    assert mm.FLOAT4_E2M1F_ID == 2 + (1 << 8) + (1 << 16) + (1 << 49) == 562949953487106
    # an IEEE type: BF16 = exponent 8, mantissa 7, signed, NaN repr IEEE 754 (1) at bit 50
    assert mm.scalar_type_id(8, 7, True) == 8 + (7 << 8) + (1 << 16) + (1 << 50)


def test_expert_map_and_local_mask():
    m = mm.expert_map(3, 4, 10)
    assert m.dtype == torch.int32
    assert m.tolist() == [-1, -1, -1, 0, 1, 2, 3, -1, -1, -1]
    ids = torch.tensor([[0, 3, 6, 7], [9, 5, 4, 2]])
    assert mm.local_mask(ids, 3, 4).tolist() == [[False, True, True, False], [False, True, True, False]]
    # the map and the mask agree: a pair is local iff its mapped id is not -1
    assert torch.equal(m[ids] >= 0, mm.local_mask(ids, 3, 4))
    with pytest.raises(ValueError, match="first \\+ count = 11 > n_experts_total = 10"):
        mm.expert_map(7, 4, 10)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        mm.expert_map(0, 0, 10)
    with pytest.raises(ValueError, match="first must be an int >= 0"):
        mm.expert_map(True, 2, 10)


def test_vllm_block_size_heuristic_at_our_shapes():
    # DEP16 rank (56 of 896 experts): T = 1 -> 16 rows -> M = 1; T = 64 -> M = 64
    assert mm.vllm_block_size_m(16, 16, 56, 896) == 8
    assert mm.vllm_block_size_m(1024, 16, 56, 896) == 32
    # TP8 rank (all 896): 65 rows -> 8; 1024 rows: 1024 * 16 / 896 / 32 = 0.57 -> 32
    assert mm.vllm_block_size_m(65, 16, 896, 896) == 8
    assert mm.vllm_block_size_m(1024, 16, 896, 896) == 32
    assert mm.vllm_block_size_m(100000, 16, 8, 8) == 64
    with pytest.raises(ValueError, match="n_experts_total must be an int >= 56"):
        mm.vllm_block_size_m(16, 16, 56, 8)


def test_max_padded_pairs():
    assert mm.max_padded_pairs(1024, 896, 16) == 1024 + 896 * 15
    assert mm.max_padded_pairs(16, 896, 8) == 16 * 8  # fewer pairs than experts
    assert mm.max_padded_pairs(16, 896, 64) == 16 * 64


# --------------------------------------------------------------------------------------
# weight layout
# --------------------------------------------------------------------------------------

def test_gptq_order_is_a_transposed_view_of_our_nibbles():
    codes = _weights()[0][0]  # [2I, L/2] = [256, 128]
    q = mm.gptq_order(codes).to(torch.int64) & 0xFFFFFFFF  # [L/8, 2I]
    assert q.shape == (32, 256)
    unpacked = torch.stack([(q >> (4 * i)) & 15 for i in range(8)], 1).reshape(256, 256)  # [K, N]
    ours = torch.stack((codes & 15, codes >> 4), -1).reshape(256, 256).T  # element 2i low nibble
    assert torch.equal(unpacked, ours.to(torch.int64))
    with pytest.raises(ValueError, match="codes must be uint8"):
        mm.gptq_order(codes.to(torch.int32))


def test_marlin_repack_torch_puts_each_nibble_in_its_fragment_slot():
    """A single nonzero nibble at (k, n) of a K x N = 32 x 128 weight lands at row ``k // 16``,
    word ``128 (n // 64) + 4 t + j`` and bits ``4 s``: tile ``j = (n % 64) // 16``; within
    the tile, lane ``t = 4 (n % 8) + (k % 8) // 2`` and slot ``s = 4 (k % 2) + 2 ((n % 16) //
    8) + (k % 16) // 8`` (the B fragment of mma.m16n8k16 per 8-column half)."""
    k_size, n_size = 32, 128
    gen = torch.Generator().manual_seed(3)
    probes = torch.randperm(k_size * n_size, generator=gen)[:300].tolist() + [0, k_size * n_size - 1]
    codes = torch.zeros(len(probes), n_size, k_size // 2, dtype=torch.uint8)
    for p, flat in enumerate(probes):
        k, n = divmod(flat, n_size)
        codes[p, n, k // 2] = 9 << (4 * (k % 2))  # value 9 at element k of row n
    words = mm.marlin_repack_torch(codes, chunk_experts=64).to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (len(probes), k_size // 16, 2 * n_size)
    for p, flat in enumerate(probes):
        k, n = divmod(flat, n_size)
        kin, nin, j = k % 16, n % 16, (n % 64) // 16
        t = 4 * (nin % 8) + (kin % 8) // 2
        s = 4 * (kin % 2) + 2 * (nin // 8) + kin // 8
        row, col = k // 16, 128 * (n // 64) + 4 * t + j
        expect = torch.zeros_like(words[p])
        expect[row, col] = 9 << (4 * s)
        assert torch.equal(words[p], expect), (k, n)


def test_marlin_repack_torch_chunks_and_checks():
    codes = _weights(e=5)[2]  # w2: [5, L=256, I/2=64] -> N = 256, K = 128
    whole = mm.marlin_repack_torch(codes, chunk_experts=0)
    assert whole.shape == (5, 128 // 16, 2 * 256) and whole.dtype == torch.int32
    assert torch.equal(mm.marlin_repack_torch(codes, chunk_experts=2), whole)
    # a permutation of the nibbles: the multiset of each expert's nibbles is unchanged
    w = whole.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * i)) & 15 for i in range(8)], -1).reshape(5, -1)
    ours = torch.stack((codes & 15, codes >> 4), -1).reshape(5, -1).to(torch.int64)
    assert torch.equal(nib.sort(1).values, ours.sort(1).values)
    with pytest.raises(ValueError, match="layout needs N % 64 == 0 and K % 16 == 0, got N=32, K=128"):
        mm.marlin_repack_torch(codes[:, :32])
    with pytest.raises(ValueError, match="codes must be uint8 \\[E, N, K/2\\]"):
        mm.marlin_repack_torch(codes[0])


def test_marlin_scales_is_the_documented_permutation():
    e, n, groups = 2, 128, 4
    codes = torch.arange(e * n * groups, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(e, n, groups)
    out = mm.marlin_scales(codes)
    assert out.dtype == torch.float8_e8m0fnu and out.shape == (e, groups, n)
    flat_in = codes.transpose(1, 2).reshape(e, -1)  # [K/32, N] row-major
    flat_out = out.view(torch.uint8).reshape(e, -1)
    # first run of 64: 8x8 transpose -> [0, 8, 16, ..., 56, 1, 9, ...]; then quads [0, 2, 1, 3]
    first = [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25]
    assert flat_out[0, :12].tolist() == flat_in[0, first].tolist()
    assert torch.equal(flat_out.sort(1).values, flat_in.sort(1).values)  # a permutation
    with pytest.raises(ValueError, match="N % 64 == 0"):
        mm.marlin_scales(codes[:, :32])


# --------------------------------------------------------------------------------------
# MarlinMoE arguments (CPU build)
# --------------------------------------------------------------------------------------

def test_marlin_moe_builds_on_cpu_with_the_torch_repack():
    w = _weights(e=6)
    moe = mm.MarlinMoE(*w, first=2, count=3, device="cpu")
    assert moe.repack == "torch" and moe.activation == "torch"
    assert moe.w13.shape == (3, 256 // 16, 2 * 256) and moe.w2.shape == (3, 128 // 16, 2 * 256)
    assert moe.w13_scale.shape == (3, 256 // 32, 256) and moe.w2_scale.shape == (3, 128 // 32, 256)
    assert torch.equal(moe.w13, mm.marlin_repack_torch(w[0][2:5]))
    assert moe.expert_map.tolist() == [-1, -1, 0, 1, 2, -1]
    assert moe.stored_bytes_per_expert == moe.bytes_per_expert  # a permutation, no padding
    # exactly the local experts, with the model's count
    local = mm.MarlinMoE(*(t[2:5] for t in w), first=2, count=3, n_experts_total=896, device="cpu")
    assert torch.equal(local.w2, moe.w2) and local.expert_map.shape == (896,)
    assert local.choose_block_size(16) == 8
    with pytest.raises(RuntimeError, match="calls need a GPU"):
        moe(torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.int32),
            torch.zeros(2, 16))


@pytest.mark.parametrize("kw, match", [
    (dict(block_size_m=24), "block_size_m must be None or one of"),
    (dict(combine="sum"), "combine must be one of"),
    (dict(repack="cuda"), "repack must be 'auto', 'ext' or 'torch'"),
    (dict(first=4, count=4), "w13_codes has E=6 experts"),
    (dict(n_experts_total=2048), "moe_align_block_size takes < 1024 experts"),
    (dict(n_experts_total=3), "n_experts_total must be an int >= 6"),
])
def test_marlin_moe_argument_errors(kw, match):
    args = dict(first=0, count=None)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        mm.MarlinMoE(*_weights(e=6), device="cpu", **args)


def test_marlin_moe_rejects_shapes_marlin_cannot_tile():
    w = _weights(e=2, lat=256, i=96)  # FC2 K = I = 96
    with pytest.raises(ValueError, match="FC2 \\(N = L, K = I\\): Marlin needs"):
        mm.MarlinMoE(*w, device="cpu")
    w13, s13, w2, s2 = _weights(e=2)
    with pytest.raises(ValueError, match="w2_scales must be"):
        mm.MarlinMoE(w13, s13, w2, s2[:, :, :2], device="cpu")


def test_ext_repack_needs_the_c_library():
    with pytest.raises(RuntimeError, match="repack='ext' needs _C_stable_libtorch.abi3.so"):
        mm.MarlinMoE(*_weights(e=2), repack="ext", device="cpu")


# --------------------------------------------------------------------------------------
# fetch script and loader (files only)
# --------------------------------------------------------------------------------------

def test_split_and_join_round_trip(tmp_path):
    data = os.urandom(10_000)
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    parts = fm.split_file(str(path), 3000)
    assert [os.path.basename(p) for p in parts] == [f"lib.so.part{i}" for i in range(4)]
    assert [os.path.getsize(p) for p in parts] == [3000, 3000, 3000, 1000]
    assert not path.exists()
    fm.join_parts(str(path), hashlib.sha256(data).hexdigest())
    assert path.read_bytes() == data
    path.unlink()
    with pytest.raises(ValueError, match="the manifest says"):
        fm.join_parts(str(path), "0" * 64)
    assert not path.exists() and not (tmp_path / "lib.so.joining").exists()
    with pytest.raises(FileNotFoundError, match="nor .*part0"):
        fm.join_parts(str(tmp_path / "other.so"))
    with pytest.raises(ValueError, match="at most 10"):
        fm.split_file(str(parts[0]), 100)
    with pytest.raises(ValueError, match="part_bytes must be >= 1"):
        fm.split_file(str(parts[0]), 0)


def test_extract_from_a_wheel_and_the_loader_joins_parts(tmp_path):
    moe_bytes, c_bytes = os.urandom(5000), os.urandom(12_000)
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fm.MEMBERS[fm.MOE_LIB], moe_bytes)
        z.writestr(fm.MEMBERS[fm.C_LIB], c_bytes)
        z.writestr("vllm/other.so", b"not taken")
    dest = tmp_path / "marlin"
    manifest = fm.extract(str(wheel), str(dest), part_bytes=5000)
    assert sorted(os.listdir(dest)) == sorted([fm.MOE_LIB, fm.MANIFEST] + [f"{fm.C_LIB}.part{i}" for i in range(3)])
    assert json.loads((dest / fm.MANIFEST).read_text()) == manifest
    assert manifest["files"][fm.C_LIB] == {"bytes": 12_000, "sha256": hashlib.sha256(c_bytes).hexdigest(),
                                           "parts": [f"{fm.C_LIB}.part{i}" for i in range(3)]}
    assert manifest["files"][fm.MOE_LIB]["parts"] == []
    # the loader's step before load_library: the whole file from its parts, checked
    files = mm._manifest(str(dest))
    assert mm._ensure_whole(str(dest), fm.C_LIB, files) == str(dest / fm.C_LIB)
    assert (dest / fm.C_LIB).read_bytes() == c_bytes
    assert mm._ensure_whole(str(dest), "absent.so", files) is None
    # minimal set: _moe_C only
    only = fm.extract(str(wheel), str(tmp_path / "min"), libs=(fm.MOE_LIB,))
    assert list(only["files"]) == [fm.MOE_LIB]


def test_available_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(mm.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(mm, "_OPS", None)
    ok, why = mm.available()
    assert not ok and f"no {fm.MOE_LIB} in {tmp_path}" in why
    assert mm.rank_moe(None, 0, 56) == (None, why)
    (tmp_path / fm.MOE_LIB).write_bytes(b"not an ELF file")
    ok, why = mm.available()
    assert not ok and "failed to load" in why


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

def _gpu_or_skip():
    ok, why = mm.available()
    if not ok:
        pytest.skip(f"{why} (the checks run on a GPU with .gpu/peers/marlin carried)")


@pytest.mark.parametrize("block_size_m", [8, 16, 64])
def test_gpu_check_fc1(block_size_m):
    _gpu_or_skip()
    assert mm.check_fc1(block_size_m=block_size_m)["ok"]


@pytest.mark.parametrize("combine", mm.COMBINES)
def test_gpu_check_forward(combine):
    _gpu_or_skip()
    assert mm.check_forward(combine=combine)["ok"]
    assert mm.check_forward(combine=combine, first=0, count=32, block_size_m=48)["ok"]


def test_gpu_compact_layout():
    _gpu_or_skip()
    ok, checks = mm.compact_passes()
    assert ok, [c for c in checks if not c["ok"]]


# --------------------------------------------------------------------------------------
# the experts table
# --------------------------------------------------------------------------------------

def test_experts_table_renders_marlin_best_block_size_and_the_peers():
    """``benchmarks.experts_table.render`` with Marlin timed: two more columns (its best
    ``block_size_m`` named, the engine's speed-up over it) and each peer's configuration
    under the table; a result without Marlin renders as before."""
    from benchmarks.experts_table import best_of, render

    case = {"mode": "dep16", "size": 4, "skew": 0.0, "touched": 50, "limit_us": 200.0,
            "median_us": {"engine": 250.0, "triton_w8": 500.0, "marlin_bm8": 420.0, "marlin_bm16": 400.0}}
    result = {"device": "X", "torch": "t", "read_gbs": 4500.0, "cases": [case],
              "peers": {"marlin": {"layout": "gptq_marlin_repack", "block_size_m": "best of 8/16"}}}
    assert best_of(case["median_us"], "marlin") == ("marlin_bm16", 400.0)
    assert best_of(case["median_us"], "cutlass") == (None, None)
    text = render(result)
    assert "| engine / triton | marlin best us (frac) | engine / marlin |" in text
    assert "| dep16 | 4 | 0.0 | 50 | 200.0 | 250.0 (0.80) | 500.0 (0.40) owner w8 | - | 2.00x | " \
           "400.0 (0.50) owner bm16 | 1.60x |" in text
    # the compact layouts beside the owner ones: the best of all, its layout named
    case["median_us"].update(marlin_compact_bm32=300.0, triton_compact_w4=450.0)
    assert "| 450.0 (0.44) compact w4 | - | 1.80x | 300.0 (0.67) compact bm32 | 1.20x |" in render(result)
    del case["median_us"]["marlin_compact_bm32"], case["median_us"]["triton_compact_w4"]
    assert "marlin: layout gptq_marlin_repack; block_size_m best of 8/16" in text
    del case["median_us"]["marlin_bm8"], case["median_us"]["marlin_bm16"], result["peers"]
    assert "marlin" not in render(result)


def test_config_tag_names_layout_and_configuration():
    from benchmarks.experts_table import config_tag

    assert config_tag("triton_w4", "triton") == "owner w4"
    assert config_tag("triton_compact_w8", "triton") == "compact w8"
    assert config_tag("marlin_compact_bm16", "marlin") == "compact bm16"
    assert config_tag("marlin", "marlin") == "" and config_tag(None, "triton") == ""


def test_experts_table_marlin_setup_reports_why_not(tmp_path, monkeypatch):
    from benchmarks.experts_table import marlin_setup, marlin_vllm_pick

    monkeypatch.setenv(mm.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(mm, "_OPS", None)
    result = {}
    assert marlin_setup(["triton"], result) is None and result == {}
    assert marlin_setup(["marlin"], result) is None
    assert f"no {fm.MOE_LIB}" in result["marlin_error"]
    assert marlin_vllm_pick(16, 56) == 8 and marlin_vllm_pick(1024, 896) == 32


# --------------------------------------------------------------------------------------
# the layouts' glue on the CPU: the extension's ops replaced by PyTorch models of them
# --------------------------------------------------------------------------------------

class _FakeMoeOps:
    """PyTorch models of ``_moe_C``'s ops with the semantics the adapter relies on (vLLM's
    sources): ``moe_align_block_size`` (ids ``>= num_experts`` and ids the map sends to -1
    skipped; each local expert's pairs, flat index ``i``, padded to the block with the
    sentinel ``numel``; a block's expert id; the padded count); ``moe_wna16_marlin_gemm``
    (per block: rows ``sorted_id < size_m top_k`` until the first that is not, reads A row
    ``sorted_id // top_k``, writes C row ``sorted_id``, times ``topk_weights[sorted_id]``
    when asked; BF16 out, FP32 accumulation) over our dequantized weights; ``moe_sum`` (the
    map's local pairs of each row). ``bug`` plants one error."""

    def __init__(self, moe, weights, bug=None):
        sl = slice(moe.first, moe.first + moe.count) if weights[0].shape[0] > moe.count else slice(None)
        from benchmarks.peers.triton_moe import dequantize_mxfp4
        self.w = {id(moe.w13): dequantize_mxfp4(weights[0][sl], weights[1][sl]),
                  id(moe.w2): dequantize_mxfp4(weights[2][sl], weights[3][sl])}
        self.bug = bug

    def moe_align_block_size(self, ids, num_experts, bs, sorted_ids, block_experts, padded, emap):
        flat = ids.reshape(-1).long()
        n = flat.numel()
        inside = flat < num_experts
        mapped = torch.full_like(flat, -1)
        mapped[inside] = emap[flat[inside]].long()
        sorted_ids.fill_(n)
        block_experts.fill_(-1)
        pos = 0
        for e in range(int(emap.max()) + 1):
            idx = (mapped == e).nonzero().reshape(-1)
            if not idx.numel():
                continue
            sorted_ids[pos:pos + idx.numel()] = idx.int()
            span = -(-idx.numel() // bs) * bs
            block_experts[pos // bs:(pos + span) // bs] = e
            pos += span
        padded[0] = pos

    def moe_wna16_marlin_gemm(self, a, c, w, bias, s, s2, zp, g_idx, perm, ws, workspace, sorted_ids,
                              block_experts, padded, topk_w, bs, top_k, mul, b_type, m, n, k, *rest):
        assert a.shape == (m, k) and c.shape == (m * top_k, n) and a.is_contiguous(), (a.shape, c.shape, m, k)
        weight = self.w[id(w)]
        if self.bug == "top_k_ignored":
            top_k = 1
        for blk in range(int(padded[0]) // bs):
            e = int(block_experts[blk])
            if e < 0:
                continue
            for sid in sorted_ids[blk * bs:(blk + 1) * bs].tolist():
                if sid >= m * top_k:
                    break
                row = a[sid // top_k].float() @ weight[e].T
                if mul:
                    row = row * topk_w.reshape(-1)[sid]
                c[sid] = row.to(c.dtype)

    def moe_sum(self, inp, out, ids, emap):
        keep = (emap[ids.long()] >= 0).unsqueeze(-1)
        out.copy_(torch.where(keep, inp.float(), torch.zeros(())).sum(1).to(out.dtype))


def _fake_factory(bug=None, compact_bug=None):
    def build(*w, **kw):
        kw = dict(kw, device="cpu")
        moe = mm.MarlinMoE(*w, **kw)
        moe._ops = {"moe": _FakeMoeOps(moe, w, bug), "c": None}
        if compact_bug == "dest_shifted":  # each pair's FC2 row added to the next row
            orig = mm.compact_pairs

            def shifted(*a, **k_):
                rows, dest, ids_, w_ = orig(*a, **k_)
                return rows, torch.where(dest < a[0].shape[0] - 1, dest + 1, dest), ids_, w_
            moe_call = moe._compact

            def call(*a, **k_):
                mm.compact_pairs = shifted
                try:
                    return moe_call(*a, **k_)
                finally:
                    mm.compact_pairs = orig
            moe._compact = call
        return moe
    return build


_TINY = dict(device="cpu", rows=10)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` of a floating dtype returns NaN, as fresh device memory may hold
    anything: a row the glue leaves unwritten then shows in the check, instead of holding,
    by the allocator's reuse of a freed block, the right values of an earlier test's call
    (which once let a dropped ``top_k`` pass ``check_forward`` under pytest-xdist)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("block_size_m", [8, 48])
def test_owner_and_compact_layouts_pass_the_forward_check_on_cpu_models(block_size_m, poisoned_empty):
    """The real ``__call__`` glue of both layouts (index building, alignment arguments,
    ``top_k``, the activation, the combine) over PyTorch models of the ops: the GPU's
    ``check_forward`` passes for the owner layout (both combines) and the compact one
    (exact capacity, spare capacity with empty slots, all experts local)."""
    for combine in mm.COMBINES:
        res = mm.check_forward(block_size_m=block_size_m, combine=combine, _impl=_fake_factory(), **_TINY)
        assert res["ok"] and res["rows_without_local_pair"] >= 1, res
    ok, checks = mm.compact_passes(device="cpu", _impl=_fake_factory()) if block_size_m == 8 else (True, [])
    assert ok, [c for c in checks if not c["ok"]]
    for cap in (None, 10 * 16):
        res = mm.check_forward(block_size_m=block_size_m, layout="compact", capacity=cap,
                               _impl=_fake_factory(), **_TINY)
        assert res["ok"] and res["zero_rows_ok"] and res["config"]["combine"] == "index_add_", res
    assert mm.check_forward(layout="compact", first=0, count=32, _impl=_fake_factory(), **_TINY)["ok"]


@pytest.mark.parametrize("bug", ["top_k_ignored", "dest_shifted", "capacity_short"])
def test_the_forward_check_catches_a_wrong_layout(bug, poisoned_empty):
    """A wrong layout fails ``check_forward``: FC1 reading the wrong activation rows, the
    compact combine adding each pair to the wrong row, a capacity below the pair count."""
    kw = dict(_TINY, raise_on_fail=False)
    if bug == "top_k_ignored":
        assert not mm.check_forward(_impl=_fake_factory(bug=bug), **kw)["ok"]
    elif bug == "dest_shifted":
        assert not mm.check_forward(layout="compact", _impl=_fake_factory(compact_bug=bug), **kw)["ok"]
    else:
        assert not mm.check_forward(layout="compact", capacity=5, _impl=_fake_factory(), **kw)["ok"]
    with pytest.raises(AssertionError, match="forward check failed"):
        mm.check_forward(layout="compact", capacity=5, _impl=_fake_factory(), **_TINY)


def test_compact_pairs_indexes_the_local_pairs_in_order():
    ids = torch.tensor([[0, 3, 5, 9], [9, 8, 1, 2], [4, 5, 6, 0]], dtype=torch.int32)
    w = torch.arange(12, dtype=torch.float32).view(3, 4) / 10
    rows, dest, slot_ids, slot_w = mm.compact_pairs(ids, w, 3, 3, 6, fill_id=10)  # local: 3, 4, 5
    # local pairs in flat order: (0,1)=3, (0,2)=5, (2,0)=4, (2,1)=5; two empty slots
    assert rows.tolist() == [0, 0, 2, 2, 0, 0]
    assert dest.tolist() == [0, 0, 2, 2, 3, 3]
    assert slot_ids.shape == (6, 1) and slot_ids.dtype == torch.int32
    assert slot_ids.view(-1).tolist() == [3, 5, 4, 5, 10, 10]
    assert torch.equal(slot_w[:4], torch.tensor([0.1, 0.2, 0.8, 0.9]))
    assert slot_w.dtype == torch.float32 and slot_w.shape == (6,)
    # exactly the pair count: no empty slot; below it: the last pairs are dropped
    assert mm.compact_pairs(ids, w, 3, 3, 4, fill_id=10)[2].view(-1).tolist() == [3, 5, 4, 5]
    assert mm.compact_pairs(ids, w, 3, 3, 2, fill_id=10)[1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        mm.compact_pairs(ids, w, 3, 3, 0, fill_id=10)


def test_compact_map_sends_the_fill_id_to_minus_one():
    moe = mm.MarlinMoE(*_weights(e=6), first=2, count=3, device="cpu")
    assert moe.compact_map.tolist() == [-1, -1, 0, 1, 2, -1, -1]
    assert moe.layout == "owner" and moe.describe()["layout"] == "owner"
    assert moe.choose_block_size(1024, 1, "compact") == 64  # 1024 pairs over 3 experts
    assert mm.MarlinMoE(*_weights(e=6), layout="compact", device="cpu").layout == "compact"
    with pytest.raises(ValueError, match="layout must be one of"):
        mm.MarlinMoE(*_weights(e=6), layout="rows", device="cpu")
    moe._ops = {"moe": None, "c": None}
    x, ids = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="layout must be one of"):
        moe(x, ids, torch.zeros(2, 16), layout="rows")
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        moe(x, ids, torch.zeros(2, 16), layout="compact", capacity=0)
