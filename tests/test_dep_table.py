"""``benchmarks.dep_table``'s command line on the CPU: what reaches ``DepLayer`` (a
stand-in records its arguments and stops the run before any GPU work)."""

from __future__ import annotations

import pytest

from benchmarks import dep_table


def test_batch_invariant_flag_reaches_the_layer_and_defaults_are_the_layers(layer_stand_in):
    """``--batch-invariant`` / ``--no-batch-invariant`` reach the layer as named; without
    either the layer keeps its own default (the run does not restate it); ``--dense-gemm``
    is passed as given."""
    import fast.schedules.dep as dep

    built = layer_stand_in(dep_table, dep, "DepLayer")
    for flag, want in (([], None), (["--no-batch-invariant"], False),
                       (["--batch-invariant"], True)):
        built.clear()
        with pytest.raises(layer_stand_in.stop):
            dep_table.main(["--tokens", "1,8", "--dense-gemm", "fast", *flag])
        assert built.get("batch_invariant") is want, flag
        assert built["max_tokens"] == 8 and built["dense_gemm"] == "fast"
