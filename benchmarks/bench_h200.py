"""Pallas kernels vs "xla" on one GPU: median time, effective bandwidth, TFLOP/s, speed-up.

    python benchmarks/bench_h200.py [--ops sparse_mla,mla_decode,ultraquant_decode] [--no-xla]

Every op is jitted and called back to back (asynchronous dispatch, so the GPU queue stays full);
one sample is the wall time of a batch of calls divided by its size, and the table gives the
median of the samples. "bytes" counts what must be read or written once: the records / cache
rows each query row attends to (per row: sparse_mla rows do not share their reads), q and the
output. "copy" is the device-to-device copy bandwidth (read + write) measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm

RECORDS = 200_000
TOPK = 2048
SAMPLES = 7
SAMPLE_SECONDS = 0.05
UQ_POOL_BLOCKS = 2048


def median_seconds(f, *args) -> float:
    """Median over SAMPLES batches of back-to-back calls (batch sized to ~SAMPLE_SECONDS)."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    calls = max(1, min(2000, int(SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    x = jnp.zeros((2**29,), jnp.uint32) + 1
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / median_seconds(f, x)


def _fp8_codes(key, shape):
    """Random finite e4m3fn codes (0x7F / 0xFF, the NaN codes, become 0x7E / 0xFE) as uint8."""
    bits = jax.random.bits(key, shape, jnp.uint8)
    return jnp.where(bits & 0x7F == 0x7F, bits - 1, bits)


def _as_bytes(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


def _q(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def sparse_mla_cases(key):
    k = jax.random.split(key, 4)
    scales = jnp.full((RECORDS, 4), 2.0**-4, jnp.float32)
    rope = jax.random.normal(k[1], (RECORDS, 64), jnp.float32).astype(jnp.bfloat16)
    records = jnp.concatenate(
        [_fp8_codes(k[0], (RECORDS, 512)), _as_bytes(scales), _as_bytes(rope)], axis=1
    )
    shapes = [(n_q, h) for n_q in (1, 32, 128, 1024) for h in (16, 128)] + [(256, 128)]
    for n_q, h in shapes:
        q = _q(k[2], (n_q, h, 576))
        idx, indptr = jsm.dense_to_csr(jax.random.randint(k[3], (n_q, TOPK), 0, RECORDS))
        nbytes = n_q * TOPK * 656 + q.nbytes + n_q * h * (512 * 2 + 4)
        flops = 2 * n_q * h * TOPK * (576 + 512)
        yield (
            f"n_q={n_q} H={h} topk={TOPK}",
            lambda impl: jax.jit(
                functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl)
            ),
            (q, records, idx, indptr),
            nbytes,
            flops,
        )


def mla_decode_cases(key):
    k = jax.random.split(key, 3)
    for b in (1, 32, 128):
        for seq in (8192, 32768):
            tokens = b * seq
            cache = _fp8_codes(k[0], (tokens, 576))
            pages = jax.random.permutation(k[1], tokens // 64)  # 64-token pages, shuffled
            kv_indices = (pages[:, None] * 64 + jnp.arange(64)).reshape(-1).astype(jnp.int32)
            kv_indptr = jnp.arange(b + 1, dtype=jnp.int32) * seq
            for qlen in (1, 2):
                q = _q(k[2], (b * qlen, 12, 576))
                nbytes = tokens * 576 + kv_indices.nbytes + q.nbytes + q.shape[0] * 12 * 1028
                flops = 2 * b * qlen * 12 * seq * (576 + 512)
                yield (
                    f"B={b} seq={seq} qlen={qlen} H=12",
                    lambda impl, qlen=qlen: jax.jit(
                        functools.partial(
                            jsm.mla_decode,
                            qlen=qlen,
                            k_scale=0.02,
                            v_scale=0.03,
                            return_lse=True,
                            implementation=impl,
                        )
                    ),
                    (q, cache, kv_indices, kv_indptr),
                    nbytes,
                    flops,
                )
            del cache


def ultraquant_cases(key):
    k = jax.random.split(key, 4)
    seq, bs, hk, g = 32768, 64, 8, 8
    for b in (1, 32, 128):
        blocks = b * seq // bs
        pool = min(blocks, UQ_POOL_BLOCKS)  # random blocks, repeated: random bits cost 4 B each
        codes = jax.random.bits(k[0], (pool, bs, hk, 2, 128), jnp.uint8)
        scales = jax.random.randint(k[1], (pool, bs, hk, 2, 8), 120, 131).astype(jnp.uint8)
        cache = jnp.concatenate([codes, scales], axis=-1).reshape(pool, bs, hk, 272)
        cache = jnp.tile(cache, (blocks // pool, 1, 1, 1))
        del codes, scales
        tables = jax.random.permutation(k[2], blocks).reshape(b, -1).astype(jnp.int32)
        seq_lens = jnp.full((b,), seq, jnp.int32)
        q = _q(k[3], (b, hk * g, 256))
        nbytes = b * seq * hk * 272 + tables.nbytes + 2 * q.nbytes
        flops = 2 * b * hk * g * seq * 512
        yield (
            f"B={b} seq={seq} Hk={hk} G={g}",
            lambda impl: jax.jit(functools.partial(jsm.ultraquant_decode, implementation=impl)),
            (q, cache, tables, seq_lens),
            nbytes,
            flops,
        )
        del cache


OPS = {
    "sparse_mla": sparse_mla_cases,
    "mla_decode": mla_decode_cases,
    "ultraquant_decode": ultraquant_cases,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--no-xla", action="store_true", help="skip the xla baseline")
    args = parser.parse_args()
    copy = copy_bandwidth()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; jax {jax.__version__}; copy {copy / 1e12:.2f} TB/s")
    header = (
        "| op | shape | pallas us | TB/s | % copy | TFLOP/s | xla us | speed-up |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    print(header, flush=True)
    key = jax.random.key(0)
    for op in args.ops.split(","):
        for name, make, inputs, nbytes, flops in OPS[op](key):
            t = median_seconds(make("pallas"), *inputs)
            xla = float("nan") if args.no_xla else median_seconds(make("xla"), *inputs)
            print(
                f"| {op} | {name} | {t * 1e6:.1f} | {nbytes / t / 1e12:.2f} | "
                f"{100 * nbytes / t / copy:.0f}% | {flops / t / 1e12:.0f} | "
                f"{xla * 1e6:.0f} | {xla / t:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
