"""Backends that are wrong on purpose, for ``tests/test_backend_plugins.py``: each must
fail the contracts it is selected for with a clear error, and never stop the run."""

from __future__ import annotations

from verify.interface import BITWISE, Backend


class WrongDtype(Backend):
    """Finalize returns FP32 rows, where the interface says BF16."""

    name = "wrong-dtype"
    claims = {"finalize": BITWISE}

    def finalize(self, rows, weights):
        k = weights.shape[1]
        return rows.float().view(weights.shape[0], k, -1).sum(1)


class WrongShape(Backend):
    """Finalize returns one token too few."""

    name = "wrong-shape"
    claims = {"finalize": BITWISE}

    def finalize(self, rows, weights):
        k = weights.shape[1]
        return rows.view(weights.shape[0], k, -1)[:-1, 0].contiguous()


class Raises(Backend):
    """Finalize raises."""

    name = "raises"
    claims = {"finalize": BITWISE}

    def finalize(self, rows, weights):
        raise RuntimeError("the kernel failed to launch")


class UnknownStage(Backend):
    """Claims a stage the interface does not have."""

    name = "unknown-stage"
    claims = {"finalise": BITWISE}


class ClaimWithoutMethod(Backend):
    """Claims a stage whose method it does not define."""

    name = "no-method"
    claims = {"rms_norm": BITWISE}
