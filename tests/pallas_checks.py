"""Tolerance of the Pallas kernels against the float64 oracle (tests/oracle.py).

The kernels compute q·K exactly as products (bf16 q, fp8 / fp4 codes converted to bf16 exactly,
UltraQuant's e4m3 rotated q exact in bf16, or its float32 one (``exact_q``) as three exact bf16
pieces) with float32 accumulation, keep
the softmax in float32, and round P to bf16 before P @ V. That one rounding adds, per output
element, at most ``2^-8 * sum_k p_k |v_k| / l <= 2^-8 * max|V|`` (bf16 unit roundoff 2^-8 on
each p_k; l sums the unrounded p). The lse does not see it (l uses the unrounded p), so the lse
keeps the float32 budget of ``oracle.lse_atol``: a rounding of q or K to bf16 in the scores
still fails there by orders of magnitude (see ``oracle.attn_atol``).
"""

from __future__ import annotations

import numpy as np

from tests import oracle as O

P_ROUNDING = 2.0**-8  # bf16 unit roundoff


def check_kernel_attention(out, ref, stats, lse=None, ref_lse=None, heads_per_entry=None, what=""):
    """``oracle.check_attention`` with the bf16-P term added to the output tolerance."""
    out = O.to_f64(out)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    n_keys, vmax, sabs = O.stats_atol(stats, ref.shape[:2], heads_per_entry)
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    atol = O.attn_atol(n_keys, vmax, sabs) + P_ROUNDING * vmax
    tol = 2.0**-8 * np.abs(ref) + atol[..., None]
    err = np.abs(out - ref)
    bad = np.argwhere(err > tol)
    assert bad.size == 0, (
        f"{what}: {len(bad)} outputs out of tolerance, worst ratio {np.max(err / tol):.3g}; "
        + str([(tuple(b), out[tuple(b)], ref[tuple(b)], tol[tuple(b)]) for b in bad[:4]])
    )
    assert np.all(out[n_keys == 0] == 0), f"{what}: rows without keys must be 0"
    if lse is not None:
        lse, ref_lse = O.to_f64(lse), np.asarray(ref_lse, np.float64)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"{what}: -inf lse mismatch"
        fin = np.isfinite(ref_lse)
        lerr = np.abs(np.where(fin, lse, 0) - np.where(fin, ref_lse, 0))
        ltol = O.lse_atol(n_keys, sabs, ref_lse)
        assert np.all(lerr <= ltol), f"{what}: lse worst ratio {np.max(lerr / ltol):.3g}"
