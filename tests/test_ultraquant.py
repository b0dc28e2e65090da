"""ultraquant_decode against the float64 oracle, every implementation (tests/impls.py) with its
own tolerance (caches written by the library's ultraquant_store over NaN garbage; the oracle
decodes the bytes independently). The op's q is rotated and rounded to e4m3 in every
implementation and in the oracle; ``exact_q=True`` (xla, pallas, mosaic) keeps it float32."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import impls
from tests import oracle as O


def run(case, impl, num_partitions=None, sm_scale=1 / 16):
    f = impls.with_scales(
        jsm.ultraquant_decode, impl, dict(sm_scale=sm_scale), num_partitions=num_partitions
    )
    out = f(*case.args())
    assert out.dtype == jnp.bfloat16 and out.shape == case.q.shape
    return out


def check(
    impl, case, out, sm_scale=1 / 16, num_partitions=None, what="ultraquant_decode", exact_q=False
):
    impls.check_uq(impl, case, out, sm_scale, num_partitions, what, exact_q)


@impls.each_ultraquant
@pytest.mark.parametrize("g,hk", [(6, 1), (8, 2), (16, 1), (1, 2), (3, 2)])
def test_groups(impl, g, hk):
    case = C.uq_case(g * 10 + hk, seq_lens=(1, 40, 100), hk=hk, g=g, bs=16)
    check(impl, case, run(case, impl))


@pytest.mark.parametrize("impl", [i for i in impls.available("ultraquant_decode") if i != "flydsl"])
@pytest.mark.parametrize("g", [17, 32])
def test_groups_past_16(impl, g):
    """17 to 32 query heads per KV head: the Mosaic kernel's 32-row CTAs (the gfx950 kernel
    takes at most 16 and refuses more by name)."""
    case = C.uq_case(g * 10 + 1, seq_lens=(1, 40, 100), hk=2, g=g, bs=16)
    check(impl, case, run(case, impl))


@impls.each_ultraquant
@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("bs", [16, 32, 48, 64, 128, 256])
def test_block_sizes(impl, bs, hk):
    """Partial pages and tiles. On the Mosaic kernel hk=2 with pages that tile its 64-key
    tiles (or that they tile) takes the TMA boxes (one per page, or per 64 keys of a larger
    page); hk=1 (272-byte rows, narrower than a box) and bs=48 the producer's lane copies."""
    case = C.uq_case(bs + hk, seq_lens=(1, bs - 1, bs, bs + 1, 2 * bs + 7), hk=hk, g=8, bs=bs)
    check(impl, case, run(case, impl))


@pytest.mark.parametrize(
    "impl, num_partitions",
    [
        (i, p)
        for i in impls.available("ultraquant_decode")
        # None: the implementation's own choice; 3: uneven; 8: idle partitions (3-token request)
        for p in ((None, 1, 2, 3, 5, 8) if i == "xla" else (None, 1, 3, 8))
    ],
)
def test_num_partitions_same_answer(impl, num_partitions):
    case = C.uq_case(7, seq_lens=(3, 130, 257, 500), hk=2, g=6, bs=16)
    out = run(case, impl, num_partitions)
    check(impl, case, out, num_partitions=num_partitions, what=f"P={num_partitions}")


def test_default_is_the_platform_choice():
    """implementation=None (eager) runs what it picks on this machine (impls.default)."""
    case = C.uq_case(8, seq_lens=(5, 33), hk=1, g=8, bs=16)
    chosen = impls.default("ultraquant_decode")
    out = jsm.ultraquant_decode(*case.args())
    check(chosen, case, out)
    out2 = jsm.ultraquant_decode(*case.args(), implementation=chosen)
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))


@impls.each_ultraquant
def test_seq_lens_clamped_and_empty(impl):
    # request 0: seq_len 0; request 1: negative; request 2: past the table's capacity (clamped to
    # max_blocks * bs, every table entry is a written block); request 3: normal
    bs, max_blocks = 16, 3
    case = C.uq_case(
        9, seq_lens=(0, -5, bs * max_blocks, 20), hk=1, g=8, bs=bs, max_blocks=max_blocks
    )
    case.seq_lens = np.int32([0, -5, 10**6, 20])
    out = run(case, impl)
    check(impl, case, out)
    out = np.asarray(out, np.float32)
    assert np.all(out[0] == 0) and np.all(out[1] == 0)
    case.seq_lens = np.int32([0, -(2**31), 2**31 - 1, 20])
    check(impl, case, run(case, impl))


@impls.each_ultraquant
@pytest.mark.parametrize("bs", [16, 64])
def test_masked_blocks(impl, bs):
    """Block-table entries out of range inside the sequences mask their tokens (whole blocks;
    on the Mosaic kernel a TMA box from past the cache's rows, which arrives as zeros)."""
    seq_lens = (40, 100, 16) if bs == 16 else (150, 300, 64)
    case = C.uq_case(10 + bs, seq_lens=seq_lens, hk=2, g=8, bs=bs, p_bad_block=0.4)
    check(impl, case, run(case, impl))


@impls.each_ultraquant
def test_sm_scale_and_peaky(impl):
    case = C.uq_case(11, seq_lens=(64, 200), hk=1, g=16, bs=32, q_scale=6.0)
    check(impl, case, run(case, impl, sm_scale=0.5), sm_scale=0.5)
    check(impl, case, run(case, impl, sm_scale=0.01), sm_scale=0.01)


@impls.each_ultraquant
def test_scores_rising_along_the_sequence(impl):
    """K grows 2^4 along each sequence, so that the running max of the scores rises from one
    64-key tile to the next: by more than 8 (log2 units; the Mosaic kernel's rescale slack) at
    6 of request 0's 10 tiles and all 5 of request 1's (the first tiles among them), by less at
    request 0's other 4."""
    case = C.uq_case(15, seq_lens=(640, 300), hk=1, g=8, bs=64, k_ramp=4, q_scale=0.5)
    check(impl, case, run(case, impl))


@impls.each_ultraquant
def test_padding_slot_bytes(impl):
    case = C.uq_case(12, seq_lens=(30, 70), hk=2, g=6, bs=16, slot_bytes=288)
    check(impl, case, run(case, impl))


@impls.each_ultraquant
def test_store_skips_tokens(impl):
    # tokens with slot -1 / out of range carry huge K/V: if written anywhere, outputs change
    case = C.uq_case(13, seq_lens=(50,), hk=1, g=8, bs=16)
    skipped = (case.slot_mapping < 0) | (case.slot_mapping >= case.cache.shape[0] * 16)
    assert skipped.sum() == 3
    ref, _ = O.ultraquant_decode(case.q, case.cache, case.block_tables, case.seq_lens)
    assert np.max(np.abs(ref)) < 100  # the skipped tokens' V are ~1000x larger
    check(impl, case, run(case, impl))


EXACT_Q = [i for i in impls.available("ultraquant_decode") if i in ("xla", "pallas", "mosaic")]


@pytest.mark.parametrize("impl", EXACT_Q)
def test_exact_q(impl):
    """exact_q=True: the attention of the float32 rotated q (no e4m3), against the oracle's
    exact-q attention with the same tolerance."""
    case = C.uq_case(16, seq_lens=(1, 64, 150), hk=2, g=8, bs=16, q_scale=4.0)
    f = impls.with_scales(jsm.ultraquant_decode, impl, dict(sm_scale=1 / 16), exact_q=True)
    check(impl, case, f(*case.args()), what="exact_q", exact_q=True)


def test_exact_q_none_and_refusals():
    """implementation=None serves exact_q (with what it picks here, but "xla" on an MI355);
    the gfx950 implementations, whose kernel takes q in e4m3, refuse it by name; exact_q must
    be a bool."""
    case = C.uq_case(17, seq_lens=(5, 33), hk=1, g=8, bs=16)
    out = jsm.ultraquant_decode(*case.args(), exact_q=True)
    picked = impls.default("ultraquant_decode")
    check("xla" if picked == "flydsl" else picked, case, out, exact_q=True)
    for impl in ("gfx950_emulation", "flydsl"):
        with pytest.raises(NotImplementedError, match="exact_q"):
            jsm.ultraquant_decode(*case.args(), implementation=impl, exact_q=True)
    with pytest.raises(TypeError, match="exact_q"):
        jsm.ultraquant_decode(*case.args(), exact_q=1)


def test_tolerance_tells_the_two_queries_apart():
    """Meta-test: the e4m3 query and the exact one give outputs that fail each other's
    tolerance (the rounding of q is part of the op, not a difference the bound absorbs); a
    bf16 rounding of the rotated q (a plausible kernel shortcut) fails the exact-q one."""
    case = C.uq_case(14, seq_lens=(64, 150, 90), hk=2, g=8, bs=16)
    args = (case.cache, case.block_tables, case.seq_lens)
    ref, _, st = O.ultraquant_decode(case.q, *args, stats=True)
    exact, _, st_exact = O.ultraquant_decode(case.q, *args, stats=True, exact_q=True)
    O.check_attention(run(case, "xla"), ref, st, heads_per_entry=8)
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(exact), ref, st, heads_per_entry=8)
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(ref), exact, st_exact, heads_per_entry=8)
    q_bad = O.uq_unrotate(O.round_bf16(O.uq_query(case.q, exact_q=True)))
    bad, _ = O.ultraquant_decode(q_bad, *args, exact_q=True)
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(bad), exact, st_exact, heads_per_entry=8)
