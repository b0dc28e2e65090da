"""The sharding checks, run by tests/test_sharding.py in a process of its own with 8 virtual CPU
devices (``python -m tests.sharding_checks [check ...]``; the device count must be set before
jax starts, and the rest of the suite keeps one device).

Each check runs a ``*_sharded`` op under ``jax.jit`` with NamedSharding inputs (its
``jax.shard_map`` keeps the default ``check_vma=True``), compares it with the op on one device
and reads the compiled HLO's collectives: none for heads (TP) and rows / requests (DP); for
the KV context (DCP) all-gathers of the partials only. The CPU runs "xla", the gfx950
emulation and None; "flydsl" and the CUDA branches ("pallas", "mosaic") are lowered for their
platform ("pallas" in interpret mode is refused inside shard_map). The gradient checks take
``jax.grad`` under jit through each wrapper and compare it with one device's.
"""

from __future__ import annotations

import functools
import os
import re
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from tests import cases as C  # noqa: E402
from tests.cpu_subprocess import REPO  # noqa: E402

# Run here: "pallas" in interpret mode refuses varying inputs (check_pallas_interpret_refused);
# its compiled CUDA kernel under shard_map is lowered by check_lowering.
IMPLS = ("xla", "gfx950_emulation", None)
COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute)\w*\(")


def mesh(dp: int, tp: int) -> jax.sharding.Mesh:
    return jax.make_mesh((dp, tp), ("dp", "tp"))


def put(m, specs, *arrays):
    return [
        jax.device_put(jnp.asarray(a), NamedSharding(m, s))
        for s, a in zip(specs, arrays, strict=True)
    ]


def collectives(f, *args) -> list[tuple[str, str]]:
    """(result type, op) of every collective in ``jax.jit(f)``'s compiled HLO."""
    return COLLECTIVE.findall(jax.jit(f).lower(*args).compile().as_text())


def close(got, want, what: str, partials_bf16: bool = False) -> None:
    """Equal up to one bf16 rounding: both sides are float32 online softmaxes over the same keys
    (in other tile / shard orders: ~2^-22 relative of the row) rounded once to bf16, so they
    differ by at most 1 bf16 ulp (<= 2^-7 |want|) plus the float32 difference.

    ``partials_bf16``: DCP with a kernel implementation, whose per-device partials carry the
    kernel's bf16 roundings (P in bf16: <= 2^-8 max|V| per partial; the emulation's o in
    bf16 too) before the float32 merge: 2^-7 max|want| more."""
    got, want = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (got, want))
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want)
    top = np.max(np.abs(want), initial=1.0, where=np.isfinite(want))
    tol = 2.0**-7 * np.abs(want) + (2.0**-7 if partials_bf16 else 2.0**-18) * top
    bad = ~(diff <= tol) & ~(np.isneginf(got) & np.isneginf(want))
    assert not bad.any(), (
        f"{what}: {bad.sum()} entries differ, max {np.max(np.abs(got - want)[bad])}"
    )


def dense_topk(case) -> tuple[np.ndarray, np.ndarray]:
    """The indexer's [4, 16] int32 layout over the case's records (not its NaN garbage rows),
    about 20 % -1 padding, and per-row lengths [4] int32 (one 0)."""
    good = np.setdiff1d(np.arange(46), case.meta["nan_rows"])
    topk = np.where(C.rng(2).random((4, 16)) < 0.2, -1, C.rng(3).choice(good, (4, 16)))
    return topk.astype(np.int32), np.int32([16, 3, 0, 9])


def check_sparse_mla() -> None:
    m = mesh(2, 4)
    case = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    topk, lengths = dense_topk(case)
    layouts = {  # name: (specs, global arguments, options)
        "csr": ((P("dp", "tp", None), P(), P(), P()), (case.idx, case.indptr), {}),
        "dense": ((P("dp", "tp", None), P(), P("dp", None)), (topk,), {"topk_length": lengths}),
    }
    for impl in IMPLS:
        for name, (specs, index, options) in layouts.items():
            args = put(m, specs, case.q, case.kv, *index)
            if "topk_length" in options:
                options = {"topk_length": put(m, [P("dp")], lengths)[0]}

            def f(*a, impl=impl, options=options):
                return jsm.sparse_mla_sharded(
                    *a,
                    mesh=m,
                    heads="tp",
                    rows="dp",
                    return_lse=True,
                    implementation=impl,
                    **options,
                )

            out, lse = jax.jit(f)(*args)
            want = jsm.sparse_mla(
                case.q,
                case.kv,
                *index,
                return_lse=True,
                implementation=impl,
                **({"topk_length": lengths} if options else {}),
            )
            close(out, want[0], f"sparse_mla {name} [{impl}] out")
            close(lse, want[1], f"sparse_mla {name} [{impl}] lse")
            assert out.sharding.spec == P("dp", "tp", None), out.sharding
            found = collectives(f, *args)
            assert found == [], (impl, name, found)
    print("sparse_mla ok")


def check_mla_decode() -> None:
    case = C.decode_case(3, seq_lens=(5, 130, 300, 64), qlen=2, h=4, as_uint8=True)
    tokens = case.kv.shape[0]
    pad = -tokens % 8  # the cache's tokens split evenly over up to 8 devices
    kv = np.concatenate([case.kv_codes, np.full((pad, 576), 0x7F, np.uint8)])
    scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
    layouts = {  # name: (mesh, heads, requests, context)
        "tp+dp": (mesh(2, 4), "tp", "dp", None),
        "dcp": (mesh(1, 8), None, None, "tp"),
        "dp+dcp": (mesh(2, 4), None, "dp", "tp"),
    }
    for impl in IMPLS:
        want = jsm.mla_decode(
            case.q,
            kv,
            case.kv_indices,
            case.kv_indptr,
            qlen=2,
            return_lse=True,
            implementation=impl,
            **scales,
        )
        for name, (m, heads, requests, context) in layouts.items():
            specs = (P(requests, heads, None), P(context, None), P(), P())
            args = put(m, specs, case.q, kv, case.kv_indices, case.kv_indptr)

            def f(*a, m=m, heads=heads, requests=requests, context=context, impl=impl):
                return jsm.mla_decode_sharded(
                    *a,
                    mesh=m,
                    heads=heads,
                    requests=requests,
                    context=context,
                    qlen=2,
                    return_lse=True,
                    implementation=impl,
                    **scales,
                )

            out, lse = jax.jit(f)(*args)
            loose = context is not None and impl != "xla"
            close(out, want[0], f"mla_decode {name} [{impl}] out", loose)
            close(lse, want[1], f"mla_decode {name} [{impl}] lse")
            found = collectives(f, *args)
            if context is None:
                assert found == [], (impl, name, found)
            else:  # only the merge: [rows, H] maxima and sums, the [rows, H, 512] weighted sum
                rows = case.q.shape[0] // (m.shape[requests] if requests else 1)
                allowed = {f"f32[{rows},4]", f"f32[{rows},4,512]"}
                assert found, (impl, name)
                for t, op in found:
                    assert op == "all-reduce" and t.split("{")[0] in allowed, (impl, name, found)
    print("mla_decode ok")


def check_ultraquant() -> None:
    m = mesh(2, 4)
    case = C.uq_case(4, seq_lens=(1, 40, 100, 17), hk=4, g=2)
    specs = (P("dp", "tp", None), P(None, None, "tp", None), P("dp", None), P("dp"))
    for impl in IMPLS:
        args = put(m, specs, case.q, case.cache, case.block_tables, case.seq_lens)

        def f(*a, impl=impl):
            return jsm.ultraquant_decode_sharded(
                *a, mesh=m, heads="tp", requests="dp", implementation=impl
            )

        out = jax.jit(f)(*args)
        want = jsm.ultraquant_decode(
            case.q, case.cache, case.block_tables, case.seq_lens, implementation=impl
        )
        close(out, want, f"ultraquant_decode [{impl}]")
        assert collectives(f, *args) == [], (impl, collectives(f, *args))
    print("ultraquant ok")


def grads_close(got, want, what: str, kernel_partials: bool = False) -> None:
    """Gradients of the same loss: float32 VJPs of the exact path over the same keys, in other
    tile / shard / psum orders (f32 differences, measured <= 2^-16 relative), then q's rounded
    to bf16 once on each side (<= 2^-8 |want| each): 2^-7 |want| + 2^-14 max |want|.

    ``kernel_partials``: DCP with a kernel implementation differentiates the merge at the
    kernel's own partials (bf16 P, bf16 o), which differ from the exact ones by the kernel's
    forward error (single device: the exact path's merge): 2^-6 max |want| more (measured up
    to 2^-7.5)."""
    got, want = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (got, want))
    top = np.max(np.abs(want), initial=0.0)
    tol = 2.0**-7 * np.abs(want) + (2.0**-6 if kernel_partials else 2.0**-14) * top
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{what}: {bad.sum()} entries differ, max {np.abs(got - want).max()}"


def grad_of(fn, n_diff: int, cots):
    """``jax.jit(jax.grad)`` of ``sum_i <fn(...)[i], cots[i]>`` (non-finite outputs, e.g. an
    lse of -inf, count 0) w.r.t. the first ``n_diff`` arguments."""

    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(
            jnp.vdot(jnp.where(jnp.isfinite(o), o, 0.0).astype(jnp.float32), c)
            for o, c in zip(outs, cots, strict=True)
        )

    return jax.jit(jax.grad(loss, argnums=tuple(range(n_diff))))


def check_gradients(impl: str) -> None:
    """``jax.grad`` under jit through every sharded wrapper equals the single-device op's:
    w.r.t. q and the traced scales, for ``impl`` ("xla"; "gfx950_emulation", whose gradient
    is the exact path's)."""
    rng = C.rng(7)

    def cots(*shapes):
        return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]

    m = mesh(2, 4)
    sp = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    topk, lengths = dense_topk(sp)
    sp_cots = cots((4, 8, 512), (4, 8))
    dec = C.decode_case(3, seq_lens=(5, 130, 300, 64), qlen=2, h=4, as_uint8=True)
    kv = np.concatenate([dec.kv_codes, np.full((-dec.kv.shape[0] % 8, 576), 0x7F, np.uint8)])
    dec_cots = cots((8, 4, 512), (8, 4))
    uq = C.uq_case(4, seq_lens=(1, 40, 100, 17), hk=4, g=2)
    uq_cots = cots((4, 8, 256))
    scale = jnp.float32(0.05)
    args = put(m, (P("dp", "tp", None), P(), P("dp", None), P("dp")), sp.q, sp.kv, topk, lengths)

    def sparse(q, s, kv, idx, n):
        return jsm.sparse_mla_sharded(
            q,
            kv,
            idx,
            mesh=m,
            heads="tp",
            rows="dp",
            topk_length=n,
            sm_scale=s,
            return_lse=True,
            implementation=impl,
        )

    def sparse_one(q, s, kv, idx, n):
        return jsm.sparse_mla(
            q, kv, idx, topk_length=n, sm_scale=s, return_lse=True, implementation=impl
        )

    got = grad_of(sparse, 2, sp_cots)(args[0], scale, *args[1:])
    want = grad_of(sparse_one, 2, sp_cots)(sp.q, scale, sp.kv, topk, lengths)
    for g, w, name in zip(got, want, ("q", "sm_scale"), strict=True):
        grads_close(g, w, f"sparse_mla d{name} [{impl}]")

    scales = (jnp.float32(dec.k_scale), jnp.float32(dec.v_scale))

    def decode_one(q, ks, vs, kv, ind, ptr):
        return jsm.mla_decode(
            q,
            kv,
            ind,
            ptr,
            qlen=2,
            k_scale=ks,
            v_scale=vs,
            return_lse=True,
            implementation=impl,
        )

    want = grad_of(decode_one, 3, dec_cots)(dec.q, *scales, kv, dec.kv_indices, dec.kv_indptr)
    for name, (mm, heads, requests, context) in {
        "tp+dp": (m, "tp", "dp", None),
        "dp+dcp": (m, None, "dp", "tp"),
    }.items():
        specs = (P(requests, heads, None), P(context, None), P(), P())
        args = put(mm, specs, dec.q, kv, dec.kv_indices, dec.kv_indptr)

        def decode(q, ks, vs, kv, ind, ptr, mm=mm, h=heads, r=requests, c=context):
            return jsm.mla_decode_sharded(
                q,
                kv,
                ind,
                ptr,
                mesh=mm,
                heads=h,
                requests=r,
                context=c,
                qlen=2,
                k_scale=ks,
                v_scale=vs,
                return_lse=True,
                implementation=impl,
            )

        got = grad_of(decode, 3, dec_cots)(args[0], *scales, *args[1:])
        loose = context is not None and impl != "xla"
        for g, w, wrt in zip(got, want, ("q", "k_scale", "v_scale"), strict=True):
            grads_close(g, w, f"mla_decode {name} d{wrt} [{impl}]", loose)

    specs = (P("dp", "tp", None), P(None, None, "tp", None), P("dp", None), P("dp"))
    args = put(m, specs, uq.q, uq.cache, uq.block_tables, uq.seq_lens)

    def ultra(q, s, cache, tables, lens):
        return jsm.ultraquant_decode_sharded(
            q,
            cache,
            tables,
            lens,
            mesh=m,
            heads="tp",
            requests="dp",
            sm_scale=s,
            implementation=impl,
        )

    def ultra_one(q, s, cache, tables, lens):
        return jsm.ultraquant_decode(q, cache, tables, lens, sm_scale=s, implementation=impl)

    got = grad_of(ultra, 2, uq_cots)(args[0], scale, *args[1:])
    want = grad_of(ultra_one, 2, uq_cots)(uq.q, scale, uq.cache, uq.block_tables, uq.seq_lens)
    for g, w, name in zip(got, want, ("q", "sm_scale"), strict=True):
        grads_close(g, w, f"ultraquant_decode d{name} [{impl}]")
    print(f"gradients_{impl} ok")


def check_lowering() -> None:
    """ "flydsl" and None lowered for ROCm, "pallas", "mosaic" and None (the Mosaic kernel on a
    Hopper target: _platform.hopper_choice) for CUDA: the custom calls (no gathering of q or
    the cache: no collective at all in the TP layout)."""
    m = mesh(2, 4)
    case = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    specs = (P("dp", "tp", None), P(), P(), P())
    args = put(m, specs, case.q, case.kv, case.idx, case.indptr)
    for platform, impls, target in (
        ("rocm", ("flydsl", None), "jsm_sparse_mla"),
        ("cuda", ("pallas",), "__gpu$xla.gpu.triton"),
        ("cuda", ("mosaic", None), "mosaic_gpu"),
    ):
        for impl in impls:

            def f(*a, impl=impl):
                return jsm.sparse_mla_sharded(
                    *a, mesh=m, heads="tp", rows="dp", implementation=impl
                )

            try:
                lowered = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))
            except RuntimeError as e:  # jax >= 0.11 lowers Pallas for CUDA only beside a GPU
                if "No supported GPU devices" not in str(e):
                    raise
                print(f"lowering for {platform} [{impl}] skipped: jax needs a GPU for it")
                continue
            text = lowered.as_text()
            assert target in text, (platform, impl)
            assert not re.search(r"all_gather|all_reduce|all_to_all|collective_permute", text), (
                platform,
                impl,
            )
    print("lowering ok")


def check_pallas_interpret_refused() -> None:
    """Pallas interpret mode inside shard_map fails when lowered (before anything runs) with a
    message naming the remedy (it used to run in a host callback, which deadlocked XLA:CPU's
    devices, and then failed at run time on every device)."""
    m = mesh(2, 4)
    case = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    args = put(m, (P("dp", "tp", None), P(), P(), P()), case.q, case.kv, case.idx, case.indptr)

    def f(*a):
        return jsm.sparse_mla_sharded(*a, mesh=m, heads="tp", rows="dp", implementation="pallas")

    try:
        jax.jit(f).lower(*args)
    except NotImplementedError as e:
        assert "cannot run inside jax.shard_map" in str(e), e
    else:
        raise AssertionError("pallas interpret mode lowered inside shard_map")
    print("pallas_interpret_refused ok")


def mesh_of(kind: str) -> jax.sharding.Mesh:
    """The 2 x 4 ("dp", "tp") mesh with Explicit (``jax.make_mesh``'s default) or Auto axes."""
    types = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(types, types))


def check_placement(kind: str) -> None:
    """The wrappers take inputs of any placement (numpy; placed otherwise than their specs)
    eagerly and under jit, on Explicit and Auto meshes, and equal one device's op; their
    outputs are split as documented."""
    m = mesh_of(kind)
    sp = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    topk, lengths = dense_topk(sp)
    dec = C.decode_case(3, seq_lens=(5, 130, 300, 64), qlen=1, h=4, as_uint8=True)
    kv = np.concatenate([dec.kv_codes, np.full((-dec.kv.shape[0] % 8, 576), 0x7F, np.uint8)])
    uq = C.uq_case(4, seq_lens=(1, 40, 100, 17), hk=4, g=2)

    def misplace(a):  # a placement no wrapper asks for (dim 0 over "tp" where it divides)
        return jax.device_put(a, NamedSharding(m, P("tp") if a.shape[0] % 4 == 0 else P()))

    calls = {  # name: (wrapper, single-device op, arguments, options)
        "sparse_mla": (
            functools.partial(jsm.sparse_mla_sharded, heads="tp", rows="dp"),
            jsm.sparse_mla,
            (sp.q, sp.kv, topk),
            {"topk_length": lengths},
        ),
        "mla_decode": (
            functools.partial(jsm.mla_decode_sharded, heads="tp", requests="dp"),
            jsm.mla_decode,
            (dec.q, kv, dec.kv_indices, dec.kv_indptr),
            {},
        ),
        "mla_decode dcp": (
            functools.partial(jsm.mla_decode_sharded, context="tp"),
            jsm.mla_decode,
            (dec.q, kv, dec.kv_indices, dec.kv_indptr),
            {},
        ),
        "ultraquant_decode": (
            functools.partial(jsm.ultraquant_decode_sharded, heads="tp", requests="dp"),
            jsm.ultraquant_decode,
            (uq.q, uq.cache, uq.block_tables, uq.seq_lens),
            {},
        ),
    }
    for name, (wrapper, op, args, options) in calls.items():
        want = op(*args, **options)
        numpy_args = [np.asarray(a) if a.dtype != jnp.bfloat16 else a for a in args]
        misplaced = [misplace(a) for a in args]
        eager = wrapper(*numpy_args, mesh=m, **options)
        jitted = jax.jit(lambda *x, w=wrapper, o=options: w(*x, mesh=m, **o))(*misplaced)
        for got, how in ((eager, "numpy, eager"), (jitted, "misplaced, jit")):
            close(got, want, f"{name} {how} [{kind}]")
            assert got.sharding.mesh == m, (name, how, got.sharding)
    print(f"placement_{kind} ok")


def check_plain_ops_explicit() -> None:
    """A plain op (every one, each implementation run here) under jax.jit takes inputs split
    over Explicit mesh axes, and equals its result on unsplit inputs."""
    m = mesh_of("explicit")
    sp = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    topk, lengths = dense_topk(sp)
    dec = C.decode_case(3, seq_lens=(5, 130, 300, 64), qlen=1, h=4, as_uint8=True)
    uq = C.uq_case(4, seq_lens=(1, 40, 100, 17), hk=4, g=2)
    o_parts = jnp.asarray(C.rng(5).standard_normal((4, 2, 4, 512)), jnp.float32)
    lse_parts = jnp.asarray(C.rng(6).standard_normal((4, 2, 4)), jnp.float32)
    calls = {  # name: (op, arguments, their specs, options)
        "sparse_mla": (
            jsm.sparse_mla,
            (sp.q, sp.kv, topk, None),
            (P("dp", "tp"), P(), P("dp"), None),
            {"topk_length": lengths, "validate": True},
        ),
        "mla_decode": (
            jsm.mla_decode,
            (dec.q, dec.kv, dec.kv_indices, dec.kv_indptr),
            (P("dp", "tp"), P(), P(), P()),
            {"num_splits": 2, "validate": True},
        ),
        "ultraquant_decode": (
            jsm.ultraquant_decode,
            (uq.q, uq.cache, uq.block_tables, uq.seq_lens),
            (P("dp", "tp"), P(None, None, "tp"), P("dp"), P("dp")),
            {"validate": True},
        ),
        "merge_attn_states": (
            jsm.merge_attn_states,
            (o_parts, lse_parts),
            (P("dp", None, "tp"), P("dp", None, "tp")),
            {},
        ),
    }
    for name, (op, args, specs, options) in calls.items():
        placed = [
            a if s is None else jax.device_put(jnp.asarray(a), NamedSharding(m, s))
            for a, s in zip(args, specs, strict=True)
        ]
        for impl in IMPLS:
            f = jax.jit(lambda *a, op=op, o=options, i=impl: op(*a, implementation=i, **o))
            close(f(*placed), f(*args), f"{name} explicit inputs [{impl}]")
    print("plain_ops_explicit ok")


def check_validation() -> None:
    """validate=True through a wrapper names the global position and is reported once (eager:
    the DataError itself; under jit one error, not one per device), on Explicit and Auto meshes;
    ``checked`` composes with the wrappers."""
    sp = C.sparse_case(1, n_q=4, h=8, n_rec=40)
    topk, _ = dense_topk(sp)
    bad = topk.copy()
    bad[3, 2] = 999
    message = "sparse_mla: idx[3, 2] = 999 is outside [0, 46)"
    for kind in ("explicit", "auto"):
        m = mesh_of(kind)

        def f(*a, m=m):
            return jsm.sparse_mla_sharded(*a, mesh=m, heads="tp", rows="dp", validate=True)

        for what, call in (("eager", f), ("checked", jsm.checked(jax.jit(f)))):
            try:
                call(sp.q, sp.kv, bad)
            except jsm.DataError as e:
                assert str(e).startswith(message), (kind, what, e)
            else:
                raise AssertionError(f"{kind} {what}: no DataError")
        try:
            jax.block_until_ready(jax.jit(f)(sp.q, sp.kv, bad))
        except jax.errors.JaxRuntimeError as e:
            assert str(e).count(message) == 1, (kind, str(e))
        else:
            raise AssertionError(f"{kind} jit: no error")
        want = jsm.sparse_mla(sp.q, sp.kv, topk)
        close(jsm.checked(jax.jit(f))(sp.q, sp.kv, topk), want, f"checked valid [{kind}]")
    print("validation ok")


def check_writers(kind: str) -> None:
    """The writers under jit with the cache donated and split along its first dimension (and,
    for UltraQuant, its KV heads) on an Explicit or Auto mesh: the bytes of one device's
    write, the split kept, no collective, the donated cache consumed (updated in place). A
    cache split along its bytes is gathered first: the same bytes."""
    m = mesh_of(kind)
    r = C.rng(12)
    slots = jnp.asarray([3, 70, -1, 127, 15, 200], jnp.int32)
    latent, rope = C.bf16_normal(r, (6, 512)), C.bf16_normal(r, (6, 64))
    k, v = C.bf16_normal(r, (6, 8, 256)), C.bf16_normal(r, (6, 8, 256))
    writes = {  # name: (writer, cache, its split, tokens, kept in place)
        "ds_mla": (jsm.concat_and_cache_ds_mla, (8, 16, 656), P("dp"), (latent, rope), True),
        "ds_mla bytes": (
            jsm.concat_and_cache_ds_mla,
            (8, 16, 656),
            P(None, None, "tp"),
            (latent, rope),
            False,
        ),
        "mla": (jsm.concat_and_cache_mla, (128, 576), P("dp"), (latent, rope), True),
        "ultraquant": (jsm.ultraquant_store, (4, 16, 8, 272), P("dp", None, "tp"), (k, v), True),
    }
    for name, (writer, shape, spec, tokens, kept) in writes.items():
        cache = jnp.asarray(r.integers(0, 256, shape), jnp.uint8)
        want = np.asarray(writer(cache, *tokens, slots % (cache.size // shape[-1] // 2)))
        split = jax.device_put(cache, NamedSharding(m, spec))
        f = jax.jit(
            lambda c, *t, w=writer: w(c, *t, slots % (c.size // c.shape[-1] // 2)), donate_argnums=0
        )
        assert (collectives(f, split, *tokens) == []) == kept, (name, kind)
        got = f(split, *tokens)
        assert np.array_equal(np.asarray(got), want), (name, kind)
        if kept:
            same = got.sharding.is_equivalent_to(NamedSharding(m, spec), got.ndim)
            assert same and split.is_deleted(), (name, kind, got.sharding)
    print(f"writers_{kind} ok")


def check_readme() -> None:
    """The README's Python code blocks, run as written (in order, in one namespace) over small
    arrays of the names they use."""
    r = C.rng(11)
    dec = C.decode_case(3, seq_lens=(5, 130, 300, 64, 1, 9, 17, 40), qlen=1, h=8)
    kv = np.concatenate([dec.kv_codes, np.zeros((-dec.kv_codes.shape[0] % 4, 576), np.uint8)])
    uq = C.uq_case(4, seq_lens=(1, 40, 100, 17, 3, 9, 20, 64), hk=4, g=2)
    names = {
        "cache": jnp.zeros((4, 16, 656), jnp.uint8),
        "latent": C.bf16_normal(r, (40, 512)),
        "rope": C.bf16_normal(r, (40, 64)),
        "slot_mapping": jnp.arange(40, dtype=jnp.int32),
        "q": dec.q,  # [8, 8, 576]: sparse_mla's n_q = 8 rows, mla_decode's B = 8 requests
        "topk_indices": jnp.asarray(r.integers(-1, 64, (8, 16)), jnp.int32),
        "kv": jnp.asarray(kv).view(jnp.float8_e4m3fn),
        "kv_indices": dec.kv_indices,
        "kv_indptr": dec.kv_indptr,
        "uq_q": uq.q,
        "uq_cache": uq.cache,
        "block_tables": uq.block_tables,
        "seq_lens": uq.seq_lens,
    }
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2, blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), names)
    assert names["out"].shape == (8, 8, 256), names["out"].shape
    print("readme ok")


CHECKS = {
    "sparse_mla": check_sparse_mla,
    "mla_decode": check_mla_decode,
    "ultraquant": check_ultraquant,
    "lowering": check_lowering,
    "pallas_interpret_refused": check_pallas_interpret_refused,
    "gradients_xla": functools.partial(check_gradients, "xla"),
    "gradients_gfx950_emulation": functools.partial(check_gradients, "gfx950_emulation"),
    "placement_explicit": functools.partial(check_placement, "explicit"),
    "placement_auto": functools.partial(check_placement, "auto"),
    "plain_ops_explicit": check_plain_ops_explicit,
    "validation": check_validation,
    "writers_explicit": functools.partial(check_writers, "explicit"),
    "writers_auto": functools.partial(check_writers, "auto"),
    "readme": check_readme,
}

if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    for name in sys.argv[1:] or CHECKS:
        CHECKS[name]()
