"""``invariant_forms="auto"``: the per-GEMM forms a batch-invariant wide rank takes by name.

``TP8_FORMS`` is the fastest form or tiled variant of each of the TP8 rank's four GEMMs at
each timed row count (``{gemm: {rows_from: form}}``, ``fast.gemm.DenseGemm``'s ``forms``):
the tiled kernel (``fast.gemm.TiledGemm``) at every row count for the front and the shared
expert's two GEMMs, from 257 rows for the up projection, thread-block clusters from 257
rows. It was measured on one H100 at commit 13887b8 (``benchmarks.wide_gemm_table
--rows 256,512,1024``: each GEMM alone at its K split; the table's ``best_forms``;
``tests/test_wide_forms.py`` holds it to the committed result it came from). A form moves
no bit (the K split and the MMA kind are not a form's), so a table measured on another
Hopper part is a speed choice there, never a correctness one.

:func:`resolve_forms` gives the table where it was measured for: a rank whose four GEMMs
have the shapes and K splits of the real dimensions at 8 ranks (``LatentMoEConfig.
kimi_k3()``), on sm_90a with the warpgroup MMA, built without the layer arguments that name
a form of their own (``invariant_serial_from``, ``invariant_overlap``,
``invariant_chunk_windows``); anywhere else "auto" is no forms (the split-K kernel's default
tactics, shaped by those arguments). "auto" is the wide layers' default.
"""

from __future__ import annotations

from model.config import LatentMoEConfig

__all__ = ["TP8_FORMS", "resolve_forms"]


def _tiled(tokens: int, stages: int, cross: bool, producer: bool, cluster=(1, 1)) -> dict:
    options = {"tile_tokens": tokens, "stages": stages, "cross": cross, "producer": producer}
    if cluster != (1, 1):
        options["cluster"] = cluster
    return {"tiled": options}


#: per GEMM, from each row count on, its form (one H100, 13887b8: the module docstring)
TP8_FORMS = {
    "front": {65: _tiled(128, 4, True, False), 257: _tiled(64, 8, False, True, (2, 2)),
              513: _tiled(64, 8, False, True, (1, 4))},
    "shared_gate_up": {65: _tiled(128, 4, True, False),
                       257: _tiled(64, 8, False, True, (2, 2)),
                       513: _tiled(128, 6, False, True)},
    "shared_down": {65: _tiled(128, 4, False, False), 257: _tiled(128, 4, True, False),
                    513: _tiled(128, 6, False, True)},
    "up": {65: {"chunk_windows": 16, "serial": False, "overlap": False, "stage_k": 64},
           257: _tiled(64, 8, False, True, (2, 2)), 513: _tiled(64, 8, False, True, (1, 4))},
}


def resolve_forms(owner: str, forms, config: LatentMoEConfig, ranks: int, mma: str,
                  arch: str, serial_from=None, overlap: bool = False, chunk_windows: int = 8,
                  sms: int = 132):
    """``invariant_forms`` as a layer runs it, checked (``wide_gemms.check_gemm_forms`` on
    ``mma``): a dict as given, None as None, ``"auto"`` as ``TP8_FORMS`` where the rank's
    four GEMMs have the shapes and K splits the table was measured at
    (``wide_gemms.gemm_shapes`` and ``gemm_splits`` of ``config`` at ``ranks`` against the
    real dimensions' at 8 ranks, both at ``sms``), ``arch`` is sm_90a, ``mma`` the warpgroup
    MMA (the tiled kernel's) and the layer's ``serial_from``, ``overlap`` and
    ``chunk_windows`` (its ``invariant_*`` arguments) at their defaults None, False and 8
    (set, they shape every call, which the table would override), else None. Any other
    value is refused by name."""
    from fast.schedules.wide_gemms import check_gemm_forms, gemm_shapes, gemm_splits

    if forms == "auto":
        real = LatentMoEConfig.kimi_k3()
        measured = (arch == "sm_90a" and mma == "wgmma" and serial_from is None
                    and not overlap and chunk_windows == 8
                    and (gemm_shapes(config, ranks), gemm_splits(config, ranks, sms))
                    == (gemm_shapes(real, 8), gemm_splits(real, 8, sms)))
        forms = {name: dict(table) for name, table in TP8_FORMS.items()} if measured else None
    elif forms is not None and not isinstance(forms, dict):
        raise ValueError(f"{owner}: invariant_forms must be None, 'auto' or a dict of "
                         f"per-GEMM forms, got {forms!r}")
    check_gemm_forms(owner, config, ranks, forms, mma, sms)
    return forms
