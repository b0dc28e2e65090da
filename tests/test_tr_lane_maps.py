"""The transposing LDS reads' lane maps, on the CPU.

The MI355 probe tests (``tests/test_gfx950.py::test_ds_read_b64_tr_b*_lane_map``) expect AMD's
documented semantics (``tr_read_sources``). The kernels' layout tests model the reads with
``_tr8`` / ``_tr16`` (``tests/test_emulation_*.py``) on the kernels' own address helpers. Here the
two must be the same map, so a change to either shows; and the probe test must pass on a
hardware model with that map and fail, naming what it saw, on the alternatives.
"""

import numpy as np
import pytest

from tests import test_emulation_mla_decode as DE
from tests import test_emulation_sparse_mla as SE
from tests import test_emulation_ultraquant as UE
from tests import test_gfx950 as G

ADDRESS_SETS = {
    "probe": G.TR_PROBE_ADDRS,
    "contiguous": np.arange(64) * 8,
    "reversed": (127 - np.arange(64)) * 8,
}
LDS_ADDRESSES = np.arange(1024)  # LDS byte a holds a


def as_registers(result) -> np.ndarray:
    """[64, 8 bytes] or [64, 4 uint16] -> [64, 2] little-endian uint32 registers."""
    arr = np.asarray(result)
    return np.ascontiguousarray(arr, "<u2" if arr.shape[1] == 4 else np.uint8).view("<u4")


def kernel_model(bits):
    """The probe as the kernels' lane-map models predict it: ``read(lds, addrs)``."""

    def read(lds, addrs):
        if bits == 8:
            return as_registers(SE._tr8(lds, addrs))
        return as_registers(UE._tr16(lds.view("<u2"), addrs))

    return read


def semantics_model(bits, semantics, shift=0):
    """The probe on a hardware with ``semantics`` (lane l reading lane l + shift's address)."""

    def read(lds, addrs):
        return as_registers(lds[G.tr_read_sources(np.roll(addrs, -shift), bits, semantics)])

    return read


def test_probe_addresses_are_distinct_slots():
    addrs = G.TR_PROBE_ADDRS
    assert len(set(addrs.tolist())) == 64 and np.all(addrs % 8 == 0)
    assert 0 <= addrs.min() and addrs.max() + 8 <= 1024  # inside the probe's LDS


@pytest.mark.parametrize("name", sorted(ADDRESS_SETS))
def test_tr8_expectation_is_the_kernels_lane_map(name):
    addrs = ADDRESS_SETS[name]
    want = G.tr_read_sources(addrs, 8)
    np.testing.assert_array_equal(SE._tr8(LDS_ADDRESSES, addrs), want)  # sparse_mla
    np.testing.assert_array_equal(DE._tr8(LDS_ADDRESSES, addrs), want)  # mla_decode


@pytest.mark.parametrize("name", sorted(ADDRESS_SETS))
def test_tr16_expectation_is_the_kernels_lane_map(name):
    addrs = ADDRESS_SETS[name]
    elements = UE._tr16(LDS_ADDRESSES[::2], addrs)  # element i (bytes 2i, 2i + 1) holds 2i
    bytes_of = np.repeat(elements, 2, axis=1) + np.tile([0, 1], 4)
    np.testing.assert_array_equal(bytes_of, G.tr_read_sources(addrs, 16))


@pytest.mark.parametrize("bits", [8, 16])
def test_probe_test_passes_on_the_kernels_lane_map(bits):
    G.check_tr_lane_map(bits, "the kernels", read=kernel_model(bits))


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("semantics", ["blocks", "plain"])
def test_probe_test_names_another_semantics(bits, semantics):
    with pytest.raises(pytest.fail.Exception) as failure:
        G.check_tr_lane_map(bits, "the kernels", read=semantics_model(bits, semantics))
    message = str(failure.value)
    assert f"ds_read_b64_tr_b{bits}: " in message
    assert f"the hardware does this instead: {G.tr_semantics(semantics, bits)}" in message


def test_probe_test_shows_an_unknown_map():
    with pytest.raises(pytest.fail.Exception) as failure:
        G.check_tr_lane_map(8, "the kernels", read=semantics_model(8, "transposed", shift=1))
    message = str(failure.value)
    assert "no known semantics matches; lanes 0-15 got (source lane.byte): " in message
    # lane 0 byte 0 comes from lane 1's address under the shift: lane 0's slot + 0 is lane 1's
    assert message.split("(source lane.byte): ")[1].startswith("1.0 3.0 5.0 7.0 9.0 11.0 13.0 15.0")
