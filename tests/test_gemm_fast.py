"""CPU checks of the split-K GEMM (``fast.gemm``): the kernel's byte maps replayed end to
end (ring-slot copies, fragment reads, the ``mma.m16n8k16`` fragment layout of the PTX ISA,
the split-K workspace and the output map) give ``x @ W^T`` exactly on integer data, and so
does the chunked launch of more than 64 rows (token chunks, padded weight rows, a slice of
the workspace and of the tile counters per chunk); the maps tile a ring slot and the
workspace without overlap; the chunk arithmetic and the one K split of the default tactic
at every row count; every kernel shape of every candidate tactic and every chunked shape of
the wide layer compiles for every target; bad tactics, weights and arguments are refused
before anything is launched."""

from __future__ import annotations

import itertools

import pytest
import torch

from fast import backend
from fast.gemm import layout as lay
from fast.gemm.layout import Tactic

_cute_error = backend.cute_import_error()


# --- the data path replayed -------------------------------------------------------------


def _mma(a_regs, b_regs):
    """``mma.m16n8k16`` of one warp: per lane 4 A words and 2 B words, each word a (low,
    high) pair of values; returns per lane (c0, c1, c2, c3). Fragment layout as in the PTX
    ISA (Matrix fragments for mma.m16n8k16 with .bf16): A element (row, col) of register
    i: rows g (i = 0, 2) / g + 8 (i = 1, 3), cols 2q + {0, 1} (i = 0, 1) / 2q + 8 + {0, 1}
    (i = 2, 3); B register i: rows (k) 2q + 8 i + {0, 1}, col g; C: rows g, g + 8 (c0, c1 /
    c2, c3), cols 2q, 2q + 1."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i, (lo, hi) in enumerate(a_regs[lane]):
            row = g + 8 * (i % 2)
            col = 2 * q + 8 * (i // 2)
            a[row, col], a[row, col + 1] = lo, hi
        for i, (lo, hi) in enumerate(b_regs[lane]):
            b[2 * q + 8 * i, g], b[2 * q + 8 * i + 1, g] = lo, hi
    d = a @ b
    return [(d[lane // 4, 2 * (lane % 4)], d[lane // 4, 2 * (lane % 4) + 1],
             d[lane // 4 + 8, 2 * (lane % 4)], d[lane // 4 + 8, 2 * (lane % 4) + 1])
            for lane in range(32)]


def _words(smem: torch.Tensor, offset: int):
    """The 4 words (value pairs) of the 16 bytes at ``offset`` of a slot held as BF16
    elements (little endian: the lower address is the low half)."""
    e = offset // 2
    return [(smem[e + 2 * i].item(), smem[e + 2 * i + 1].item()) for i in range(4)]


def _store_fragment(out, t, row0, where, values, mt_n):
    """The 4 accumulators of lane ``where = (warp, m-tile, window, lane)`` into ``out``
    (rows of the tile from ``row0``) through the layout's C map; tokens past ``t`` are
    padding. Each output is written once."""
    for r in range(4):
        row, token = lay.c_map(*where, r, mt_n)
        if token < t:
            assert torch.isnan(out[token, row0 + row]), "output written twice"
            out[token, row0 + row] = values[r]


def _fill_slot(w, x, row0: int, k0: int, slot: int, warps: int, mt_n: int, subs: int,
               windows: int, b_at, a_at) -> torch.Tensor:
    """One stage's ring slot as the kernel's copies leave it (float64 elements, NaN where
    nothing is copied): every token piece (k ``k0 + 8 piece ..``, zeros past T) at
    ``b_at(token, piece)`` and every lane's weight piece (rows from ``row0``, ``a_source``)
    at ``a_at(warp, m-tile, sub, half, lane)``."""
    t = x.shape[0]
    pieces = subs * lay.SUB_K // 8
    smem = torch.full((slot // 2,), float("nan"), dtype=torch.float64)
    for token, piece in itertools.product(range(lay.WINDOW * windows), range(pieces)):
        e = b_at(token, piece) // 2
        src = x[token, k0 + 8 * piece:k0 + 8 * piece + 8] if token < t else torch.zeros(8)
        smem[e:e + 8] = src.double()
    for wp, m, half, sub, lane in itertools.product(range(warps), range(mt_n), range(2),
                                                    range(subs), range(32)):
        row, kk = lay.a_source(wp, m, half, lane, mt_n)
        e = a_at(wp, m, sub, half, lane) // 2
        col = k0 + sub * lay.SUB_K + kk
        smem[e:e + 8] = w[row0 + row, col:col + 8].double()
    return smem


def replay(w: torch.Tensor, x: torch.Tensor, tactic: Tactic, windows: int, *,
           ws: dict | None = None, ws_base: int = 0) -> torch.Tensor:
    """Run the kernel's data path on the CPU: every CTA (tile, split), every stage's copies
    into a slot (pieces of dead windows left NaN, tokens past T zero-filled), the fragment
    reads and MMAs of every warp (live windows only), the partials through the workspace
    in fragment order and the split-order reduction, the output map. Float64 on small
    integers: exact, so any misplaced byte shows (slot bytes nothing copied are NaN).
    ``ws``: the workspace (byte offset -> partials) shared with other token chunks, this
    call's slice starting at ``ws_base``; every offset must fall in that slice
    (``layout.chunk_workspace_bytes``) and be written once."""
    n, k = w.shape
    t = x.shape[0]
    p = tactic.kernel_params(windows)
    warps, mt_n, subs = p["warps"], p["mtiles"], p["stage_k"] // lay.SUB_K
    tile_rows, stage_k, splits = tactic.tile_rows, p["stage_k"], tactic.splits
    tiles = n // tile_rows
    a_bytes = tile_rows * stage_k * 2
    slot = lay.slot_bytes(tile_rows, windows, stage_k)
    nwin = windows
    kc = k // splits
    ws = {} if ws is None else ws
    out = torch.full((t, n), float("nan"), dtype=torch.float64)
    for block in range(tiles * splits):
        tile, split = block % tiles, block // tiles
        acc = {(wp, m, wn, lane): [0.0] * 4 for wp in range(warps) for m in range(mt_n)
               for wn in range(nwin) for lane in range(32)}
        for stage in range(kc // stage_k):
            k0 = split * kc + stage * stage_k
            smem = _fill_slot(w, x, tile * tile_rows, k0, slot, warps, mt_n, subs, windows,
                              lambda tok, piece: lay.b_offset(tok, piece, subs, a_bytes),
                              lambda wp, m, sub, half, lane: lay.a_offset(wp, m, sub, half, lane,
                                                                          mt_n, subs))
            for wp, sub, m, wn in itertools.product(range(warps), range(subs), range(mt_n),
                                                    range(nwin)):
                for j in range(2):
                    a_regs, b_regs = [], []
                    for lane in range(32):
                        lo = _words(smem, lay.a_offset(wp, m, sub, 0, lane, mt_n, subs))
                        hi = _words(smem, lay.a_offset(wp, m, sub, 1, lane, mt_n, subs))
                        bw = _words(smem, lay.b_read_offset(wn, sub, lane, subs, a_bytes))
                        ar, br = lay.mma_operands(lo, hi, bw, j)
                        a_regs.append(ar)
                        b_regs.append(br)
                    for lane, d in enumerate(_mma(a_regs, b_regs)):
                        c = acc[(wp, m, wn, lane)]
                        acc[(wp, m, wn, lane)] = [c[i] + float(d[i]) for i in range(4)]
        for (wp, m, wn, lane), c in acc.items():
            at = ws_base + lay.ws_offset(split, tile, wp, m, wn, lane, tiles, warps, mt_n, windows)
            assert at not in ws, f"workspace offset {at} written twice"
            assert ws_base <= at < ws_base + lay.chunk_workspace_bytes(splits, n, windows), at
            ws[at] = c
    for tile in range(tiles):
        for wp, m, wn, lane in itertools.product(range(warps), range(mt_n), range(nwin), range(32)):
            total = [0.0] * 4
            for split in range(splits):  # split order
                part = ws[ws_base + lay.ws_offset(split, tile, wp, m, wn, lane, tiles, warps,
                                                  mt_n, windows)]
                total = [total[i] + part[i] for i in range(4)]
            _store_fragment(out, t, tile * tile_rows, (wp, m, wn, lane), total, mt_n)
    return out


@pytest.mark.parametrize("tactic,tokens", [
    (Tactic(warps=1, mtiles=1, splits=1), 3),
    (Tactic(warps=2, mtiles=2, splits=2), 8),
    (Tactic(warps=1, mtiles=2, splits=3, stage_k=128), 13),
    (Tactic(warps=2, mtiles=1, splits=1), 33),
], ids=lambda v: v.label() if isinstance(v, Tactic) else str(v))
def test_data_path_replay_is_exact(tactic, tokens):
    """Integer weights and tokens (exact in BF16 and float64): the replayed kernel equals
    the float64 product bit for bit, every output written once, no slot byte read that
    nothing copied (NaN)."""
    g = torch.Generator().manual_seed(tokens)
    windows = lay.windows_for(tokens)
    n = 2 * tactic.tile_rows
    k = tactic.splits * tactic.stage_k * 2
    w = torch.randint(-8, 9, (n, k), generator=g).to(torch.bfloat16)
    x = torch.randint(-8, 9, (tokens, k), generator=g).to(torch.bfloat16)
    got = replay(w, x, tactic, windows)
    want = x.double() @ w.double().T
    assert torch.equal(got, want)


def replay_chunked(w: torch.Tensor, x: torch.Tensor, tactic: Tactic) -> torch.Tensor:
    """A call of ``T = len(x)`` rows as the chunked kernel runs it: the weight padded to
    ``layout.padded_rows`` with zero rows, every token chunk (``layout.token_chunks``) a
    :func:`replay` of its rows (``chunk_first_row``) with its slice of one shared workspace
    (``chunk_workspace_offset``) and its tile counters (``chunk_counter``), the padding
    columns never stored. Checks on the way: every chunk has rows, the chunks cover the
    call's rows once, no workspace byte or tile counter is shared by two (chunk, tile)s and
    all fit what ``DenseGemm`` allocates."""
    n, k = w.shape
    t = x.shape[0]
    rows = lay.padded_rows(n)
    padded = torch.zeros(rows, k, dtype=w.dtype)
    padded[:n] = w
    chunks, windows = lay.token_chunks(t)
    tiles = rows // tactic.tile_rows
    ws, counters, covered = {}, set(), []
    out = torch.full((t, n), float("nan"), dtype=torch.float64)
    for c in range(chunks):
        row0 = lay.chunk_first_row(c, windows)
        live = min(t - row0, lay.WINDOW * windows)
        assert live > 0, f"chunk {c} of {chunks} has no rows (T={t}, {windows} windows)"
        covered += range(row0, row0 + live)
        base = lay.chunk_workspace_offset(c, tactic.splits, rows, windows)
        part = replay(padded, x[row0:row0 + live], tactic, windows, ws=ws, ws_base=base)
        out[row0:row0 + live] = part[:, :n]  # the kernel stores columns < N only
        for tile in range(tiles):
            index = lay.chunk_counter(c, tiles, tile)
            assert index not in counters, f"tile counter {index} shared"
            counters.add(index)
    assert covered == list(range(t))
    assert max(counters) < chunks * rows // 16  # DenseGemm's counters
    assert max(ws) < lay.chunk_workspace_bytes(tactic.splits, rows, chunks * windows)
    return out


@pytest.mark.parametrize("tactic,n,tokens", [
    (Tactic(warps=1, mtiles=1, splits=2), 40, 70),     # 2 chunks of 5 windows, 24 padding rows
    (Tactic(warps=1, mtiles=2, splits=1), 64, 130),    # 3 chunks of 6 windows, no padding
    (Tactic(warps=2, mtiles=1, splits=3), 100, 65),    # 2 chunks: 40 rows + 25
], ids=lambda v: v.label() if isinstance(v, Tactic) else str(v))
def test_chunked_data_path_replay_is_exact(tactic, n, tokens):
    """Integer data: the chunked launch (token chunks, padded rows) replayed on the CPU
    equals the float64 product bit for bit, every output written once."""
    g = torch.Generator().manual_seed(n + tokens)
    k = tactic.splits * tactic.stage_k
    w = torch.randint(-8, 9, (n, k), generator=g).to(torch.bfloat16)
    x = torch.randint(-8, 9, (tokens, k), generator=g).to(torch.bfloat16)
    assert torch.equal(replay_chunked(w, x, tactic), x.double() @ w.double().T)


def test_token_chunks_arithmetic():
    """``token_chunks``: ``ceil(T / 64)`` chunks, every chunk of one window count (at most
    8), the chunks covering T rows with a non-empty last chunk and fewer than 8 zero-filled
    slots per chunk; one chunk of ``windows_for(T)`` windows up to 64 rows."""
    assert [lay.token_chunks(t) for t in (1, 8, 9, 64, 65, 80, 81, 128, 129, 257, 1024)] == \
        [(1, 1), (1, 1), (1, 2), (1, 8), (2, 5), (2, 5), (2, 6), (2, 8), (3, 6), (5, 7), (16, 8)]
    for t in range(1, lay.MAX_CALL_TOKENS + 1):
        chunks, windows = lay.token_chunks(t)
        assert chunks == -(-t // lay.MAX_TOKENS) and 1 <= windows <= lay.MAX_WINDOWS
        per = lay.WINDOW * windows
        assert (chunks - 1) * per < t <= chunks * per, t
        assert per * chunks - t < lay.WINDOW * chunks, t  # < 8 dead token slots per chunk
        if t <= lay.MAX_TOKENS:
            assert (chunks, windows) == (1, lay.windows_for(t))
    for bad in (0, lay.MAX_CALL_TOKENS + 1, 65.0, True, "65"):
        with pytest.raises(ValueError, match=r"tokens must be an int in \[1, 4096\]"):
            lay.token_chunks(bad)
    assert [lay.padded_rows(r) for r in (1, 64, 65, 280, 560, 1120, 4480)] == \
        [64, 64, 128, 320, 576, 1152, 4480]
    for bad in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="rows must be a positive int"):
            lay.padded_rows(bad)
    assert lay.chunk_workspace_offset(3, 2, 128, 5) == 3 * lay.chunk_workspace_bytes(2, 128, 5)
    assert lay.chunk_first_row(2, 5) == 80 and lay.chunk_counter(2, 7, 3) == 17


def test_chunked_kernel_params_only_when_needed():
    """A call launches the chunked kernel for more than 64 rows or a padded weight, else the
    single-chunk kernel with the parameters (and cache key) it always had."""
    from fast.gemm.host import launch_for

    one = launch_for(7168, 3584, 64)
    assert "chunked" not in one.params and one.chunks == 1 and one.windows == 8
    assert one.params == one.tactic.kernel_params(8)
    wide = launch_for(7168, 3584, 65)
    assert wide.params["chunked"] is True and (wide.chunks, wide.windows) == (2, 5)
    padded = launch_for(560, 7168, 8, splits=8)
    assert padded.params["chunked"] is True and padded.chunks == 1
    assert padded.grid == 576 // padded.tactic.tile_rows * 8
    with pytest.raises(ValueError, match=r"N=560 \(padded to 576 rows\) is not a multiple of the "
                                         r"tactic's 128-row tile"):
        launch_for(560, 7168, 100, tactic=Tactic(warps=4, mtiles=2, splits=1))
    with pytest.raises(ValueError, match="K=7168 is not a multiple of splits \\* stage_k = 3 \\* 64"):
        launch_for(560, 7168, 100, tactic=Tactic(warps=2, mtiles=2, splits=3))
    four = Tactic(warps=2, mtiles=4, splits=1)  # 4 m-tiles x 5 windows fit the registers, x 6 not
    assert launch_for(512, 512, 65, tactic=four).windows == 5
    with pytest.raises(ValueError, match="does not serve 81 tokens"):
        launch_for(512, 512, 81, tactic=four)


@pytest.mark.parametrize("windows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 2, 64), (4, 2, 128), (8, 2, 64), (4, 4, 64)])
def test_slot_maps_tile_a_slot(shape, windows):
    """The weight pieces and the token pieces of one stage cover the ring slot exactly once,
    and every lane's fragment reads land on pieces that were copied."""
    warps, mtiles, stage_k = shape
    subs = stage_k // lay.SUB_K
    tile_rows = 16 * warps * mtiles
    a_bytes = tile_rows * stage_k * 2
    offsets = [lay.a_offset(wp, m, sub, half, lane, mtiles, subs) for wp, m, sub, half, lane in
               itertools.product(range(warps), range(mtiles), range(subs), range(2), range(32))]
    offsets += [lay.b_offset(tok, piece, subs, a_bytes) for tok in range(8 * windows)
                for piece in range(stage_k // 8)]
    assert sorted(offsets) == list(range(0, lay.slot_bytes(tile_rows, windows, stage_k), 16))
    reads = {lay.b_read_offset(wn, sub, lane, subs, a_bytes) for wn in range(windows)
             for sub in range(subs) for lane in range(32)}
    assert reads <= set(offsets)
    # the piece lane l reads for window wn, sub-chunk c is token 8 wn + l // 4, piece 4c + l % 4
    for wn, sub, lane in itertools.product(range(windows), range(subs), range(32)):
        assert lay.b_read_offset(wn, sub, lane, subs, a_bytes) == lay.b_offset(
            8 * wn + lane // 4, 4 * sub + lane % 4, subs, a_bytes)


def test_workspace_map_is_dense():
    """Fragment-order partials of every (split, tile, warp, m-tile, window, lane) fill the
    workspace the host allocates (``splits * N * windows * 8`` floats) once each."""
    warps, mtiles, windows, tiles, splits = 2, 2, 4, 3, 3
    offsets = [lay.ws_offset(s, t, wp, m, wn, lane, tiles, warps, mtiles, windows)
               for s, t, wp, m, wn, lane in itertools.product(
                   range(splits), range(tiles), range(warps), range(mtiles), range(windows), range(32))]
    n = tiles * 16 * warps * mtiles
    assert sorted(offsets) == list(range(0, splits * n * windows * 8 * 4, 16))


# --- tactics ------------------------------------------------------------------------------


def test_tactics_and_windows():
    assert [lay.windows_for(t) for t in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 3, 4, 5, 8]
    for bad in (0, 65, 1.0, True):
        with pytest.raises(ValueError, match="tokens must be"):
            lay.windows_for(bad)
    with pytest.raises(ValueError, match="warps must be"):
        Tactic(warps=3)
    with pytest.raises(ValueError, match="splits must be"):
        Tactic(splits=0)
    with pytest.raises(ValueError, match="stage_k"):
        Tactic(stage_k=96)
    with pytest.raises(ValueError, match="do not fit"):
        Tactic(warps=8, mtiles=2, occupancy=2, ring=8).kernel_params(8)
    assert Tactic(mtiles=4).serves(40) and not Tactic(mtiles=4).serves(41)
    assert Tactic(mtiles=2).serves(64)


def test_default_tactics_fit_their_shapes():
    """Every candidate and default tactic of the layer's four shapes divides N into tiles
    and K into ``splits * stage_k``, fits shared memory at every window count it serves,
    and launches at most one wave of CTAs on a 132-multiprocessor H200; each bucket's
    default serves every batch of the bucket, and the buckets cover 1..64."""
    from fast.gemm.host import CANDIDATES, DEFAULT_TACTICS, choose_tactic

    assert set(DEFAULT_TACTICS) == set(CANDIDATES)
    for (n, k), cands in CANDIDATES.items():
        for t in list(cands) + list(DEFAULT_TACTICS[(n, k)].values()):
            assert n % t.tile_rows == 0 and k % (t.splits * t.stage_k) == 0, (n, k, t)
            for windows in range(1, lay.MAX_WINDOWS + 1):
                if t.mtiles * windows > lay.MAX_ACCUMULATORS:
                    with pytest.raises(ValueError, match="accumulator tiles"):
                        t.kernel_params(windows)
                    continue
                params = t.kernel_params(windows)
                assert n // t.tile_rows * t.splits <= 132 * params["occupancy"], (n, k, t)
        assert set(DEFAULT_TACTICS[(n, k)].values()) <= set(cands), (n, k)
        assert max(DEFAULT_TACTICS[(n, k)]) == lay.MAX_TOKENS
        for tokens in range(1, lay.MAX_TOKENS + 1):
            assert choose_tactic(n, k, tokens).serves(tokens), (n, k, tokens)


def test_default_tactics_one_split_per_shape():
    """The default tactic of a shape sums every output element in one order at every batch
    (what the layers' batch invariance rests on): one ``splits`` per shape over T = 1..64,
    in the measured table and in the fallback rule, on an H200 and on a 148-multiprocessor
    GPU alike."""
    from fast.gemm.host import DEFAULT_TACTICS, choose_tactic, splits_of

    shapes = list(DEFAULT_TACTICS) + [(512, 256), (768, 512), (256, 256), (15872, 3584)]
    for n, k in shapes:
        for sms in (132, 148):
            got = {choose_tactic(n, k, t, sms).splits for t in range(1, lay.MAX_TOKENS + 1)}
            assert got == {splits_of(n, k, sms)}, (n, k, sms, got)


def test_weight_checked_before_anything_runs():
    from fast.gemm import DenseGemm

    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        DenseGemm([[1.0]])
    with pytest.raises(ValueError, match="2-D bfloat16"):
        DenseGemm(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        DenseGemm(torch.zeros(64, 64, dtype=torch.bfloat16))


def test_arguments_refused_by_name_before_the_device():
    """Every argument of ``DenseGemm`` is checked before anything touches a device (a CPU
    weight reaches the device check only when everything else is right): the weight's K
    (a multiple of 64; any N > 0, padded), ``max_tokens`` (1..4096: token chunks),
    ``splits`` (dividing K into stages of 64) and ``pdl``."""
    from fast.gemm import DenseGemm

    w = torch.zeros(40, 128, dtype=torch.bfloat16)  # 40 rows: padded, not refused
    with pytest.raises(ValueError, match=r"\[N, K\] = \[40, 96\] needs N > 0 and K a positive "
                                         r"multiple of 64"):
        DenseGemm(torch.zeros(40, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs N > 0"):
        DenseGemm(torch.zeros(0, 128, dtype=torch.bfloat16))
    for bad in (0, lay.MAX_CALL_TOKENS + 1, True, 64.0):
        with pytest.raises(ValueError, match=r"max_tokens must be an int in \[1, 4096\]"):
            DenseGemm(w, max_tokens=bad)
    for bad in (0, 3, 4, True, 2.0):  # K = 128: 1 or 2 splits of whole 64-wide stages
        with pytest.raises(ValueError, match=r"splits must be None or a positive int dividing "
                                             r"K=128 into multiples of 64"):
            DenseGemm(w, splits=bad)
    with pytest.raises(ValueError, match="pdl must be None, True or False"):
        DenseGemm(w, pdl="auto")
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        DenseGemm(w, max_tokens=1024, splits=2)


#: The wide layer's GEMM shapes ``(N, K)`` at TP 1..16 of the real layer (router + latent
#: rows, shared gate/up, shared down, up columns: ``fast.schedules.wide_gemms``).
def _wide_shapes():
    from fast.schedules.wide_gemms import gemm_shapes
    from model.config import LatentMoEConfig

    c = LatentMoEConfig.kimi_k3()
    return sorted({shape for n in (1, 2, 4, 8, 16) for shape in gemm_shapes(c, n).values()})


def test_splits_for_rows_rule():
    """``splits_for_rows``: at the given row count the CTAs (64-row tiles x splits x token
    chunks) reach the multiprocessors, or K allows no more; one split fewer would not
    reach them. The TP8 wide rank's splits: front 8, shared gate/up 4, shared down 1, up 8."""
    from fast.gemm.host import splits_for_rows

    assert [splits_for_rows(n, k, 65) for n, k in ((560, 7168), (1536, 7168), (7168, 768),
                                                   (896, 3584))] == [8, 4, 1, 8]
    for n, k in _wide_shapes():
        for sms in (132, 148):
            s = splits_for_rows(n, k, 65, sms)
            ctas = lay.padded_rows(n) // 64 * lay.token_chunks(65)[0]
            assert k % (s * 64) == 0
            assert ctas * s >= sms or k % (2 * s * 64), (n, k, s)
            assert s == 1 or ctas * s // 2 < sms, (n, k, s)


def test_default_tactic_one_split_at_every_row_count():
    """At a fixed ``splits`` the default tactic keeps it at every T = 1..1024 (the tile may
    change with T, the order may not) and serves T; the DEP shapes without ``splits`` keep
    their table's split above 64 rows too (``splits_of``)."""
    from fast.gemm.host import DEFAULT_TACTICS, choose_tactic, splits_for_rows, splits_of

    for n, k in _wide_shapes():
        rows = lay.padded_rows(n)
        s = splits_for_rows(n, k, 65)
        tactics = {choose_tactic(rows, k, t, 132, s) for t in range(1, 1025)}
        assert {t.splits for t in tactics} == {s}, (n, k)
        assert all(rows % t.tile_rows == 0 for t in tactics)
        assert all(choose_tactic(rows, k, t, 132, s).serves(t) for t in range(1, 1025))
    for n, k in DEFAULT_TACTICS:
        assert {choose_tactic(n, k, t).splits for t in range(1, 1025)} == {splits_of(n, k)}


# --- every kernel shape compiles ----------------------------------------------------------


def _shapes():
    """(arch, kernel parameters): every kernel shape of every candidate tactic at every
    window count it serves for sm_90a (the H200); for sm_100a / sm_103a at its smallest and
    largest window count (the same code instantiated over a compile-time window count, at a
    third of the CPU time)."""
    import dataclasses

    from fast.gemm.host import CANDIDATES, WGMMA_TILES, kernel_shapes

    shapes = {dataclasses.replace(t, splits=1) for cands in CANDIDATES.values() for t in cands}
    cases = []
    for shape in sorted(shapes, key=lambda t: t.label()):
        params = kernel_shapes([shape])
        cases += [("sm_90a", q) for q in params if ("sm_90a", q) not in cases]
        for arch in backend.TARGETS[1:]:
            cases += [(arch, q) for q in (params[0], params[-1]) if (arch, q) not in cases]
    # the warpgroup-MMA tiles choose_tactic gives a DenseFront(invariant_mma="wgmma"), and
    # with invariant_overlap
    tiles = list(WGMMA_TILES) + [dataclasses.replace(t, overlap=True) for t in WGMMA_TILES]
    cases += [("sm_90a", q) for q in kernel_shapes(tiles) if ("sm_90a", q) not in cases]
    return cases


#: The row count from which the compile set's serial-splits kernels are launched.
SERIAL_FROM = 129


def _chunked_shapes():
    """(arch, kernel parameters): every chunked kernel the wide layer's batch-invariant
    mode compiles at TP 1..16 of the real layer (both ``INVARIANT_MMAS``) and of the small
    test configs (``fast.schedules.wide_gemms.kernel_params`` over 65..wide_rows rows, and
    65..256 at the small widths) for sm_90a; for sm_100a / sm_103a each ``mma.sync`` tile's
    smallest and largest window count (as ``_shapes``)."""
    import dataclasses

    from fast.gemm.mma_kind import INVARIANT_MMAS
    from fast.schedules.wide_gemms import check_fast_gemm_shapes, kernel_params
    from model.config import LatentMoEConfig

    real, small = LatentMoEConfig.kimi_k3(), LatentMoEConfig.small()
    wide16 = dataclasses.replace(small, intermediate=1024, shared_intermediate=1024)
    params = []
    for cfg, ranks, top, mma in ([(real, n, real.wide_rows, m) for m in INVARIANT_MMAS
                                  for n in (1, 2, 4, 8, 16)]
                                 + [(small, n, 256, "mma.sync") for n in (1, 2, 4)]
                                 + [(wide16, n, 256, "mma.sync") for n in (8, 16)]):
        check_fast_gemm_shapes("test", cfg, ranks)
        params += [p for p in kernel_params(cfg, ranks, range(cfg.front_max + 1, top + 1),
                                            mma=mma)
                   if p not in params]
    for mma in INVARIANT_MMAS:  # serial splits (invariant_serial_from), TP8 of the real layer
        params += [p for p in kernel_params(real, 8, range(real.front_max + 1, real.wide_rows + 1),
                                            mma=mma, serial_from=SERIAL_FROM)
                   if p not in params]
    for serial_from in (None, SERIAL_FROM):  # invariant_overlap, TP8 of the real layer
        params += [p for p in kernel_params(real, 8, range(real.front_max + 1, real.wide_rows + 1),
                                            mma="wgmma", serial_from=serial_from, overlap=True)
                   if p not in params]
    cases = [("sm_90a", p) for p in params]
    blackwell = [p for p in params if not p.get("wgmma")]  # the warpgroup MMA is sm_90a's
    for arch in backend.TARGETS[1:]:
        for tile in sorted({(p["warps"], p["mtiles"]) for p in blackwell}):
            mine = sorted((p for p in blackwell if (p["warps"], p["mtiles"]) == tile),
                          key=lambda p: p["windows"])
            cases += [(arch, p) for p in (mine[0], mine[-1]) if (arch, p) not in cases]
    return cases


def test_chunked_shapes_cover_the_wide_layer():
    """The chunked kernels compiled below are every one the wide layer's batch-invariant
    mode launches: 64- and 128-row tiles, 5 to 8 windows per chunk (65..1024 rows), the
    chunked variant only."""
    params = [p for arch, p in _chunked_shapes() if arch == "sm_90a"]
    assert all(p.get("chunked") for p in params)
    for wgmma in (False, True):
        mine = [p for p in params if bool(p.get("wgmma")) == wgmma]
        assert {p["windows"] for p in mine} == {5, 6, 7, 8}
        assert {16 * p["warps"] * p["mtiles"] for p in mine} == {64, 128}
    assert all(p["warps"] == 4 for p in params if p.get("wgmma"))
    assert not any(p.get("wgmma") for arch, p in _chunked_shapes() if arch != "sm_90a")
    for wgmma in (False, True):  # the serial-splits kernels of both kinds
        assert any(p.get("serial") and bool(p.get("wgmma")) == wgmma for p in params)
    assert any(p.get("serial") for arch, p in _chunked_shapes() if arch != "sm_90a")


def test_wide_gemms_one_mma_kind_and_split_at_every_row_count():
    """``invariant_mma``: every launch of a wide GEMM at 65..1024 rows has the GEMM's one K
    split and the chosen MMA kind (the two fields that fix a token's bits), and a kind
    that is not one of ``INVARIANT_MMAS`` is refused by name."""
    from fast.gemm.mma_kind import INVARIANT_MMAS
    from fast.schedules.wide_gemms import gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    splits = gemm_splits(cfg, 8)
    for mma in INVARIANT_MMAS:
        for name, per_t in gemm_launches(cfg, 8, range(65, cfg.wide_rows + 1), mma=mma).items():
            assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} == \
                {(splits[name], mma == "wgmma")}, (name, mma)
    with pytest.raises(ValueError, match="invariant_mma must be one of"):
        gemm_launches(cfg, 8, [65], mma="hmma")


def test_serial_splits_launch_one_cta_per_tile_with_the_same_split():
    """``Tactic(serial=True)``: the same ``splits`` (the summation order) with one CTA per
    tile and chunk instead of per (tile, split), no workspace; its label and kernel
    parameters say so (the other kernels' parameters unchanged); twice the accumulator
    tiles per warp, bounded by ``MAX_ACCUMULATORS_SERIAL``; the wide layer's launches from
    ``serial_from`` rows are serial, below it as before, one K split and one MMA kind at
    every row count either way."""
    import dataclasses

    from fast.gemm.host import choose_tactic, launch_for
    from fast.gemm.layout import MAX_ACCUMULATORS_SERIAL, Tactic, token_chunks
    from fast.gemm.mma_kind import INVARIANT_MMAS
    from fast.schedules.wide_gemms import gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    t = Tactic(warps=4, mtiles=2, splits=8, wgmma=True, serial=True)
    assert t.label() == "r128w4s8,wgmma,serial"
    assert t.kernel_params(8, chunked=True)["serial"] is True
    assert "serial" not in dataclasses.replace(t, serial=False).kernel_params(8, chunked=True)
    assert t.tiles_per_warp(8) == 32 == MAX_ACCUMULATORS_SERIAL and t.serves(1024)
    assert not Tactic(mtiles=4, serial=True).serves(1024)  # 2 x 4 x 8 tiles
    with pytest.raises(ValueError, match="Tactic.serial must be a bool"):
        Tactic(serial=1)
    cross = launch_for(576, 7168, 1024, splits=8, wgmma=True)
    serial = launch_for(576, 7168, 1024, splits=8, wgmma=True, serial=True)
    assert serial.tactic.splits == cross.tactic.splits == 8 and serial.tactic.serial
    assert serial.grid == 576 // serial.tactic.tile_rows  # tiles only
    assert cross.grid == 576 // cross.tactic.tile_rows * 8
    assert serial.chunks == cross.chunks == token_chunks(1024)[0]
    # serial CTAs are tiles x chunks: the 128-row tile only where those still fill the GPU
    assert choose_tactic(576, 7168, 1024, splits=8, serial=True).tile_rows == 64
    assert choose_tactic(1536, 7168, 1024, splits=8, serial=True).tile_rows == 128
    cfg = LatentMoEConfig.kimi_k3()
    splits = gemm_splits(cfg, 8)
    for mma in INVARIANT_MMAS:
        launches = gemm_launches(cfg, 8, range(65, cfg.wide_rows + 1), mma=mma, serial_from=257)
        for name, per_t in launches.items():
            assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} == \
                {(splits[name], mma == "wgmma")}, (name, mma)
            assert all(l.tactic.serial == (t >= 257) for t, l in per_t.items()), (name, mma)


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_serial_kernels_fit_their_registers(tmp_path):
    """The serial-splits kernels that hold the most accumulators (the wide layer's 8-window
    chunks, both MMA kinds, 64- and 128-row tiles, sm_90a) fit their registers at two CTAs
    per multiprocessor without a stack frame (spilled accumulators would stream through
    local memory every MMA step)."""
    params = [p for arch, p in _chunked_shapes()
              if arch == "sm_90a" and p.get("serial") and p["windows"] == 8]
    assert {(bool(p.get("wgmma")), 16 * p["warps"] * p["mtiles"]) for p in params} >= \
        {(False, 128), (True, 128)}
    for p, attrs in zip(params, sm90a_attributes(params, tmp_path)):
        assert attrs["frame"] == 0 and attrs["registers"] <= 65536 // (2 * 32 * p["warps"]), (p, attrs)


def sm90a_attributes(params: list[dict], tmp_path) -> list[dict]:
    """Per kernel parameters, the registers and stack frame of that kernel compiled for
    sm_90a (its cubin in a subprocess, ``tools.sass_budget.kernel_attributes``)."""
    from tools.ptx_dump import run_compile
    from tools.sass_budget import kernel_attributes

    script = ("import sys, ast\nfrom fast.gemm.host import compile_kernel\n"
              "compile_kernel(sys.argv[1], **ast.literal_eval(sys.argv[2]))\n")
    out = []
    for i, p in enumerate(params):
        where = tmp_path / f"k{i}"
        where.mkdir()
        run_compile(script, ["sm_90a", repr(p)], keep="cubin", dump_dir=where)
        (cubin,) = sorted(where.rglob("*.cubin"))
        out.append(kernel_attributes(cubin.read_bytes()))
    return out


def test_wide_layer_refuses_a_bad_serial_from_by_name():
    """``invariant_serial_from``: None or a positive row count, refused by name before any
    device work (``fast.schedules.wide.check_batch_invariant``, both wide layers)."""
    from fast.schedules.wide import check_batch_invariant
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    for bad in (0, -1, True, 1.5, "129"):
        with pytest.raises(ValueError, match="WideLayer: invariant_serial_from must be None or "
                                             "a positive int"):
            check_batch_invariant("WideLayer", cfg, 8, True, "auto", bad)
    for good in (None, 1, 257):
        check_batch_invariant("WideLayer", cfg, 8, True, "auto", good)


def test_wide_gemms_auto_mma_resolves_per_architecture():
    """A layer's default ``invariant_mma="auto"`` is the warpgroup MMA on sm_90a and
    ``mma.sync`` on the Blackwell targets (no wgmma there); a named kind is itself,
    ``"wgmma"`` off sm_90a and ``"auto"`` where a kernel needs a kind are refused by name."""
    from fast.gemm.mma_kind import resolve_mma
    from fast.schedules.wide_gemms import gemm_launches
    from model.config import LatentMoEConfig

    assert resolve_mma("L", "auto", "sm_90a") == "wgmma"
    for arch in ("sm_100a", "sm_103a"):
        assert resolve_mma("L", "auto", arch) == "mma.sync"
        assert resolve_mma("L", "mma.sync", arch) == "mma.sync"
        with pytest.raises(ValueError, match="L: invariant_mma='wgmma' needs an sm_90a GPU"):
            resolve_mma("L", "wgmma", arch)
    assert resolve_mma("L", "mma.sync", "sm_90a") == "mma.sync"
    with pytest.raises(ValueError, match="L: invariant_mma must be one of"):
        resolve_mma("L", "hmma", "sm_90a")
    with pytest.raises(ValueError, match="invariant_mma must be one of"):
        gemm_launches(LatentMoEConfig.kimi_k3(), 8, [65], mma="auto")


def test_dep_dense_mode_resolves_kind_and_overlap():
    """``resolve_dense_mode`` (the DEP layers' ``invariant_mma`` / ``invariant_overlap``):
    ``"auto"`` is the warpgroup MMA with MMAs in flight in the batch-invariant mode on
    sm_90a, ``mma.sync`` without them elsewhere and outside the mode (the default backends'
    measured kind); a named kind is itself; a bool overlap is itself, True refused on
    ``mma.sync``; anything else refused by name."""
    from fast.gemm.mma_kind import resolve_dense_mode

    assert resolve_dense_mode("L", True, "auto", None, "sm_90a") == ("wgmma", True)
    assert resolve_dense_mode("L", True, "auto", False, "sm_90a") == ("wgmma", False)
    assert resolve_dense_mode("L", False, "auto", None, "sm_90a") == ("mma.sync", False)
    assert resolve_dense_mode("L", True, "mma.sync", None, "sm_90a") == ("mma.sync", False)
    assert resolve_dense_mode("L", False, "wgmma", None, "sm_90a") == ("wgmma", True)
    for arch in ("sm_100a", "sm_103a"):
        assert resolve_dense_mode("L", True, "auto", None, arch) == ("mma.sync", False)
        with pytest.raises(ValueError, match="L: invariant_mma='wgmma' needs an sm_90a GPU"):
            resolve_dense_mode("L", True, "wgmma", None, arch)
    with pytest.raises(ValueError, match="L: invariant_overlap=True keeps warpgroup MMAs"):
        resolve_dense_mode("L", True, "mma.sync", True, "sm_90a")
    with pytest.raises(ValueError, match="L: invariant_overlap must be None or a bool"):
        resolve_dense_mode("L", True, "auto", 1, "sm_90a")
    with pytest.raises(ValueError, match="L: invariant_mma must be one of"):
        resolve_dense_mode("L", True, "hmma", None, "sm_90a")


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("arch,params", _chunked_shapes(),
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_chunked_kernel_compiles(arch, params):
    """The chunked kernel (token chunks on the grid, padded rows) compiles at every shape
    the wide layer launches, for every target (no GPU needed)."""
    from fast.gemm.host import compile_kernel

    assert compile_kernel(arch, **params) is not None


_PTX = """
import sys, ast
from fast.gemm.host import compile_kernel
compile_kernel("sm_90a", **ast.literal_eval(sys.argv[1]))
"""


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_chunked_kernel_reads_its_chunk(tmp_path):
    """In the PTX the compiler produced: the chunked kernel reads its token chunk from the
    grid's second dimension (``%ctaid.y``) and the single-chunk kernel of the same tile and
    windows does not (its code is the one the DEP layer ran before chunks existed)."""
    from tools.ptx_dump import run_compile

    tactic = Tactic(warps=2, mtiles=2, splits=2)
    texts = {}
    for chunked in (False, True):
        out = tmp_path / str(chunked)
        out.mkdir()
        run_compile(_PTX, [repr(tactic.kernel_params(5, chunked=chunked))], keep="ptx",
                    dump_dir=out)
        ptx = sorted(out.rglob("*SplitKGemmKernel*.ptx"))
        assert ptx, f"no PTX dumped (chunked={chunked})"
        texts[chunked] = ptx[0].read_text()
    assert "%ctaid.y" in texts[True]
    assert "%ctaid.y" not in texts[False]


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("arch,params", _shapes(),
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_kernel_compiles(arch, params):
    """Every kernel shape of every candidate tactic compiles (no GPU needed; ``mma.sync``,
    ``cp.async`` and ``griddepcontrol`` exist on SM90 and SM100)."""
    from fast.gemm.host import compile_kernel

    assert compile_kernel(arch, **params) is not None


# --- the wgmma tactic's data path replayed ------------------------------------------------


def _descriptor_read(smem: torch.Tensor, start: int, stride: int, rows: int):
    """The ``rows`` x 16 matrix a K-major 128-byte-swizzle descriptor (start, stride)
    describes (PTX ISA: element (r, k) at byte ``a = start + (r // 8) stride + (r % 8) 128
    + 2 k`` of the unswizzled layout, then the swizzle of the address the tensor cores
    form: bits 4-6 of ``a`` XOR bits 7-9)."""
    m = torch.empty(rows, 16, dtype=torch.float64)
    for r in range(rows):
        for k in range(16):
            a = start + (r // 8) * stride + (r % 8) * 128 + 2 * k
            m[r, k] = smem[(a ^ (((a >> 7) & 7) << 4)) // 2]
    return m


def replay_wgmma(w: torch.Tensor, x: torch.Tensor, tactic: Tactic, windows: int) -> torch.Tensor:
    """The wgmma tactic's data path on the CPU (one split; the split-K reduction and the
    output map are the ``mma.sync`` path's, replayed by ``replay``): the copies by
    ``a_offset_wgmma`` / ``b_offset_wgmma`` into a NaN slot, per (warpgroup, m-tile, sub,
    step) the descriptors' 64 x 16 and (8 windows) x 16 matrices multiplied, the product's
    rows and columns handed to the warps' accumulators as the PTX D layout of m64nNk16 does
    (warp w of the warpgroup: rows 16 w + g, + 8; columns 8 i + 2 q, + 1), and the
    accumulators written out through ``c_map``."""
    n, k = w.shape
    t = x.shape[0]
    p = tactic.kernel_params(windows)
    warps, mt_n, stage_k = p["warps"], p["mtiles"], p["stage_k"]
    subs, tile_rows = stage_k // lay.SUB_K, tactic.tile_rows
    a_bytes = tile_rows * stage_k * 2
    out = torch.full((t, n), float("nan"), dtype=torch.float64)
    for tile in range(n // tile_rows):
        acc = {(wp, m, wn, lane): [0.0] * 4 for wp in range(warps) for m in range(mt_n)
               for wn in range(windows) for lane in range(32)}
        for stage in range(k // stage_k):
            k0 = stage * stage_k
            smem = _fill_slot(w, x, tile * tile_rows, k0,
                              lay.slot_bytes(tile_rows, windows, stage_k), warps, mt_n, subs,
                              windows, lambda tok, piece: lay.b_offset_wgmma(tok, piece, subs, a_bytes, windows),
                              lambda wp, m, sub, half, lane: lay.a_offset_wgmma(
                                  wp, m, sub, half, lane, mt_n, subs, tile_rows))
            for wg, m, sub, j in itertools.product(range(warps // 4), range(mt_n), range(subs),
                                                   range(2)):
                (sa, ra), (sb, rb) = lay.wgmma_descriptors(wg, m, sub, j, mt_n, subs, a_bytes,
                                                           windows)
                d = _descriptor_read(smem, sa, ra, 64) @ _descriptor_read(smem, sb, rb, 8 * windows).T
                for wq, lane, wn, r in itertools.product(range(4), range(32), range(windows), range(4)):
                    g, q = lane // 4, lane % 4
                    acc[(4 * wg + wq, m, wn, lane)][r] += float(
                        d[16 * wq + g + 8 * (r // 2), 8 * wn + 2 * q + r % 2])
        for (wp, m, wn, lane), c in acc.items():
            _store_fragment(out, t, tile * tile_rows, (wp, m, wn, lane), c, mt_n)
    return out


@pytest.mark.parametrize("tactic,tokens", [
    (Tactic(warps=4, mtiles=1, wgmma=True), 5),
    (Tactic(warps=4, mtiles=2, stage_k=128, wgmma=True), 16),
    (Tactic(warps=8, mtiles=1, wgmma=True), 17),
], ids=lambda v: v.label() if isinstance(v, Tactic) else str(v))
def test_wgmma_data_path_replay_is_exact(tactic, tokens):
    """Integer data: the wgmma tactic's replayed data path equals the float64 product bit
    for bit; NaN (a slot byte nothing copied) would show in any misplaced read."""
    g = torch.Generator().manual_seed(tokens)
    windows = lay.windows_for(tokens)
    n, k = tactic.tile_rows, 2 * tactic.stage_k
    w = torch.randint(-8, 9, (n, k), generator=g).to(torch.bfloat16)
    x = torch.randint(-8, 9, (tokens, k), generator=g).to(torch.bfloat16)
    assert torch.equal(replay_wgmma(w, x, tactic, windows), x.double() @ w.double().T)


@pytest.mark.parametrize("windows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(4, 1, 64), (4, 2, 128), (8, 2, 64)])
def test_wgmma_slot_map_tiles_a_slot(shape, windows):
    """The wgmma tactic's weight and token pieces cover the ring slot exactly once."""
    warps, mtiles, stage_k = shape
    subs = stage_k // lay.SUB_K
    tile_rows = 16 * warps * mtiles
    a_bytes = tile_rows * stage_k * 2
    offsets = [lay.a_offset_wgmma(wp, m, sub, half, lane, mtiles, subs, tile_rows)
               for wp, m, sub, half, lane in itertools.product(
                   range(warps), range(mtiles), range(subs), range(2), range(32))]
    offsets += [lay.b_offset_wgmma(tok, piece, subs, a_bytes, windows) for tok in range(8 * windows)
                for piece in range(stage_k // 8)]
    assert sorted(offsets) == list(range(0, lay.slot_bytes(tile_rows, windows, stage_k), 16))


@pytest.mark.parametrize("shape", [(4, 2, 64), (8, 1, 128)])
def test_wgmma_copies_keep_a_row_in_one_slot_row(shape):
    """Each ``cp.async`` of the wgmma tactic writes the 16-byte pieces of one source row
    into one 128-byte row of the slot (the pieces' order permuted by the swizzle): the
    four lanes of a weight row and the eight pieces of a token's 64 k. Pieces of one row
    sent to several slot rows make the copy one L2 request per lane (measured: 4x the
    requests and 2x the L2 sectors of ``mma.sync``'s copies, the kernel 2.3x slower)."""
    warps, mtiles, stage_k = shape
    subs, windows = stage_k // lay.SUB_K, 3
    tile_rows = 16 * warps * mtiles
    a_bytes = tile_rows * stage_k * 2
    for wp, m, sub, half in itertools.product(range(warps), range(mtiles), range(subs), range(2)):
        rows = {}
        for lane in range(32):
            source = lay.a_source(wp, m, half, lane, mtiles)[0]
            at = lay.a_offset_wgmma(wp, m, sub, half, lane, mtiles, subs, tile_rows)
            rows.setdefault(source, set()).add(at // lay.ROW_BYTES)
        assert all(len(r) == 1 for r in rows.values()) and len(rows) == 8
    for tok in range(8 * windows):
        for block in range(stage_k // 64):
            assert len({lay.b_offset_wgmma(tok, piece, subs, a_bytes, windows) // lay.ROW_BYTES
                        for piece in range(8 * block, 8 * block + 8)}) == 1


def test_wgmma_tactic_checks():
    with pytest.raises(ValueError, match="whole warpgroups"):
        Tactic(warps=2, wgmma=True)
    t = Tactic(warps=4, mtiles=2, wgmma=True)
    assert t.label() == "r128w4s1,wgmma" and t.kernel_params(2)["wgmma"] is True
    assert "wgmma" not in Tactic(warps=4, mtiles=2).kernel_params(2)
    from fast.gemm.host import compile_kernel

    with pytest.raises(ValueError, match="wgmma needs sm_90a"):
        compile_kernel("sm_100a", **t.kernel_params(2))


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("windows", [1, 4, 8])
@pytest.mark.parametrize("tactic", [Tactic(warps=4, mtiles=2, wgmma=True),
                                    Tactic(warps=8, mtiles=2, wgmma=True),
                                    Tactic(warps=4, mtiles=2, wgmma=True, overlap=True)],
                         ids=lambda t: t.label())
def test_wgmma_kernel_compiles(tactic, windows):
    from fast.gemm.host import compile_kernel

    assert compile_kernel("sm_90a", **tactic.kernel_params(windows)) is not None


# --- Tactic.overlap: one stage's warpgroup MMAs in flight -----------------------------------

def test_overlap_tactic_checks():
    """``overlap`` needs ``wgmma`` and a ring of at least 3 stages; its label and kernel
    parameters say so, and the parameters of every other kernel are unchanged."""
    with pytest.raises(ValueError, match="overlap keeps warpgroup MMAs in flight: it needs wgmma"):
        Tactic(warps=4, mtiles=2, overlap=True)
    with pytest.raises(ValueError, match="Tactic.overlap must be a bool"):
        Tactic(warps=4, mtiles=2, wgmma=True, overlap=1)
    t = Tactic(warps=4, mtiles=2, wgmma=True, overlap=True)
    assert t.label() == "r128w4s1,wgmma,overlap" and t.kernel_params(8)["overlap"] is True
    assert "overlap" not in Tactic(warps=4, mtiles=2, wgmma=True).kernel_params(8)
    with pytest.raises(ValueError, match="overlap needs a ring of at least 3 stages, got 2"):
        Tactic(warps=4, mtiles=2, wgmma=True, overlap=True, ring=2).kernel_params(4)
    from fast.gemm.kernel import SplitKGemmKernel

    with pytest.raises(ValueError, match="overlap needs wgmma and a ring of at least 3"):
        SplitKGemmKernel(warps=4, mtiles=2, windows=1, ring=4, overlap=True)
    assert SplitKGemmKernel(warps=4, mtiles=2, windows=1, ring=5, wgmma=True, overlap=True).ahead == 3
    assert SplitKGemmKernel(warps=4, mtiles=2, windows=1, ring=5, wgmma=True).ahead == 4


_SASS = """
import sys, ast
from fast.gemm.host import compile_kernel
compile_kernel("sm_90a", **ast.literal_eval(sys.argv[1]))
"""


def _sass(tmp_path, params: dict) -> list[str]:
    """The instructions (opcode with modifiers and operands) of the kernel of ``params``
    compiled for sm_90a, disassembled by nvdisasm."""
    import subprocess

    from tools.ptx_dump import run_compile
    from tools.sass_budget import nvdisasm

    out = tmp_path / ("o" if params.get("overlap") else "p")
    out.mkdir()
    run_compile(_SASS, [repr(params)], keep="cubin", dump_dir=out)
    cubin = sorted(out.rglob("*SplitKGemmKernel*.cubin"))
    assert cubin, f"no cubin dumped for {params}"
    text = subprocess.run([nvdisasm(), "-c", str(cubin[0])], capture_output=True, text=True,
                          check=True).stdout
    return [line.split("*/", 1)[1].strip().rstrip(";").strip() for line in text.splitlines()
            if line.strip().startswith("/*") and "*/" in line and line.split("*/", 1)[1].strip()]


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("chunked_serial", [False, True], ids=["plain", "chunked-serial"])
def test_overlap_keeps_one_stage_of_mmas_in_flight(tmp_path, chunked_serial):
    """In the machine code ptxas produced: the overlap kernel's stage ends with a wait that
    leaves one MMA group in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), each stage's HGMMAs
    are issued back to back (ptxas did not serialize them: no warpgroup wait between them),
    and every read of the accumulators follows a full wait (``0x0``: after the loop, and
    in the serial form before each fold); the kernel without overlap never leaves a group
    in flight."""
    import dataclasses

    base = (Tactic(warps=4, mtiles=1, splits=8, wgmma=True, serial=True) if chunked_serial
            else Tactic(warps=4, mtiles=2, wgmma=True))
    for overlap in (False, True):
        t = dataclasses.replace(base, overlap=overlap)
        sass = _sass(tmp_path, t.kernel_params(8, chunked=chunked_serial))
        waits = [i for i, s in enumerate(sass) if s.startswith("WARPGROUP.DEPBAR")]
        hgmma = [i for i, s in enumerate(sass) if s.startswith("HGMMA")]
        assert hgmma and waits
        in_flight = [i for i in waits if sass[i].endswith("0x1")]
        assert bool(in_flight) == overlap, (t.label(), [sass[i] for i in waits])
        assert any(sass[i].endswith("0x0") for i in waits)
        # the HGMMAs of a stage: between the first and the last, no warpgroup wait
        first, last = hgmma[0], max(h for h in hgmma if h < (in_flight or waits)[0])
        assert not [i for i in waits if first < i < last], (t.label(), "HGMMAs serialized")


def test_overlap_in_the_wide_layer_and_dense_gemm_rules():
    """``invariant_overlap`` / ``overlap`` through the wide GEMMs: every launch at 65..1024
    rows on wgmma has ``overlap`` with the same K split and kind as without it (so the same
    bits); with ``mma.sync`` it is refused by name (the tactic rule and the layers' check,
    before any device work), and a non-bool too."""
    from fast.gemm.host import choose_tactic
    from fast.gemm.mma_kind import check_overlap
    from fast.schedules.wide import check_batch_invariant
    from fast.schedules.wide_gemms import gemm_launches
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    rows = range(65, cfg.wide_rows + 1, 37)
    plain = gemm_launches(cfg, 8, rows, mma="wgmma", serial_from=257)
    flying = gemm_launches(cfg, 8, rows, mma="wgmma", serial_from=257, overlap=True)
    for name, per_t in flying.items():
        for t, launch in per_t.items():
            base = plain[name][t].tactic
            assert launch.tactic.overlap and launch.params.get("overlap") is True
            assert (launch.tactic.splits, launch.tactic.wgmma, launch.tactic.serial) == \
                (base.splits, base.wgmma, base.serial), (name, t)
            assert launch.grid == plain[name][t].grid and launch.chunks == plain[name][t].chunks
    with pytest.raises(ValueError, match="overlap keeps warpgroup MMAs in flight: it needs wgmma"):
        choose_tactic(576, 7168, 100, overlap=True)
    with pytest.raises(ValueError, match="WideLayer: invariant_overlap=True keeps warpgroup MMAs"):
        check_batch_invariant("WideLayer", cfg, 8, True, "mma.sync", None, True)
    with pytest.raises(ValueError, match="WidePeerLayer: invariant_overlap must be a bool"):
        check_overlap("WidePeerLayer", 1, "wgmma")
    check_batch_invariant("WideLayer", cfg, 8, True, "auto", None, True)  # resolved later
    check_overlap("WideLayer", True, "wgmma")


def test_wide_token_chunks():
    """128-row token chunks (``Tactic.chunk_windows = 16``, warpgroup MMA only): the chunk
    arithmetic at both widths (balanced chunks, fewer than 8 dead token slots per chunk),
    the tactic's checks and label, the default tile (one m-tile per warp; 8 warps at one
    CTA per multiprocessor for 128-row tiles), the same K split as the 64-row chunks at
    every row count, and ``chunk_windows`` refused by name where it cannot run."""
    import dataclasses

    from fast.gemm.host import check_chunk_windows, choose_tactic, launch_for
    from fast.schedules.wide_gemms import gemm_launches
    from model.config import LatentMoEConfig

    assert [lay.token_chunks(t, 16) for t in (1, 64, 65, 128, 129, 256, 257, 1000, 1024)] == \
        [(1, 1), (1, 8), (1, 9), (1, 16), (2, 9), (2, 16), (3, 11), (8, 16), (8, 16)]
    for t in range(1, lay.MAX_CALL_TOKENS + 1):
        chunks, windows = lay.token_chunks(t, 16)
        per = lay.WINDOW * windows
        assert chunks == -(-t // 128) and 1 <= windows <= 16 and (chunks - 1) * per < t <= chunks * per
        assert per * chunks - t < lay.WINDOW * chunks, t
    for bad in (4, 32, True, 16.0):
        with pytest.raises(ValueError, match="chunk_windows must be one of"):
            lay.token_chunks(100, bad)
    t = Tactic(warps=4, mtiles=1, splits=8, wgmma=True, chunk_windows=16)
    assert t.label() == "r64w4s8,wgmma,cw16" and t.chunks(1024) == (8, 16) and t.serves(1024)
    assert t.kernel_params(16, chunked=True)["windows"] == 16
    assert dataclasses.replace(t, serial=True).serves(1024)  # 2 x 16 tiles: the serial bound
    assert not Tactic(warps=4, mtiles=2, wgmma=True, chunk_windows=16).serves(1024)
    with pytest.raises(ValueError, match="windows must be an int in"):
        Tactic(warps=4, mtiles=1, wgmma=True).kernel_params(9)
    with pytest.raises(ValueError, match=r"Tactic: chunk_windows=16 \(128-row token chunks\) needs the warpgroup MMA"):
        Tactic(chunk_windows=16)
    with pytest.raises(ValueError, match=r"Tactic: chunk_windows must be one of \(8, 16\)"):
        Tactic(wgmma=True, chunk_windows=12)
    big = choose_tactic(1536, 7168, 1024, 132, 4, True, False, True, 16)
    assert (big.warps, big.mtiles, big.occupancy, big.chunk_windows) == (8, 1, 1, 16)
    small = choose_tactic(576, 7168, 1024, 132, 8, True, True, True, 16)
    assert (small.tile_rows, small.serial, small.overlap) == (64, True, True)
    assert launch_for(560, 7168, 1024, tactic=small).chunks == 8
    cfg = LatentMoEConfig.kimi_k3()
    rows = range(65, cfg.wide_rows + 1)
    for name, per_t in gemm_launches(cfg, 8, rows, mma="wgmma", chunk_windows=16).items():
        narrow = gemm_launches(cfg, 8, rows, mma="wgmma")[name]
        assert {l.tactic.splits for l in per_t.values()} == {narrow[65].tactic.splits}, name
        assert all(l.tactic.chunk_windows == 16 and l.chunks == -(-t // 128)
                   for t, l in per_t.items()), name
    check_chunk_windows("L", "chunk_windows", 16, True)
    with pytest.raises(ValueError, match=r"L: chunk_windows=16 \(128-row token chunks\) needs the "
                                         r"warpgroup MMA"):
        check_chunk_windows("L", "chunk_windows", 16, False)
    for bad in (0, 12, True, "16"):
        with pytest.raises(ValueError, match=r"L: c must be one of \(8, 16\)"):
            check_chunk_windows("L", "c", bad, True)
    with pytest.raises(ValueError, match="gemm_launches: chunk_windows=16"):
        gemm_launches(cfg, 8, [65], mma="mma.sync", chunk_windows=16)


def _wide_chunk_shapes():
    """Kernel parameters of the TP8 wide rank's GEMMs in 128-row token chunks (65..1024
    rows, warpgroup MMA, cross-CTA and serial splits from 257 rows with the MMAs in flight)."""
    from fast.schedules.wide_gemms import kernel_params
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    params = []
    for serial_from, overlap in ((None, False), (257, True)):
        params += [p for p in kernel_params(cfg, 8, range(65, cfg.wide_rows + 1), mma="wgmma",
                                            serial_from=serial_from, overlap=overlap,
                                            chunk_windows=16) if p not in params]
    return params


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_wide_chunk_kernels_compile_and_fit_their_registers(tmp_path):
    """Every 128-row-chunk kernel of the TP8 wide rank (9..16 windows, sm_90a: the
    warpgroup MMA is Hopper's) compiles, and the largest of each tile and form (16 windows)
    fits its registers at its occupancy without a stack frame."""
    from fast.gemm.host import compile_kernel

    params = _wide_chunk_shapes()
    assert {p["windows"] for p in params} == set(range(9, 17))
    for p in params:
        assert compile_kernel("sm_90a", **p) is not None
    widest = [p for p in params if p["windows"] == 16]
    assert {(p["warps"], bool(p.get("serial"))) for p in widest} >= {(4, False), (8, True)}
    for p, attrs in zip(widest, sm90a_attributes(widest, tmp_path)):
        limit = min(255, 65536 // (p["occupancy"] * 32 * p["warps"]))
        assert attrs["frame"] == 0 and attrs["registers"] <= limit, (p, attrs)


def test_forms_override_the_default_tactic_per_row_count():
    """``DenseGemm(forms=...)`` / the wide layers' ``invariant_forms``: per row count a form
    (chunk width, serial splits, MMAs in flight, stage width) overrides the object's
    settings from its ``rows_from`` to the next key; the K split and the MMA kind are never
    a form's (the same bits); 128-k stages fall back to one CTA per multiprocessor where a
    ring of 3 does not fit; bad tables refused by name."""
    from fast.gemm.host import check_form_stages, check_forms, default_tactic, form_at
    from fast.schedules.wide import check_batch_invariant
    from fast.schedules.wide_gemms import gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    forms = {129: {"serial": True}, 513: {"chunk_windows": 16, "stage_k": 128}}
    assert form_at(forms, 128) == {} and form_at(forms, 129) == {"serial": True}
    assert form_at(forms, 1024) == {"chunk_windows": 16, "stage_k": 128} and form_at(None, 9) == {}
    plain = default_tactic(576, 7168, 1024, 132, 8, True, None, True, 8, None)
    formed = default_tactic(576, 7168, 1024, 132, 8, True, None, True, 8, forms)
    assert (formed.splits, formed.wgmma, formed.overlap) == (plain.splits, True, True)
    assert (formed.chunk_windows, formed.stage_k, formed.serial) == (16, 128, False)
    assert default_tactic(576, 7168, 200, 132, 8, True, None, False, 8, forms).serial
    assert formed.kernel_params(16)["ring"] >= 3
    cfg = LatentMoEConfig.kimi_k3()
    gemm_forms = {"front": forms, "up": {65: {"serial": True, "overlap": False}}}
    splits = gemm_splits(cfg, 8)
    launches = gemm_launches(cfg, 8, range(65, 1025, 37), mma="wgmma", overlap=True,
                             forms=gemm_forms)
    for name, per_t in launches.items():
        assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} == {(splits[name], True)}
    assert all(l.tactic.serial and not l.tactic.overlap for l in launches["up"].values())
    assert all(l.tactic.overlap for l in launches["shared_down"].values())
    for bad, match in (
            ([1], r"forms must be None or a dict"),
            ({0: {}}, r"forms's keys must be positive ints"),
            ({65: {"splits": 2}}, r"forms\[65\] must be a dict with keys among"),
            ({65: {"serial": 1}}, r"forms\[65\]\['serial'\] must be a bool"),
            ({65: {"stage_k": 96}}, r"forms\[65\]\['stage_k'\] must be 64 or 128"),
            ({65: {"chunk_windows": 12}}, r"forms\[65\]\['chunk_windows'\] must be one of")):
        with pytest.raises(ValueError, match="L: " + match):
            check_forms("L", "forms", bad, True)
    with pytest.raises(ValueError, match=r"L: f\[65\]\['overlap'\]=True keeps warpgroup MMAs"):
        check_forms("L", "f", {65: {"overlap": True}}, False)
    with pytest.raises(ValueError, match=r"stage_k'\]=128 does not divide the 8 splits of K=3584"):
        check_form_stages("L", "f", {65: {"stage_k": 128}}, 3584, 8)
    with pytest.raises(ValueError, match=r"WideLayer: invariant_forms must be None, 'auto' or a dict keyed"):
        check_batch_invariant("WideLayer", cfg, 8, True, "auto", None, False, 8, {"router": {}})
    with pytest.raises(ValueError, match=r"WideLayer: invariant_forms\['up'\]\[65\]\['stage_k'\]=128"):
        check_batch_invariant("WideLayer", cfg, 8, True, "auto", None, False, 8,
                              {"up": {65: {"stage_k": 128}}})
    with pytest.raises(ValueError, match=r"invariant_forms\['front'\]\[65\]\['overlap'\]=True"):
        check_batch_invariant("WideLayer", cfg, 8, True, "mma.sync", None, False, 8,
                              {"front": {65: {"overlap": True}}})


def test_tiled_forms_hand_their_rows_to_the_tiled_kernel():
    """A form ``{"tiled": {...}}`` (``fast.gemm.host.TILED_KEYS``): from its ``rows_from``
    to the next key those calls run ``fast.gemm.TiledGemm`` (the same K split, the warpgroup
    MMA's bits), so ``gemm_launches`` leaves those rows out and keeps the split-K kernel's
    around them; it needs the warpgroup MMA, takes no split-K key beside it, and a bad
    entry is refused by name."""
    from fast.gemm.host import check_forms, form_at
    from fast.schedules.wide_gemms import gemm_launches
    from model.config import LatentMoEConfig

    tiled = {"tiled": {"tile_tokens": 64, "stages": 4, "cross": True, "producer": True}}
    forms = {"front": {257: tiled, 769: {"serial": True}}}
    check_forms("L", "f", forms["front"], True)
    assert form_at(forms["front"], 300) == tiled
    launches = gemm_launches(LatentMoEConfig.kimi_k3(), 8, (65, 256, 257, 768, 769, 1024),
                             mma="wgmma", forms=forms)
    assert sorted(launches["front"]) == [65, 256, 769, 1024]
    assert launches["front"][769].tactic.serial
    assert sorted(launches["up"]) == [65, 256, 257, 768, 769, 1024]
    for bad, wgmma, match in (
            ({65: {"tiled": {}}}, False, r"\['tiled'\]: a tiled form runs fast.gemm.TiledGemm"
                                         r".*needs wgmma=True"),
            ({65: {"tiled": {}, "serial": True}}, True, r": a tiled form takes no other key"),
            ({65: {"tiled": {"tile": 64}}}, True, r"\['tiled'\] must be a dict with keys among"),
            ({65: {"tiled": {"tile_tokens": 72}}}, True,
             r"\['tiled'\]\['tile_tokens'\] must be a multiple of 16 in 32..160"),
            ({65: {"tiled": {"stages": 1}}}, True, r"\['tiled'\]\['stages'\] must be an int in"),
            ({65: {"tiled": {"cross": 1}}}, True, r"\['tiled'\]\['cross'\] must be a bool"),
            ({65: {"tiled": {"tile_tokens": 160, "producer": True}}}, True,
             r"\['tiled'\]: a producer warp takes tile_tokens up to 144"),
            ({65: {"tiled": {"pdl": True}}}, True,
             r"\['tiled'\]: pdl \(programmatic dependent launch\) is the persistent form's"),
            ({65: {"tiled": {"cross": True, "persistent": True}}}, True,
             r"\['tiled'\]: cross and persistent are two forms")):
        with pytest.raises(ValueError, match=r"L: f\[65\]" + match):
            check_forms("L", "f", bad, wgmma)

