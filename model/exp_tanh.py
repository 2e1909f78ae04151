"""The constants of the project's own FP32 exp and tanh, in one place.

The fast kernels (``fast.device.fp32.exp_rn`` / ``tanh_rn``) evaluate these functions from IEEE
FP32 operations only, and ``reference.emulation`` repeats the same sequence on the CPU bit
for bit; both read their constants here (a data module: no stage, no function).

exp(x), x clamped to ``[EXP_LO, EXP_HI]`` (below, the result rounds to 0; above, it
overflows to +inf; so the clamp changes no result and keeps the exponent arithmetic in
range):

    n  = rint(x * LOG2E)                      (ties to even)
    r  = (x - n * LN2_HI) - n * LN2_LO        (Cody-Waite: n * LN2_HI is exact)
    p  = EXP_COEFFS[0]; p = p * r + c for c in EXP_COEFFS[1:]   (Taylor, degree 7, Horner)
    e^x = (p * 2^floor(n/2)) * 2^(n - floor(n/2))

tanh(y): for ``|y| < TANH_SMALL`` the Cephes polynomial ``y + y^3 P(y^2)`` with
``P = TANH_COEFFS`` (Horner), else ``sign(y) (1 - 2 / (exp(2|y|) + 1))``.

Accuracy, measured over FP32 arguments against float64: ``tests/test_emulation.py`` (the
bounds used by the contracts are ``verify.tolerances.EXP_RN_ULP`` / ``TANH_RN_ULP``).
"""

EXP_LO = -104.0
EXP_HI = 89.0
LOG2E = 1.44269502162933349609375  # FP32(log2 e) = 0x3FB8AA3B
LN2_HI = 0.693359375  # Cephes C1 = 355/512 (9 significant bits: n * LN2_HI is exact)
LN2_LO = -2.12194440e-4  # Cephes C2 (ln 2 = LN2_HI + LN2_LO to ~1e-11)
EXP_COEFFS = (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)
"""1/k! for k = 7 .. 1, then 1 (Horner from the highest degree)."""
TANH_SMALL = 0.625
TANH_COEFFS = (
    -5.70498872745e-3,
    2.06390887954e-2,
    -5.37397155531e-2,
    1.33314422036e-1,
    -3.33332819422e-1,
)
"""Cephes tanhf's polynomial in ``y^2``, highest degree first."""
