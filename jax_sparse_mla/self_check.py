"""The self-check of the gfx950 kernels: each compiled configuration against its emulation.

``PLAN`` maps every kernel configuration the ops can launch (``configs.user_symbols()``: 32
sparse_mla, 4 mla_decode partials and the combine, 15 UltraQuant decode and the reduce) to its
cases: small deterministic inputs run with the kernel (``implementation="flydsl"``) and with
``"gfx950_emulation"``, every output within the kernel-vs-emulation bound of the emulation
module's docstring (``emulation/bounds.py``). The cases are chosen so that every code path of
the configuration runs:

* sparse_mla (each head count 1..16, with and without lse): rows of 0, 1, 300 and 2100 keys
  and an all -1 row; a tenth of the entries -1, a fifth other negatives or past the last
  record. With the LSE (``_l1``) the call runs S = 8 key splits per row (on 256 CUs; splits
  without keys for the short rows) and the combine on their partials; without it (``_l0``, the
  configurations only S = 1 launches) 36 more empty rows keep the mean row at <= 64 keys, so
  S = 1 and the 2100-key row runs 17 tiles and 9 passes of the 256-entry index scan. The h16
  cases run 32 (``_l1``) and 48 (``_l0``) heads: 2 and 3 head groups in one launch.
* mla_decode partials (qlen 1, 2, 4; 20 heads, so the last 16-row group is partial): an empty
  request, one whose scores rise along its keys and one whose scores fall (1000 and 900 keys,
  2 splits: 4 blocks of 128 keys per split, so the second LDS slot, its prefetch and the
  rescale by an earlier maximum run), a short one; causal rows for qlen > 1; masked indices; a
  negative sm_scale at qlen 2.
* The 128-row partials (qlen 1): the same requests (masked indices included) at H = 128 (3
  splits, a negative sm_scale) and H = 256 (two head groups, 2 splits); every split of the long
  requests runs 3 or more 64-key blocks, so the running max moves between its blocks. Its
  pairing of P's hi and lo by ``v_permlane32_swap`` (a direction no MI355 probe checks) would,
  the other way round, meet other keys' V or the other scale: o far outside the bound
  (``tests/test_mla_decode_m128.py``), so these cases catch it.
* The combine: partials with -inf lse over NaN / inf garbage, a row with no live partial, a
  single split, and partials whose lse overflowed (+inf).
* UltraQuant (each G and block size): 3 partitions over requests of 0, 507 and 391
  tokens, a block-table entry -1 and one past the last block. The reduce: random partials,
  some with no keys.

The platform choice (``_verdicts``) runs the cases of the configurations a call needs in a
child process, ``python -m jax_sparse_mla.self_check --child ...``, which prints one JSON event
per line (``start`` / ``done`` per case, ``finished`` per configuration).
``JAX_SPARSE_MLA_SELFCHECK_FAULT=KIND:SYMBOL`` (tests only) makes the child fail on that
configuration's first case: ``abort`` (SIGABRT), ``hang`` or ``oom`` (an out-of-memory error).

Cost (53 configurations, 56 cases): every case is a few MB of inputs and at most 2100 keys, so
an MI355 spends its time compiling the two programs per case, estimated at one or two seconds
a case (not measured on an MI355); a call verifies only the one to three configurations it
launches. ``jax_sparse_mla.selfcheck()`` verifies them all and prints each case as it ends.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import _platform, _verdicts
from jax_sparse_mla.emulation import bounds as B
from jax_sparse_mla.emulation.sparse_mla import sparse_mla_partials_gfx950_emulation
from jax_sparse_mla.emulation.ultraquant import ultraquant_reduce_gfx950_emulation
from jax_sparse_mla.ffi.calls import default_sparse_splits, device_cus, ultraquant_reduce_flydsl
from jax_sparse_mla.formats import KV_DIM, UQ_HEAD_DIM, pack_fp8_ds_mla, ultraquant_store
from jax_sparse_mla.kernels.gfx950 import configs
from jax_sparse_mla.mla_decode import merge_attn_states, mla_decode_partials
from jax_sparse_mla.sparse_mla import sparse_mla
from jax_sparse_mla.ultraquant import ultraquant_decode

EMULATION = "gfx950_emulation"
FAULT_ENV = "JAX_SPARSE_MLA_SELFCHECK_FAULT"

Run = Callable[[str], tuple]  # implementation -> the op's outputs
Compare = Callable[[tuple], tuple[float, "str | None"]]  # kernel outputs -> (ratio, error)


class Case(NamedTuple):
    """One case of a configuration: ``setup()`` builds the inputs and returns ``(run,
    compare)``; ``compare`` runs the emulation on the same inputs."""

    symbol: str
    name: str
    setup: Callable[[], tuple[Run, Compare]]


def check(case: Case, implementation: str) -> tuple[float, str | None]:
    """(worst |kernel - emulation| / bound, error or None) of ``case`` run with
    ``implementation``; an exception is the error."""
    try:
        _injected_fault(case.symbol)
        run, compare = case.setup()
        return compare(jax.block_until_ready(run(implementation)))
    except Exception as e:  # a kernel that cannot run fails its case, with its error
        return float("nan"), f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def _worst(*results: tuple[float, str | None]) -> tuple[float, str | None]:
    ratio = max((r for r, _ in results), key=lambda r: -1 if np.isnan(r) else r)
    return ratio, next((e for _, e in results if e is not None), None)


def _bf16(r, shape, scale=1.0) -> jax.Array:
    return jnp.asarray(r.standard_normal(shape) * scale, jnp.bfloat16)


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static))


# ---------------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------------


SPARSE_LENGTHS = (0, 1, 300, 2100, 40)  # keys per row; the last row all -1
SPARSE_S1_EMPTY_ROWS = 36  # rows without keys that bring the mean row to <= 64 keys: S = 1


def sparse_inputs(seed: int, heads: int, return_lse: bool):
    """(q, kv, idx, indptr): rows of 0, 1, 300 and 2100 keys into 512 records and an all -1
    row (module docstring); without the LSE 36 more empty rows, so that the mean row holds
    <= 64 entries and the kernel writes its output itself (S = 1); with it S > 1 splits."""
    r, rows = np.random.default_rng(seed), 512
    lengths = SPARSE_LENGTHS + (() if return_lse else (0,) * SPARSE_S1_EMPTY_ROWS)
    latent = r.standard_normal((rows, 512)) * 2.0 ** r.integers(-3, 4, (rows, 1))
    kv = pack_fp8_ds_mla(
        jnp.asarray(latent, jnp.float32), jnp.asarray(r.standard_normal((rows, 64)), jnp.float32)
    )
    idx = r.integers(-rows // 8, rows + rows // 8, sum(lengths))
    idx[r.random(len(idx)) < 0.1] = -1
    idx[-lengths[4] :] = -1
    idx, indptr = jnp.asarray(idx, jnp.int32), jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
    return _bf16(r, (len(lengths), heads, KV_DIM)), kv, idx, indptr


def _sparse(seed: int, heads: int, return_lse: bool):
    q, kv, idx, indptr = sparse_inputs(seed, heads, return_lse)
    sm_scale = KV_DIM**-0.5
    splits = default_sparse_splits(q, idx)

    def run(implementation, lse=return_lse):
        fn = _jit(sparse_mla, sm_scale=sm_scale, return_lse=lse, implementation=implementation)
        res = fn(q, kv, idx, indptr)
        return res if lse else (res,)

    def compare(outputs):
        out_e, lse_e = run(EMULATION, lse=True)
        parts = None
        if splits > 1:
            parts = sparse_mla_partials_gfx950_emulation(q, kv, idx, indptr, sm_scale, splits)
        tol, lse_tol = B.sparse_mla_bound(q, kv, idx, indptr, sm_scale, out_e, lse_e, parts)
        out = B.compare("out", outputs[0], out_e, tol)
        return _worst(out, B.compare("lse", outputs[1], lse_e, lse_tol)) if return_lse else out

    return run, compare


# ---------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------

DECODE_TOKENS = 1024
DECODE_SEQ_LENS = (0, 1000, 900, 37)  # empty, rising scores, falling scores, short
DECODE_SPLITS = 2
DECODE_HEADS = 20
# The 128-row kernel's cases (heads, splits, sm_scale sign): one and two groups of 128 heads.
M128_CASES = ((128, 3, -1), (256, 2, 1))


def decode_inputs(seed: int, qlen: int, heads: int = DECODE_HEADS):
    """(q ``[4 qlen, heads, 576]``, kv codes, kv_indices, kv_indptr): requests of
    ``DECODE_SEQ_LENS`` keys; token t's K is ``ramp_t * base + noise`` with
    ramp -1 -> 1 and q near ``base``, so scores run from about -12 to 12 along the tokens;
    request 1 reads tokens ascending (rising maximum), request 2 descending (falling); 5% of
    the indices -1 and 3% past the last token. Where the 128-row kernel can serve the shape,
    kv_indices is padded with -1 (past the last request: never read) to the length at which
    ``configs.mla_decode_rows`` picks it on this device's CUs."""
    r, tokens = np.random.default_rng(seed), DECODE_TOKENS
    base = r.standard_normal(KV_DIM)
    ramp = np.linspace(-1.0, 1.0, tokens)[:, None]
    kv = ramp * base + 0.5 * r.standard_normal((tokens, KV_DIM))
    kv = jnp.asarray(kv, jnp.float8_e4m3fn).view(jnp.uint8)
    n = DECODE_SEQ_LENS
    idx = np.concatenate(
        [
            np.sort(r.integers(0, tokens, n[1])),
            np.sort(r.integers(0, tokens, n[2]))[::-1],
            r.integers(0, tokens, n[3]),
        ]
    )
    idx[r.random(len(idx)) < 0.05] = -1
    idx[r.random(len(idx)) < 0.03] = tokens + 7
    if configs.mla_decode_m128_serves(qlen, heads):
        length = configs.MLA_DECODE_M128_MIN_SPLIT_KEYS * device_cus()
        idx = np.concatenate([idx, np.full(length - len(idx), -1)])
    q = base + 0.5 * r.standard_normal((len(n) * qlen, heads, KV_DIM))
    indptr = jnp.asarray(np.cumsum([0, *n]), jnp.int32)
    return jnp.asarray(q, jnp.bfloat16), kv, jnp.asarray(idx, jnp.int32), indptr


def _partials(
    seed: int, qlen: int, sm_scale: float, heads: int = DECODE_HEADS, splits: int = DECODE_SPLITS
):
    q, kv, idx, indptr = decode_inputs(seed, qlen, heads)
    static = dict(qlen=qlen, k_scale=0.5, v_scale=2.0, sm_scale=sm_scale)

    def run(implementation):
        fn = _jit(mla_decode_partials, **static, num_splits=splits, implementation=implementation)
        return fn(q, kv, idx, indptr)

    def compare(outputs):
        o_e, lse_e = run(EMULATION)
        tol, lse_tol = B.mla_decode_partials_bound(
            q, kv, idx, indptr, **static, o_e=o_e, lse_e=lse_e
        )
        return _worst(
            B.compare("o", outputs[0], o_e, tol), B.compare("lse", outputs[1], lse_e, lse_tol)
        )

    return run, compare


def _combine(seed: int, n: int, splits: int, heads: int, overflow: bool = False):
    """Random bf16 partials; 30% of them -inf with NaN / inf garbage in o; row 0 all -inf;
    ``overflow``: 30% of the others +inf (an lse past float32's range), row 1 all +inf."""
    r = np.random.default_rng(seed)
    o = np.asarray(_bf16(r, (n, splits, heads, 512), 3.0), np.float32)
    lse = (r.standard_normal((n, splits, heads)) * 20).astype(np.float32)
    empty = r.random(lse.shape) < 0.3
    empty[0] = True
    lse[empty] = -np.inf
    o[empty] = np.nan
    o[..., 0][empty] = np.inf
    if overflow:
        over = (r.random(lse.shape) < 0.3) & ~empty
        over[1] = True
        lse[over] = np.inf
    o, lse = jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse)

    def run(implementation):
        return _jit(merge_attn_states, return_lse=True, implementation=implementation)(o, lse)

    def compare(outputs):
        out_e, lse_e = run(EMULATION)
        tol, lse_tol = B.merge_bound(o, lse, out_e, lse_e)
        return _worst(
            B.compare("out", outputs[0], out_e, tol), B.compare("lse", outputs[1], lse_e, lse_tol)
        )

    return run, compare


# ---------------------------------------------------------------------------------------------
# ultraquant_decode
# ---------------------------------------------------------------------------------------------

UQ_PARTITIONS = 3


def uq_shape(block_size: int) -> tuple[int, tuple[int, ...]]:
    """(blocks per request, seq_lens): 512 token slots a request (at least 2 blocks), requests
    of 0, 507 and 391 tokens, so that each of 3 partitions of 128-token groups has work."""
    return max(2, 512 // block_size), (0, 507, 391)


def _ultraquant(seed: int, g: int, block_size: int):
    """Requests of ``uq_shape`` tokens over a shuffled block table with one entry -1 and one
    past the last block; every slot written by ``ultraquant_store``; 2 KV heads at G 8."""
    r, hk = np.random.default_rng(seed), 2 if g == 8 else 1
    max_blocks, seq_lens = uq_shape(block_size)
    batch = len(seq_lens)
    nb = batch * max_blocks + 2
    tokens = nb * block_size
    k, v = (jnp.asarray(r.standard_normal((tokens, hk, UQ_HEAD_DIM)), jnp.float32) for _ in "kv")
    cache = jnp.zeros((nb, block_size, hk, 272), jnp.uint8)
    cache = ultraquant_store(cache, k, v, jnp.arange(tokens, dtype=jnp.int32))
    tables = r.permutation(nb)[: batch * max_blocks].reshape(batch, max_blocks)
    tables[1, 1], tables[2, 0] = -1, nb + 3
    tables, lens = jnp.asarray(tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32)
    q = _bf16(r, (batch, hk * g, UQ_HEAD_DIM), 2.0)
    static = dict(sm_scale=1.0 / 16, num_partitions=UQ_PARTITIONS)

    def run(implementation, cache=cache):
        return (
            _jit(ultraquant_decode, **static, implementation=implementation)(
                q, cache, tables, lens
            ),
        )

    def compare(outputs):
        (out_e,), (a_e,) = run(EMULATION), run(EMULATION, jnp.asarray(B.abs_v_cache(cache)))
        tol = B.ultraquant_bound(q, cache, tables, lens, **static, out_e=out_e, a_e=a_e)
        return B.compare("out", outputs[0], out_e, tol)

    return run, compare


def _merge_layout(x):
    """The reduce kernel's partials [B, Hk, P, G, ...] as the merges take them: [B, P, Hk * G,
    ...] (query head h = k G + g)."""
    b, hk, p, g = x.shape[:4]
    return jnp.moveaxis(jnp.asarray(x), 2, 1).reshape(b, p, hk * g, *x.shape[4:])


def _reduce_emulation(o, max_logits, exp_sums):
    """The reduce's emulation on the kernel's layout: [B, Hk, P, G, 256] -> [B, Hk * G, 256]."""
    return ultraquant_reduce_gfx950_emulation(*map(_merge_layout, (o, max_logits, exp_sums)))


REDUCES = {"flydsl": ultraquant_reduce_flydsl, EMULATION: _reduce_emulation}


def _reduce(seed: int, batch: int, hk: int, parts: int, g: int):
    """Random partials; 30% of partitions without keys (max -inf, sum 0); request 0 none."""
    r = np.random.default_rng(seed)
    o = _bf16(r, (batch, hk, parts, g, UQ_HEAD_DIM), 2.0)
    m = (r.standard_normal((batch, hk, parts, g)) * 10).astype(np.float32)
    e = r.uniform(0.5, 50.0, m.shape).astype(np.float32)
    empty = r.random(m.shape) < 0.3
    empty[0] = True
    m[empty], e[empty] = -np.inf, 0.0
    m, e = jnp.asarray(m), jnp.asarray(e)

    def run(implementation):
        return (jax.jit(REDUCES[implementation])(o, m, e),)

    def compare(outputs):
        (out_e,) = run(EMULATION)

        # The combine's bound (same arithmetic: weights exp(m_p - M) s_p, an f32 sum, one bf16
        # rounding), on the partials as [B, P, Hq, 256] with lse = m + log(s).
        with np.errstate(divide="ignore"):
            lse = np.where(empty, -np.inf, np.asarray(m) + np.log(np.asarray(e)))
        tol, _ = B.merge_bound(_merge_layout(o), _merge_layout(lse), out_e, np.zeros(1))
        return B.compare("out", outputs[0], out_e, tol)

    return run, compare


# ---------------------------------------------------------------------------------------------
# The plan: every configuration's cases
# ---------------------------------------------------------------------------------------------


def _plan() -> dict[str, tuple[Case, ...]]:
    P = functools.partial
    plan: dict[str, list[Case]] = {}

    def add(symbol, name, setup):
        plan.setdefault(symbol, []).append(Case(symbol, name, setup))

    for h in configs.SPARSE_MLA_HEADS:
        for lse in configs.SPARSE_MLA_RETURN_LSE:
            # h16: 2 (S > 1) or 3 (S = 1) head groups in one launch
            heads = h * (2 + (not lse)) if h == configs.SPARSE_MLA_MAX_HEADS else h
            symbol = f"jsm_sparse_mla_h{h}_l{int(lse)}"
            plan_of = "S > 1 splits, empty ones, the combine" if lse else "S = 1"
            name = f"H{heads}, rows of 0/1/300/2100 keys, masked, {plan_of}"
            add(symbol, name, P(_sparse, 100 + h, heads, lse))
    for qlen in configs.MLA_DECODE_QLENS:
        sign = -1 if qlen == 2 else 1  # the scale's sign enters the kernel at run time
        add(
            configs.mla_decode_partials_launch(qlen, configs.MLA_DECODE_ROWS),
            f"qlen {qlen}, H20, 2 splits of 4 blocks, rising and falling scores, an empty "
            f"request, sm_scale {sign:+d}/24",
            P(_partials, 200 + qlen, qlen, sign * KV_DIM**-0.5),
        )
    add(configs.MLA_DECODE_COMBINE, "4 partials, -inf ones over NaN", P(_combine, 5, 5, 4, 8))
    add(configs.MLA_DECODE_COMBINE, "1 split", P(_combine, 6, 3, 1, 16))
    add(
        configs.MLA_DECODE_COMBINE,
        "4 partials, +inf (overflowed) and -inf ones",
        P(_combine, 8, 5, 4, 8, overflow=True),
    )
    for heads, splits, sign in M128_CASES:
        add(
            configs.MLA_DECODE_M128,
            f"qlen 1, H{heads}, {splits} splits of 3+ 64-key blocks, rising and falling "
            f"scores, an empty request, sm_scale {sign:+d}/24",
            P(_partials, 250 + heads, 1, sign * KV_DIM**-0.5, heads, splits),
        )
    for g in configs.ULTRAQUANT_GROUP_SIZES:
        for bs in configs.ULTRAQUANT_BLOCK_SIZES:
            symbol, _ = configs.ultraquant_launches(g, bs)
            name = f"G{g}, block {bs}, {UQ_PARTITIONS} partitions, masked blocks"
            add(symbol, name, P(_ultraquant, 300 + g + bs, g, bs))
    add(configs.ULTRAQUANT_REDUCE, "3 partitions, empty ones", P(_reduce, 7, 3, 2, 3, 8))
    return {symbol: tuple(cases) for symbol, cases in plan.items()}


PLAN = _plan()


def run_plan(symbols, implementation: str, emit: Callable[[dict], None]) -> None:
    """Runs the cases of ``symbols`` with ``implementation``, emitting ``start`` and ``done``
    per case and ``finished`` per configuration (its cases stop at the first failure)."""
    for symbol in symbols:
        for case in PLAN.get(symbol, ()):
            emit({"event": "start", "symbol": symbol, "case": case.name})
            ratio, error = check(case, implementation)
            emit(
                {
                    "event": "done",
                    "symbol": symbol,
                    "case": case.name,
                    "ratio": ratio,
                    "error": error,
                }
            )
            if error is not None:
                break
        else:
            if symbol not in PLAN:
                error = f"no self-check case launches {symbol}"
                emit(
                    {
                        "event": "done",
                        "symbol": symbol,
                        "case": "-",
                        "ratio": np.nan,
                        "error": error,
                    }
                )
        emit({"event": "finished", "symbol": symbol})


def _injected_fault(symbol: str) -> None:
    """``$JAX_SPARSE_MLA_SELFCHECK_FAULT`` (tests only, module docstring)."""
    kind, _, target = os.environ.get(FAULT_ENV, "").partition(":")
    if not kind or target != symbol:
        return
    if kind == "abort":
        os.abort()
    if kind == "hang":
        time.sleep(3600)
    if kind == "oom":
        raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating 4.00GiB ({FAULT_ENV})")


# ---------------------------------------------------------------------------------------------
# selfcheck(): every configuration, a line per case
# ---------------------------------------------------------------------------------------------


def _progress(out: TextIO) -> Callable[[dict], None]:
    def show(event: dict) -> None:
        if event["event"] == "done":
            verdict = "pass" if event["error"] is None else f"FAIL: {event['error']}"
            print(
                f"{event['symbol']:34} {event['case']:78} {event['ratio']:9.3g}  {verdict}",
                file=out,
                flush=True,
            )

    return show


def selfcheck(
    implementation: str = "flydsl", *, symbols=None, file: TextIO | None = None
) -> dict[str, _verdicts.Verdict]:
    """Runs the self-check cases of every kernel configuration (or of ``symbols``), printing a
    line per case as it ends (configuration, case, worst |kernel - emulation| / bound,
    verdict) to ``file`` (default stdout), then a summary.

    ``implementation="flydsl"`` (the default) needs a gfx950 (MI355) ROCm device; without one
    it prints what jax sees, runs nothing and returns {}. It runs the cases in child processes
    (a kernel that crashes or hangs is a failed verdict, not a crash here) and refreshes the
    verdicts that ``implementation=None`` reads. Another implementation (e.g.
    "gfx950_emulation") runs the same cases and bounds in this process, on any device, as a
    check of the check.

    Returns:
      {configuration symbol: Verdict} (``.status`` "pass" / "fail" / "retry", ``.case``,
      ``.ratio``, ``.error``).
    """
    out = sys.stdout if file is None else file
    symbols = tuple(configs.user_symbols() if symbols is None else symbols)
    if implementation == "flydsl":
        gfx950 = _platform.gfx950_devices()
        if not gfx950:
            print(
                "jax_sparse_mla self-check: no gfx950 (MI355) ROCm device, nothing was run; "
                f"jax sees: {_platform.devices_seen()}. The FlyDSL kernels need an MI355 with the "
                "ROCm jax plugin (pip install '.[rocm]', see README)",
                file=out,
            )
            return {}
        device = gfx950[0].device_kind
    else:
        device = jax.devices()[0].device_kind
    print(
        f"jax_sparse_mla self-check: {implementation} vs {EMULATION} on {device}, "
        f"{len(symbols)} configurations, {sum(len(PLAN.get(s, ())) for s in symbols)} cases",
        file=out,
        flush=True,
    )
    show = _progress(out)
    if implementation == "flydsl":
        verdicts = _verdicts.verify(symbols, device, "flydsl", on_event=show, refresh=True)
    else:
        events: list[dict] = []
        run_plan(symbols, implementation, lambda e: (events.append(e), show(e)))
        verdicts = _verdicts.settle(_verdicts.ChildRun(events, 0, ""), list(symbols), {})
    for v in verdicts.values():
        if v.status != "pass":
            print(f"{v.symbol}: {v.status} (case '{v.case}'): {v.error}", file=out)
    passed = sum(v.status == "pass" for v in verdicts.values())
    print(f"{passed} of {len(symbols)} kernel configurations passed", file=out, flush=True)
    return verdicts


def _child(argv: list[str]) -> None:
    """``python -m jax_sparse_mla.self_check --child --device NAME --implementation IMPL
    SYMBOL...``: the cases of each SYMBOL, one JSON event per line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_mla.self_check")
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--implementation", default="flydsl")
    parser.add_argument("symbols", nargs="+")
    args = parser.parse_args(argv)

    def emit(event: dict) -> None:
        print(json.dumps({**event, "device": args.device}), flush=True)

    run_plan(args.symbols, args.implementation, emit)


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        _child(sys.argv[1:])
    else:
        results = selfcheck()
        sys.exit(0 if all(v.status == "pass" for v in results.values()) else 1)
