"""Memory of the exact ("xla") sparse_mla for one long row: it must not grow with the row.

For each (keys per row, heads) it prints XLA's compiled temporary-buffer size and the peak RSS
increase of a fresh process that compiles and runs the op (the cache itself excluded).

Run: .venv/bin/python benchmarks/memory_sparse_mla.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm


def make_inputs(n_keys: int, heads: int):
    rng = np.random.default_rng(0)
    records = np.zeros((n_keys, 656), np.uint8)
    records[:, :512] = rng.integers(0, 0x7E, size=(n_keys, 512), dtype=np.uint8)
    records[:, 512:528] = np.full((n_keys, 4), 2.0**-4, np.float32).view(np.uint8)
    q = jnp.asarray(rng.normal(size=(1, heads, 576)), jnp.bfloat16)
    idx = jnp.asarray(rng.permutation(n_keys).astype(np.int32))
    return q, jnp.asarray(records), idx, jnp.asarray([0, n_keys], jnp.int32)


def measure(n_keys: int, heads: int) -> dict:
    args = make_inputs(n_keys, heads)
    fn = jax.jit(lambda *a: jsm.sparse_mla(*a, return_lse=True))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compiled = fn.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {
        "temp_mb": temp / 2**20,
        "rss_mb": (after - before) / 1024,
        "cache_mb": args[1].nbytes / 2**20,
    }


def main() -> None:
    if len(sys.argv) == 3:  # child process: one measurement
        print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
        return
    print(f"sparse_mla 'xla', one query row, jax {jax.__version__} on {jax.default_backend()}")
    print(f"{'keys':>8} {'H':>4} {'cache MB':>9} {'XLA temp MB':>12} {'peak RSS +MB':>13}")
    for n_keys in (2_000, 20_000, 200_000):
        for heads in (16, 128):
            res = subprocess.run(
                [sys.executable, __file__, str(n_keys), str(heads)],
                check=True,
                capture_output=True,
                text=True,
            )
            m = json.loads(res.stdout.strip().splitlines()[-1])
            sizes = f"{m['cache_mb']:>9.1f} {m['temp_mb']:>12.1f} {m['rss_mb']:>13.1f}"
            print(f"{n_keys:>8} {heads:>4} {sizes}")


if __name__ == "__main__":
    main()
