"""What one jitted call costs the host, by the number of XLA kernels it launches.

    python benchmarks/dispatch_cost.py [--kernels 1,2,3,5,9,17,33] [--samples 10] [--sample-ms 50]

Each row times a jitted chain of k dependent steps (``x * 1.001 + 1`` on a [16, 512] bf16
array, each behind ``lax.optimization_barrier`` so that XLA does not fuse them: k kernels on a
GPU) called back to back, as ``bench.py`` times its cases (one sample = a batch's wall time / its
calls). The device does next to nothing, so the times are the host's: the floor under any
jitted call, and what each further kernel adds. Small ``sparse_mla`` / decode calls (a Mosaic or
Pallas kernel and a few XLA kernels around it) sit on this floor.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from bench import sample_times, spread  # benchmarks/ is this script's folder


def chain(k: int):
    """A jitted function of k dependent elementwise steps that XLA keeps apart."""

    def steps(x):
        for _ in range(k):
            x = jax.lax.optimization_barrier(x * 1.001 + 1)
        return x

    return jax.jit(steps)


def compiled_kernels(fn, *args) -> int:
    """Fusions and custom calls in the compiled program's entry computation."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    lines = entry[: entry.index("\n}")].splitlines()
    return sum(1 for line in lines if re.search(r" (fusion|custom-call)\(", line))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="1,2,3,5,9,17,33", help="comma list of chain lengths")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--sample-ms", type=float, default=50.0)
    args = p.parse_args(argv)
    lengths = [int(k) for k in args.kernels.split(",") if k]
    x = jnp.ones((16, 512), jnp.bfloat16)
    device = jax.devices()[0].device_kind
    print(f"device: {device} ({jax.default_backend()}); jax {jax.__version__}")
    print("| steps | kernels | median us | p10 us | p90 us | us per step past the first row's |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for k in lengths:
        fn = chain(k)
        times, _ = sample_times(
            lambda fn=fn: fn(x),
            jax.block_until_ready,
            samples=args.samples,
            sample_s=args.sample_ms / 1e3,
        )
        row = {"steps": k, "kernels": compiled_kernels(fn, x), **spread(times)}
        first = rows[0] if rows else row
        extra = k - first["steps"]
        per = (row["median_s"] - first["median_s"]) / extra * 1e6 if extra > 0 else None
        rows.append(row)
        print(
            f"| {k} | {row['kernels']} | {row['median_s'] * 1e6:.1f} | {row['p10_s'] * 1e6:.1f} "
            f"| {row['p90_s'] * 1e6:.1f} | {'' if per is None else f'{per:.2f}'} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
