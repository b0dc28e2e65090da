"""The static MI355X model of the gfx950 kernels (kernels/gfx950_model.py) and its report.

The expected values are worked out here from the formats (docs/formats.md) and the kernels'
documented grids, not read from the model's constants."""

import dataclasses
import math
from pathlib import Path

import pytest

from jax_sparse_mla._build import build
from jax_sparse_mla.kernels import gfx950_model as model
from jax_sparse_mla.kernels.gfx950 import configs
from jax_sparse_mla.kernels.gfx950_model import MlaDecode, SparseMla, UltraQuant

RECORD = 512 + 4 * 4 + 64 * 2  # fp8_ds_mla: e4m3 latent, 4 f32 scales, 64 bf16 rope
ROW = 512 + 64  # mla_decode cache row: 576 e4m3 codes
SLOT = 128 + 8 + 128 + 8  # UltraQuant: K codes + scales, V codes + scales
PARTIAL = 512 * 2 + 4  # one bf16 output row and its f32 LSE


def test_sparse_mla_splits_fill_the_cus_and_head_groups_share_l2():
    e = model.estimate(SparseMla(n_q=1, heads=128, topk=2048))
    # 8 head groups in one launch; S = min(2048 / 64, ceil(256 CUs / (1 row x 8 groups))) = 32
    assert (e.launches, e.splits, e.workgroups) == (1, 32, 8 * 8 * 4)  # 8 XCDs x 8 x ceil(32/8)
    assert e.min_record_bytes == 2048 * RECORD == 1_343_488
    assert e.record_bytes == 8 * 2048 * RECORD  # requested per head group, from HBM once
    assert e.max_bytes_ratio == 8 and e.misses() == []
    q_out = 128 * (576 * 2 + 512 * 2 + 4)
    partials = 2 * 128 * 32 * PARTIAL  # written, read back by the combine
    assert e.other_bytes == 8 * 2048 * 4 + q_out + partials
    assert e.hbm_s == pytest.approx((8 * 2048 * (RECORD + 4) + q_out + partials) / 8e12)
    assert e.min_hbm_s == pytest.approx((2048 * (RECORD + 4) + q_out) / 8e12)


def test_sparse_mla_one_split_writes_the_output():
    e = model.estimate(SparseMla(n_q=128, heads=128))
    assert (e.splits, e.workgroups, e.bytes_ratio) == (1, 8 * 128, 8.0)  # 128 rows x 8 groups
    assert e.other_bytes == 8 * 128 * 2048 * 4 + 128 * 128 * (576 * 2 + PARTIAL)  # no combine
    assert e.misses() == []


def test_sparse_mla_remainder_heads_launch_apart():
    e = model.estimate(SparseMla(n_q=2, heads=40))  # heads 0-31 (2 groups) and 32-39
    assert e.launches == 2
    assert e.splits == min(2048 // 64, math.ceil(256 / (2 * 3)))  # 3 head groups per row
    assert e.workgroups == 8 * 2 * math.ceil(2 * e.splits / 8)  # the main launch's


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("n_q", [1, 4, 32, 128])
def test_deepseek_v32_sparse_shapes_meet_the_targets(n_q, heads):
    """DeepSeek-V3.2 decode (top-k 2048; 128 heads, 64 / 16 under TP 2 / 8): records requested
    at most once per (row, split, group of 16 heads), i.e. G = ceil(H / 16) x the minimum (the
    G workgroups of a (row, split) share one XCD's L2: HBM serves each record about once); and
    never fewer workgroups than CUs while the keys could fill them at 64 keys a split."""
    e = model.estimate(SparseMla(n_q=n_q, heads=heads, topk=2048))
    groups = math.ceil(heads / 16)
    assert e.min_record_bytes == n_q * 2048 * RECORD
    assert e.record_bytes <= groups * e.min_record_bytes
    assert e.splits * 64 <= 2048  # every split at least one 64-key tile
    fill = min(256, n_q * groups * 2048 // 64)
    assert e.workgroups >= fill, (e.workgroups, fill)
    assert (e.other_bytes > e.min_other_bytes + groups * n_q * 2048 * 4) == (e.splits > 1)
    assert e.misses() == []


def test_misses_flag_a_shape_over_its_bounds():
    """The targets can fail: requests past the stated bound, too few workgroups."""
    e = model.estimate(SparseMla(n_q=1, heads=128))
    over = dataclasses.replace(e, record_bytes=9 * e.min_record_bytes)
    assert over.misses() == ["bytes 9x min"]
    idle = dataclasses.replace(e, workgroups=31)
    assert idle.misses() == ["fill 31/32 WGs"]
    once = dataclasses.replace(e, max_bytes_ratio=1.0)  # a design claiming one gather per row
    assert once.misses() == ["bytes 8x min"]


def test_mla_decode_fills_the_cus_and_writes_partials():
    e = model.estimate(MlaDecode(batch=1, context=32768, heads=16))
    assert e.splits == 256  # 256 CUs / (1 request x 1 head group), one per 128-key block
    assert e.workgroups == 256
    assert e.record_bytes == e.min_record_bytes == 32768 * ROW
    q_out = 16 * (576 * 2 + PARTIAL)
    keys = 32768 * 4
    assert e.other_bytes == keys + q_out + 2 * 256 * 16 * PARTIAL  # written, read back
    assert e.misses() == []


def test_mla_decode_head_groups_share_k_through_the_l2():
    """The 16-row kernels' G head groups (here qlen 2: 16 per (split, request)) are consecutive
    block ids of one XCD (the kernel's grid): each requests K and its indices, G x the minimum,
    the design's stated bound (HBM about once, the rest from that XCD's L2)."""
    e = model.estimate(MlaDecode(batch=4, context=8192, heads=128, qlen=2))
    assert e.splits == 4  # 256 / (4 requests x 16 head groups)
    assert e.workgroups == 8 * 16 * 2  # 8 XCDs x 16 groups x ceil(4 x 4 / 8)
    assert e.min_record_bytes == 4 * 8192 * ROW
    assert e.record_bytes == 16 * e.min_record_bytes
    assert e.max_bytes_ratio == 16
    assert e.misses() == []
    one = model.estimate(MlaDecode(batch=64, context=8192, heads=128, qlen=2))
    assert (one.splits, one.workgroups) == (1, 8 * 16 * 8)
    q_out = 64 * 2 * 128 * (576 * 2 + PARTIAL)
    assert one.other_bytes == 16 * 64 * 8192 * 4 + q_out  # no combine


def test_mla_decode_128_heads_request_k_once():
    """qlen 1 at H = 128 where the 128-row kernel fills the CUs with splits of 2048 keys
    (B = 64, 8k: 4 splits): one CTA per (split, request) requests K and its indices once
    (bound 1.1, not 8), and its partials are written and read back. At B = 4 the 16-row
    kernels run (64 splits of 128 keys would write 3.6x K's bytes in partials): 8 groups,
    8 splits, the stated bound 8."""
    e = model.estimate(MlaDecode(batch=64, context=8192, heads=128))
    assert e.splits == 4  # 256 CUs / 64 requests, 2048 keys each
    assert e.workgroups == 8 * 1 * 32  # 8 XCDs x 1 group x ceil(64 x 4 / 8)
    assert e.record_bytes == e.min_record_bytes == 64 * 8192 * ROW
    assert e.max_bytes_ratio == 1.1 and e.misses() == []
    q_out = 64 * 128 * (576 * 2 + PARTIAL)
    assert e.other_bytes == 64 * 8192 * 4 + q_out + 2 * 64 * 4 * 128 * PARTIAL
    row = next(line for line in model.shape_lines([MlaDecode(64, 8192, 128)]) if "B=64" in line)
    assert row.endswith("| 301.99 | 301.99 | 1.00 | 1.1 | 389.32 | 48.66 | 40.24 | meets both |")
    small = model.estimate(MlaDecode(batch=4, context=8192, heads=128))
    assert (small.splits, small.workgroups, small.max_bytes_ratio) == (8, 8 * 8 * 4, 8)
    two = model.estimate(MlaDecode(batch=32, context=8192, heads=256))  # two 128-head groups
    assert (two.splits, two.workgroups) == (4, 8 * 2 * 16)  # 256 / (32 x 2)
    assert two.record_bytes == 2 * two.min_record_bytes and two.max_bytes_ratio == 2


DENSE_AND_ULTRAQUANT = [s for s in model.DECODE_SHAPES if isinstance(s, (MlaDecode, UltraQuant))]


@pytest.mark.parametrize("shape", DENSE_AND_ULTRAQUANT, ids=str)
def test_dense_and_ultraquant_shapes_meet_the_redesign_targets(shape):
    """No shape requests more than 1.1x the minimum record bytes (or, for mla_decode's
    co-scheduled head groups, the design's bound: one request per head group of 16 rows, or of
    128 heads where the 128-row kernel runs), and none
    launches fewer workgroups than CUs while its keys could fill them at 64 keys a split."""
    e = model.estimate(shape)
    keys = shape.batch * shape.context
    groups = 1
    if isinstance(shape, MlaDecode):  # query rows per CTA: 128 or 16 (configs.mla_decode_rows)
        rows = configs.mla_decode_rows(shape.qlen, shape.heads, shape.batch, keys, e.cus)
        groups = -(-shape.heads * shape.qlen // rows)
    assert e.record_bytes <= max(1.1, groups) * e.min_record_bytes
    kv_heads = shape.kv_heads if isinstance(shape, UltraQuant) else 1
    if kv_heads * keys // 64 >= e.cus:
        assert e.workgroups >= e.cus


def test_mla_decode_split_cap_leaves_cus_idle():
    e = model.estimate(MlaDecode(batch=1, context=8192, heads=16))
    assert e.splits == 8192 // 128
    assert e.misses() == ["fill 64/128 WGs"]  # 64-key splits would give 128


def test_ultraquant_reads_each_slot_once():
    e = model.estimate(UltraQuant(batch=1, context=32768, kv_heads=8, group=8))
    assert e.splits == 32768 // 128  # fill: ceil(256 x 12 / 8) = 384, capped at the tile groups
    assert e.workgroups == 8 * 256
    assert e.record_bytes == e.min_record_bytes == 8 * 32768 * SLOT
    assert e.misses() == []


def test_ultraquant_partials_pad_to_the_compiled_group():
    g3 = model.estimate(UltraQuant(batch=2, context=1024, kv_heads=4, group=3))
    g6 = model.estimate(UltraQuant(batch=2, context=1024, kv_heads=4, group=6))
    q_out_diff = 2 * 4 * 3 * 2 * 256 * 2
    assert g6.other_bytes - g3.other_bytes == q_out_diff  # same partials: G=3 runs as G=6
    assert g3.splits == 1024 // 128


def test_device_cus_enter_the_plan():
    e = model.estimate(MlaDecode(batch=1, context=32768, heads=16), cus=80)
    assert (e.splits, e.workgroups, e.fill_target) == (80, 80, 80)
    assert model.estimate(SparseMla(1, 16), cus=16).fill_target == 16
    assert model.estimate(SparseMla(1, 16), cus=16).splits == 16  # fills 16 CUs, not 32


def test_report_prints_the_model_section(capsys):
    resources = {
        "name": "jsm_sparse_mla_h16_l1",
        "vgpr": 249,
        "agpr": 0,
        "vgpr_alloc": 256,
        "sgpr": 84,
        "lds_bytes": 76160,
        "scratch_bytes": 0,
        "vgpr_spills": 0,
        "sgpr_spills": 0,
        "workgroup_size": 256,
    }
    entry = {
        "symbol": "jsm_sparse_mla_h16_l1",
        "design_waves_per_simd": 2,
        "resources": [resources],
    }
    assert build.report({"arch": "gfx950", "kernels": [entry]}) == 0
    out = capsys.readouterr().out
    assert "MI355X model (256 CUs" in out
    assert "jsm_sparse_mla_h16_l1 256 76160 2 2 vgpr" in " ".join(out.split())
    assert (
        "| sparse_mla | n_q=1 H=128 topk=2048 | 1 | 256 | 32 | 32 | 10.75 | 1.34 | 8.00 | 8 |"
        in out
    )
    assert "| mla_decode | B=4 ctx=8192 H=128 qlen=1 |" in out
    assert f"of {len(model.DECODE_SHAPES)} decode shapes miss a target" in out


def test_docs_hold_the_models_rows():
    """docs/mi355.md's tables are the model's rows: change the model, regenerate them."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "mi355.md").read_text()
    for line in model.shape_lines() + model.shape_lines(model.PEER_SHAPES):
        assert line in docs, line
