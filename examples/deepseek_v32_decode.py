"""A DeepSeek-V3.2-style sparse attention layer decoding over an fp8_ds_mla cache, sharded.

One attention layer in plain JAX, as DeepSeek-V3.2 decodes a batch of requests:

- MLA with the absorbed up-projection: each head's position-free query part (128-d) goes
  through W_UK into the 512-d latent space, so every head reads the same cached record per
  token (latent 512 ‖ rope 64 = 576), and ``sparse_mla``'s 512-d output goes back through W_UV
  (128-d per head) and W_O.
- A lightning-indexer-like scorer: a few indexer heads score every written position
  (``sum_g w_g relu(q_g · k_j)``); each query keeps its top-k positions (``jax.lax.top_k``),
  -1 where fewer than top-k positions are written yet.
- ``concat_and_cache_ds_mla`` writes each new token's record into the fp8_ds_mla cache in
  place (the jitted step donates the cache).
- ``sparse_mla_sharded`` attends over the selected records (the indexer's [n_q, topk] layout)
  with the heads split over every available device (a "tp" mesh axis; the per-head weights
  are split the same way). On one device it is the plain op.

The prompt is written into the cache first (prefill writes records only; it does not attend),
then a jitted step decodes ``--steps`` tokens per request, each step's output feeding the next.
Self-check, per step, request and head: ``sparse_mla``'s output against a dense float32
attention (every selected key gathered, HIGHEST precision) over the same selected keys, (1)
dequantized from the same fp8 cache: the op's own error, bounded below; (2) the unquantized
latents the model wrote: adds the cache's fp8 quantization, printed for information. Exits 1
when (1) exceeds its bound.

Run: .venv/bin/python examples/deepseek_v32_decode.py [--batch 4 --heads 16 --steps 16 ...]
on 8 virtual CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (same command).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sparse_mla as jsm

LATENT, ROPE, NOPE, V_HEAD = 512, 64, 128, 128  # DeepSeek-V3.2's MLA dims
# DeepSeek-V3.2's softmax scale: 1/sqrt(192) (q/k head dim before absorption: 128 nope + 64
# rope) times the YaRN mscale squared (rope_scaling factor 40, mscale_all_dim 1).
SM_SCALE = (NOPE + ROPE) ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
# (1)'s bound, relative to the largest |reference| of the (request, head) row. "xla": the
# exact float32 attention rounded once to bf16 (<= 2^-8 relative), plus float32 summation
# order: 2^-7. The kernels ("pallas", "mosaic", "gfx950_emulation", "flydsl") round P to bf16
# / fp16 and (gfx950) split q into fp8 parts: 2^-5.
BOUNDS = {
    "xla": 2.0**-7,
    "pallas": 2.0**-5,
    "mosaic": 2.0**-5,
    "gfx950_emulation": 2.0**-5,
    "flydsl": 2.0**-5,
}
_HIGHEST = jax.lax.Precision.HIGHEST


class Config(NamedTuple):
    batch: int  # requests decoded together
    prompt: int  # the longest prompt; request b's is prompt - 37 b tokens (at least 1)
    steps: int  # tokens decoded per request
    d_model: int
    heads: int
    q_rank: int  # the query's low-rank dim (q_lora_rank)
    index_heads: int
    index_dim: int
    topk: int

    @property
    def max_len(self) -> int:
        return self.prompt + self.steps


class Params(NamedTuple):
    w_dq: jax.Array  # [d_model, q_rank]
    w_uq: jax.Array  # [q_rank, H, 128 + 64]: q nope ‖ q rope
    w_dkv: jax.Array  # [d_model, 512 + 64]: latent ‖ k rope
    w_uk: jax.Array  # [H, 128, 512]: absorbed into the query
    w_uv: jax.Array  # [H, 512, 128]
    w_o: jax.Array  # [H, 128, d_model]
    w_iq: jax.Array  # [q_rank, index_heads, index_dim]
    w_ik: jax.Array  # [d_model, index_dim]
    w_iw: jax.Array  # [d_model, index_heads]


# The per-head weights split over "tp" like the heads; the rest is replicated.
PARAM_SPECS = Params(
    w_dq=P(),
    w_uq=P(None, "tp", None),
    w_dkv=P(),
    w_uk=P("tp", None, None),
    w_uv=P("tp", None, None),
    w_o=P("tp", None, None),
    w_iq=P(),
    w_ik=P(),
    w_iw=P(),
)


def init_params(cfg: Config, key: jax.Array) -> Params:
    """Random float32 weights, each scaled by 1/sqrt(its fan-in)."""
    h = cfg.heads
    shapes = Params(
        w_dq=((cfg.d_model, cfg.q_rank), cfg.d_model),
        w_uq=((cfg.q_rank, h, NOPE + ROPE), cfg.q_rank),
        w_dkv=((cfg.d_model, LATENT + ROPE), cfg.d_model),
        w_uk=((h, NOPE, LATENT), NOPE),
        w_uv=((h, LATENT, V_HEAD), LATENT),
        w_o=((h, V_HEAD, cfg.d_model), h * V_HEAD),
        w_iq=((cfg.q_rank, cfg.index_heads, cfg.index_dim), cfg.q_rank),
        w_ik=((cfg.d_model, cfg.index_dim), cfg.d_model),
        w_iw=((cfg.d_model, cfg.index_heads), cfg.d_model),
    )
    keys = jax.random.split(key, len(shapes))
    return Params(
        *(
            jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5
            for k, (shape, fan_in) in zip(keys, shapes, strict=True)
        )
    )


def rms_norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rotary(x: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotary embedding of x [..., 64] at positions ``pos`` (broadcast against x[..., 0])."""
    freq = 10000.0 ** (-jnp.arange(ROPE // 2, dtype=jnp.float32) / (ROPE // 2))
    angle = pos[..., None].astype(jnp.float32) * freq
    x1, x2 = x[..., : ROPE // 2], x[..., ROPE // 2 :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def write_tokens(params: Params, cache, index_keys, x, pos, slots):
    """Writes tokens x [T, d_model] at positions pos [T] into the record slots ``slots`` [T]
    (-1 skips a token) of the fp8_ds_mla cache [B, max_len, 656] and the indexer's float32 key
    cache [B, max_len, index_dim]. Returns both caches and the records' unquantized
    latent ‖ rope [T, 576] float32."""
    ckv = x @ params.w_dkv
    latent, rope = rms_norm(ckv[:, :LATENT]), rotary(ckv[:, LATENT:], pos)
    cache = jsm.concat_and_cache_ds_mla(cache, latent, rope, slots)
    flat = index_keys.reshape(-1, index_keys.shape[-1])
    flat = flat.at[slots].set(x @ params.w_ik, mode="drop")
    return cache, flat.reshape(index_keys.shape), jnp.concatenate([latent, rope], axis=-1)


def select_keys(cfg: Config, params: Params, cq, x, index_keys, pos) -> jax.Array:
    """The indexer: [B, topk] int32 cache rows (b * max_len + position) with the top-k scores
    among positions <= pos[b], -1 for the slots that no written position fills."""
    iq = jnp.einsum("bc,cgd->bgd", cq, params.w_iq)
    weights = (x @ params.w_iw) * cfg.index_heads**-0.5
    logits = jnp.einsum("bgd,btd->bgt", iq, index_keys) * cfg.index_dim**-0.5
    score = jnp.einsum("bg,bgt->bt", weights, jax.nn.relu(logits))
    written = jnp.arange(cfg.max_len)[None, :] <= pos[:, None]
    top, at = jax.lax.top_k(jnp.where(written, score, -jnp.inf), cfg.topk)
    rows = jnp.arange(cfg.batch, dtype=jnp.int32)[:, None] * cfg.max_len + at
    return jnp.where(top > -jnp.inf, rows, -1).astype(jnp.int32)


def decode_step(cfg: Config, mesh, implementation, params: Params, cache, index_keys, x, pos):
    """One token per request: x [B, d_model] float32 at positions pos [B] int32. Returns the
    caches, the next step's input (the residual stream ``rms_norm(x + layer output)``) and
    positions, and what the check needs: q [B, H, 576] bf16, idx [B, topk] int32,
    sparse_mla's out [B, H, 512] bf16 and the new records' latent ‖ rope [B, 576] float32."""
    slots = jnp.arange(cfg.batch, dtype=jnp.int32) * cfg.max_len + pos
    cache, index_keys, record = write_tokens(params, cache, index_keys, x, pos, slots)
    cq = rms_norm(x @ params.w_dq)
    q = jnp.einsum("bc,chd->bhd", cq, params.w_uq)
    q_latent = jnp.einsum("bhn,hnl->bhl", q[..., :NOPE], params.w_uk)  # absorbed W_UK
    q = jnp.concatenate([q_latent, rotary(q[..., NOPE:], pos[:, None])], axis=-1)
    q = q.astype(jnp.bfloat16)
    idx = select_keys(cfg, params, cq, x, index_keys, pos)
    out = jsm.sparse_mla_sharded(
        q, cache, idx, mesh=mesh, heads="tp", sm_scale=SM_SCALE, implementation=implementation
    )
    heads_out = jnp.einsum("bhl,hlv->bhv", out.astype(jnp.float32), params.w_uv)
    # the heads' sum over "tp": the layer's one all-reduce
    y = jnp.einsum("bhv,hvd->bd", heads_out, params.w_o, out_sharding=NamedSharding(mesh, P()))
    return cache, index_keys, rms_norm(x + y), pos + 1, (q, idx, out, record)


@jax.jit
def dense_attention(q, keys, idx):
    """Float32 attention of q [B, H, 576] over every selected key keys [B, topk, 576] (V = the
    first 512 dims), keys where idx [B, topk] < 0 masked. Returns [B, H, 512] float32."""
    s = jnp.einsum("bhd,btd->bht", q.astype(jnp.float32), keys, precision=_HIGHEST) * SM_SCALE
    s = jnp.where(idx[:, None, :] >= 0, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bht,btl->bhl", p, keys[..., :LATENT], precision=_HIGHEST)


def max_row_error(out, ref) -> float:
    """max over (request, head) of max |out - ref| / max |ref|."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    err = np.max(np.abs(out - ref), axis=-1) / np.maximum(np.max(np.abs(ref), axis=-1), 1e-30)
    return float(err.max())


def parse() -> tuple[Config, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-rank", type=int, default=384)
    ap.add_argument("--index-heads", type=int, default=4)
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument(
        "--implementation",
        default=None,
        choices=sorted(BOUNDS),
        help=(
            "sparse_mla's implementation (default: the platform's choice). xla, "
            "gfx950_emulation: every platform; flydsl: ROCm on an AMD MI355 (gfx950) with the "
            "kernels built (BUILD.md); mosaic: NVIDIA Hopper (sm_90) GPUs; pallas: NVIDIA GPUs "
            "(elsewhere Pallas interpret mode, which cannot run under this example's "
            "shard_map). Asked for elsewhere, a kernel fails when compiled, saying what it needs"
        ),
    )
    a = ap.parse_args()
    cfg = Config(
        a.batch,
        a.prompt,
        a.steps,
        a.d_model,
        a.heads,
        a.q_rank,
        a.index_heads,
        a.index_dim,
        a.topk,
    )
    if cfg.steps < 2 or cfg.prompt < 1 or cfg.topk > cfg.max_len:
        ap.error("need --steps >= 2, --prompt >= 1 and --topk <= prompt + steps")
    return cfg, a.implementation


def main() -> int:
    cfg, implementation = parse()
    n_dev = math.gcd(len(jax.devices()), cfg.heads)  # heads split evenly over the mesh
    mesh = jax.make_mesh((n_dev,), ("tp",), devices=jax.devices()[:n_dev])
    replicated = NamedSharding(mesh, P())
    print(
        f"jax {jax.__version__} on {n_dev} of {len(jax.devices())} {jax.default_backend()} "
        f"device(s), heads over 'tp'; B={cfg.batch} H={cfg.heads} topk={cfg.topk} "
        f"prompt<={cfg.prompt} steps={cfg.steps} sm_scale={SM_SCALE:.4f}"
    )
    params = jax.device_put(
        init_params(cfg, jax.random.key(0)),
        Params(*(NamedSharding(mesh, s) for s in PARAM_SPECS)),
    )
    rng = np.random.default_rng(0)
    lengths = np.maximum(cfg.prompt - 37 * np.arange(cfg.batch), 1).astype(np.int32)
    cache = jax.device_put(jnp.zeros((cfg.batch, cfg.max_len, 656), jnp.uint8), replicated)
    index_keys = jax.device_put(
        jnp.zeros((cfg.batch, cfg.max_len, cfg.index_dim), jnp.float32), replicated
    )
    plain = np.zeros((cfg.batch * cfg.max_len, LATENT + ROPE), np.float32)  # for check (2)

    # Prefill: the prompts' records (positions past a request's prompt length are skipped).
    prompt_x = rng.normal(size=(cfg.batch * cfg.prompt, cfg.d_model)).astype(np.float32)
    pos = np.tile(np.arange(cfg.prompt, dtype=np.int32), cfg.batch)
    b = np.repeat(np.arange(cfg.batch, dtype=np.int32), cfg.prompt)
    slots = np.where(pos < lengths[b], b * cfg.max_len + pos, -1).astype(np.int32)
    prefill = jax.jit(write_tokens, donate_argnums=(1, 2))
    cache, index_keys, records = prefill(params, cache, index_keys, prompt_x, pos, slots)
    plain[slots[slots >= 0]] = np.asarray(records)[slots >= 0]

    step = jax.jit(functools.partial(decode_step, cfg, mesh, implementation), donate_argnums=(1, 2))
    x = rms_norm(rng.normal(size=(cfg.batch, cfg.d_model)).astype(np.float32))
    x, pos = jax.device_put((x, lengths), replicated)  # as the step returns them: one compile
    checks, start = [], None
    for t in range(cfg.steps):
        if t == 1:  # step 0 compiled the step; time the others
            jax.block_until_ready(x)
            start = time.perf_counter()
        cache, index_keys, x, next_pos, check = step(params, cache, index_keys, x, pos)
        checks.append((pos, check))
        pos = next_pos
    jax.block_until_ready((cache, x))
    elapsed = time.perf_counter() - start
    tokens = cfg.batch * (cfg.steps - 1)

    stored = jnp.concatenate(jsm.unpack_fp8_ds_mla(cache.reshape(-1, 656)), axis=-1)
    stored = stored.astype(jnp.float32)
    err_cache = err_plain = 0.0
    for step_pos, (q, idx, out, record) in checks:
        rows = np.asarray(jnp.arange(cfg.batch) * cfg.max_len + step_pos)
        plain[rows] = np.asarray(record)
        safe = np.maximum(np.asarray(idx), 0)
        err_cache = max(err_cache, max_row_error(out, dense_attention(q, stored[safe], idx)))
        err_plain = max(err_plain, max_row_error(out, dense_attention(q, plain[safe], idx)))
    # None: "xla" on the CPU, a kernel elsewhere (Pallas on Hopper, FlyDSL on gfx950)
    bound = BOUNDS[implementation or ("xla" if jax.default_backend() == "cpu" else "flydsl")]
    print(
        f"decode: {tokens} tokens in {elapsed * 1e3:.1f} ms = {tokens / elapsed:.1f} tokens/s "
        f"(steps 2..{cfg.steps}, after compilation)\n"
        f"sparse_mla out vs dense float32 attention over the same selected keys, max over "
        f"(request, head) of max|err| / max|ref|:\n"
        f"  (1) keys dequantized from the same fp8_ds_mla cache: {err_cache:.2e} "
        f"(the op's error; bound {bound:.2e})\n"
        f"  (2) keys from the unquantized latents:               {err_plain:.2e} "
        f"(adds the cache's fp8 e4m3 quantization; not bounded)"
    )
    if not err_cache <= bound:
        print(f"FAILED: error (1) {err_cache:.2e} > bound {bound:.2e}")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
