"""Quickstart: every op inside ``jax.jit`` on the default backend, checked against float64 NumPy.

Builds a small random fp8_ds_mla cache, runs ``sparse_mla`` (CSR indices with -1 padding),
``mla_decode`` (causal, split KV) and ``ultraquant_decode`` (4-bit paged cache), and prints each
op's max error against a float64 NumPy computation over the same dequantized cache, for the
default implementation of this backend and for the gfx950 kernels' emulation.

Run: .venv/bin/python examples/quickstart.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from jax_sparse_mla.formats import ultraquant_unpack


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float):
    """float64 attention of q [H, D] over k [N, D], v [N, Dv] -> (out [H, Dv], lse [H])."""
    if len(k) == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    s = scale * q @ k.T
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(axis=1, keepdims=True), (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# None: the best implementation for the default backend (the Mosaic GPU kernels on a Hopper GPU,
# the FlyDSL ones on an MI355, "xla" elsewhere); "gfx950_emulation": the MI355 kernels' own
# arithmetic, on any backend.
IMPLEMENTATIONS = (None, "gfx950_emulation")


def timed_jit(fn, *args):
    """(result, seconds of the second call) of ``jax.jit(fn)(*args)``."""
    run = jax.jit(fn)
    run(*args)
    t0 = time.perf_counter()
    out = jax.block_until_ready(run(*args))
    return out, time.perf_counter() - t0


def label(op: str, impl: str | None) -> str:
    return f"{op:12} {impl or 'default':17}"


def demo_sparse_mla(rng: np.random.Generator) -> None:
    n_records, n_q, heads, topk = 4096, 32, 16, 512
    latent = rng.normal(size=(n_records, 512)) * rng.uniform(0.1, 8, size=(n_records, 1))
    rope = rng.normal(size=(n_records, 64))
    cache = jnp.zeros((n_records // 64, 64, 656), jnp.uint8)  # [blocks, block_size, 656]
    slots = jnp.arange(n_records, dtype=jnp.int32)
    cache = jax.jit(jsm.concat_and_cache_ds_mla, donate_argnums=0)(
        cache, jnp.asarray(latent, jnp.bfloat16), jnp.asarray(rope, jnp.bfloat16), slots
    )
    q = jnp.asarray(rng.normal(size=(n_q, heads, 576)), jnp.bfloat16)
    topk_idx = rng.integers(0, n_records, size=(n_q, topk)).astype(np.int32)
    topk_idx[:, rng.integers(topk // 2, topk) :] = -1  # -1 padding at the end of every row
    topk_idx[3] = -1  # an all-masked row: out 0, lse -inf
    idx, indptr = jsm.dense_to_csr(jnp.asarray(topk_idx))

    lat, rp = jsm.unpack_fp8_ds_mla(cache.reshape(-1, 656))
    k, v = np.concatenate([f64(lat), f64(rp)], axis=1), f64(lat)
    refs = []
    for r in range(n_q):
        keys = topk_idx[r][topk_idx[r] >= 0]
        refs.append(softmax_attention(f64(q[r]), k[keys], v[keys], 576**-0.5))

    for impl in IMPLEMENTATIONS:
        (out, lse), elapsed = timed_jit(
            lambda *a, impl=impl: jsm.sparse_mla(*a, return_lse=True, implementation=impl),
            q,
            cache,
            idx,
            indptr,
        )
        err, lse_err = 0.0, 0.0
        for r, (ref, ref_lse) in enumerate(refs):
            err = max(err, np.abs(f64(out[r]) - ref).max() / max(np.abs(ref).max(), 1e-30))
            fin = np.isfinite(ref_lse)
            lse_err = max(
                lse_err, np.abs(np.asarray(lse[r], np.float64)[fin] - ref_lse[fin]).max(initial=0)
            )
        finite = np.asarray(lse)[np.isfinite(np.asarray(lse))]
        print(
            f"{label('sparse_mla', impl)} n_q={n_q} H={heads} topk={topk}: "
            f"{elapsed * 1e3:7.1f} ms  max rel err {err:.2e}  max lse err {lse_err:.1e}  "
            f"lse range [{finite.min():.2f}, {finite.max():.2f}], masked row lse {float(lse[3, 0])}"
        )


def demo_mla_decode(rng: np.random.Generator) -> None:
    tokens, batch, qlen, heads = 8192, 4, 2, 12
    kv = jnp.asarray(rng.normal(size=(tokens, 576)) * 4, jnp.float8_e4m3fn)
    seq_lens = np.array([1, 300, 1000, 2048])
    indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    indices = rng.integers(0, tokens, size=indptr[-1]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(batch * qlen, heads, 576)), jnp.bfloat16)
    k_scale = 0.25
    codes = f64(kv) * k_scale
    refs = []
    for b in range(batch):
        keys = codes[indices[indptr[b] : indptr[b + 1]]]
        for i in range(qlen):
            visible = keys[: max(seq_lens[b] - qlen + i + 1, 0)]
            ref = softmax_attention(f64(q[b * qlen + i]), visible, visible[:, :512], 576**-0.5)
            refs.append(ref)

    for impl in IMPLEMENTATIONS:
        out, elapsed = timed_jit(
            lambda *a, impl=impl: jsm.mla_decode(
                *a, qlen=qlen, k_scale=k_scale, v_scale=k_scale, num_splits=4, implementation=impl
            ),
            q,
            kv,
            jnp.asarray(indices),
            jnp.asarray(indptr),
        )
        err = max(
            np.abs(f64(out[row]) - ref).max() / max(np.abs(ref).max(), 1e-30)
            for row, (ref, _) in enumerate(refs)
        )
        print(
            f"{label('mla_decode', impl)} B={batch} qlen={qlen} H={heads} seq<=2048: "
            f"{elapsed * 1e3:7.1f} ms  max rel err {err:.2e}"
        )


def demo_ultraquant(rng: np.random.Generator) -> None:
    num_blocks, block_size, kv_heads, group, batch = 64, 64, 2, 8, 3
    cache = jnp.zeros((num_blocks, block_size, kv_heads, 272), jnp.uint8)
    n = num_blocks * block_size
    k = jnp.asarray(rng.normal(size=(n, kv_heads, 256)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(n, kv_heads, 256)), jnp.bfloat16)
    cache = jax.jit(jsm.ultraquant_store, donate_argnums=0)(
        cache, k, v, jnp.arange(n, dtype=jnp.int32)
    )
    tables = np.stack([rng.permutation(num_blocks)[:16] for _ in range(batch)]).astype(np.int32)
    seq_lens = np.array([5, 600, 1024], np.int32)
    q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, 256)), jnp.bfloat16)
    k_stored, v_deq = (f64(x) for x in ultraquant_unpack(cache))
    # K is stored rotated (H/16): the op rotates q the same way (the rotation cancels in q·k)
    # and rounds it to e4m3 (saturating at ±448), as UltraQuant's own implementations do.
    q_rot = jnp.clip(jsm.formats.ultraquant_rotate(q), -448, 448)
    q_rot = f64(q_rot.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    refs = {}
    for b in range(batch):
        pos = np.arange(seq_lens[b])
        blk, off = tables[b, pos // block_size], pos % block_size
        for h in range(kv_heads * group):
            kh = h // group
            refs[b, h], _ = softmax_attention(
                q_rot[b, h : h + 1], k_stored[blk, off, kh], v_deq[blk, off, kh], 1 / 16
            )

    for impl in IMPLEMENTATIONS:
        out, elapsed = timed_jit(
            lambda *a, impl=impl: jsm.ultraquant_decode(*a, implementation=impl),
            q,
            cache,
            jnp.asarray(tables),
            jnp.asarray(seq_lens),
        )
        err = max(
            np.abs(f64(out[b, h]) - ref[0]).max() / np.abs(ref).max()
            for (b, h), ref in refs.items()
        )
        print(
            f"{label('ultraquant', impl)} B={batch} Hq={kv_heads * group} Hk={kv_heads} "
            f"seq<=1024: {elapsed * 1e3:7.1f} ms  max rel err {err:.2e}"
        )


def main() -> None:
    print(
        f"jax {jax.__version__}, default backend: {jax.default_backend()} "
        f"({jax.devices()[0].device_kind})"
    )
    print(
        "max rel err = max |out - float64 reference| / max |reference| per row; bf16 output\n"
        "rounding alone can reach 2^-8 = 3.9e-03; the GPU kernels round P to bf16 for P @ V,\n"
        "which can add about as much; the gfx950 emulation adds the kernels' own roundings\n"
        "(fp8 q split, fp16 / bf16 P)"
    )
    rng = np.random.default_rng(0)
    demo_sparse_mla(rng)
    demo_mla_decode(rng)
    demo_ultraquant(rng)


if __name__ == "__main__":
    main()
