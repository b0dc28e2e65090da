"""A small interpreter of the inline PTX in the Mosaic GPU kernels, for CPU tests.

It runs one block of PTX (as ``_pipeline`` writes it: one instruction per line) for each lane
of a warpgroup in turn, on Python ints (bit patterns; f32 registers hold floats) and on a
``Memory`` of named byte regions, so that a test can check what the block computes, which
bytes it copies where, and that it reads nothing outside the buffers it was given. Only the
instructions the kernels use are known; any other one fails the test by name.

Semantics taken from the PTX ISA: ``div.s32`` truncates toward zero; ``prmt.b32`` (default mode)
picks byte (select >> 4i) & 7 of b:a for byte i; ``cvt.rn.f16x2.e4m3x2`` converts the low byte to
the low half; ``cvt.rn.bf16x2.f32 d, a, b`` and ``cvt.rn.f16x2.f32 d, a, b`` put a in the high
half (rounding to nearest even); ``red.shared.max`` applies when issued (lanes run in turn);
``mul.wide`` multiplies 32-bit values into 64 bits; asynchronous copies are applied when issued
(the kernels wait for them before any read); an mbarrier counts one pending arrival,
``cp.async.mbarrier.arrive`` (without ``.noinc``) adds and removes one,
``mbarrier.arrive.expect_tx`` removes one and expects bytes that ``cp.async.bulk`` copies
complete, ``mbarrier.arrive`` removes one; ``bar.sync`` is a point every lane reaches before
any lane runs on, and so is ``bar.red.or.pred``, after which every lane holds the OR of the
lanes' predicates; ``setp.CMP.or`` ORs the comparison into its last operand.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from tests import oracle as O

MASK = {"32": 0xFFFFFFFF, "64": 0xFFFFFFFFFFFFFFFF}


def bf16_pair(x: int) -> list[float]:
    """The two bf16 values of a 32-bit register (low half first; subnormals kept)."""
    bits = np.array([(x & 0xFFFF) << 16, (x >> 16) << 16], np.uint32)
    return [float(v) for v in bits.view(np.float32)]


def bf16_bits(values) -> int:
    """[low, high] -> a bf16x2 register; the values must be exact in bf16."""
    f32 = np.array(values, np.float32).view(np.uint32)
    assert not (f32 & 0xFFFF).any(), values
    return int(f32[0] >> 16) | int(f32[1] >> 16) << 16


def _f16_bits(value: float) -> int:
    return int(np.array(value, np.float16).view(np.uint16))


def _f32(x) -> np.float32:
    """A register as float32: a float, or the bits of one."""
    if isinstance(x, int):
        return np.array(x & MASK["32"], np.uint32).view(np.float32)[()]
    return np.float32(x)


def _max_u16x2(a: int, b: int) -> int:
    return sum(max(a >> s & 0xFFFF, b >> s & 0xFFFF) << s for s in (0, 16))


def _prmt(a: int, b: int, select: int) -> int:
    data = a | b << 32
    return sum((data >> 8 * (select >> 4 * i & 7) & 0xFF) << 8 * i for i in range(4))


def _signed(x: int, bits: int = 32) -> int:
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


_COMPARE = {"lt": operator.lt, "le": operator.le, "eq": operator.eq, "ne": operator.ne}
_COMPARE |= {"ge": operator.ge, "gt": operator.gt}

_VALUE_OPS = {  # opcode -> (sources -> result)
    "and.b32": operator.and_,
    "or.b32": operator.or_,
    "xor.b32": operator.xor,
    "shl.b32": lambda a, b: a << b,
    "shr.u32": lambda a, b: (a & MASK["32"]) >> b,
    "add.u32": operator.add,
    "add.s32": lambda a, b: _signed(a) + _signed(b),
    "max.s32": lambda a, b: max(_signed(a), _signed(b)),
    "max.u32": lambda a, b: max(a & MASK["32"], b & MASK["32"]),
    "max.u16x2": _max_u16x2,
    "min.s32": lambda a, b: min(_signed(a), _signed(b)),
    "mul.lo.s32": lambda a, b: _signed(a) * _signed(b),
    "mul.lo.u32": operator.mul,
    "bfe.u32": lambda a, pos, n: (a & MASK["32"]) >> pos & ((1 << n) - 1),
    "div.s32": lambda a, b: int(_signed(a) / _signed(b)),  # truncates toward zero
    "add.u64": operator.add,
    "sub.s32": lambda a, b: _signed(a) - _signed(b),
    "div.u32": lambda a, b: (a & MASK["32"]) // (b & MASK["32"]),
    "rem.u32": lambda a, b: (a & MASK["32"]) % (b & MASK["32"]),
    "mad.lo.s32": lambda a, b, c: _signed(a) * _signed(b) + _signed(c),
    "mul.wide.u32": lambda a, b: (a & MASK["32"]) * (b & MASK["32"]),
    "mul.wide.s32": lambda a, b: _signed(a) * _signed(b),
    "cvt.u64.u32": lambda a: a & MASK["32"],
    "selp.s32": lambda a, b, p: a if p else b,
    "selp.u32": lambda a, b, p: a if p else b,
    "selp.b64": lambda a, b, p: a if p else b,
    "mov.u32": lambda a: a,
    "mov.s32": lambda a: a,
    "mov.b32": lambda a: a,
    "prmt.b32": _prmt,
    "mul.rn.bf16x2": lambda a, b: bf16_bits(
        [x * y for x, y in zip(bf16_pair(a), bf16_pair(b), strict=True)]
    ),
    "cvt.rn.f16x2.e4m3x2": lambda c: sum(
        _f16_bits(O.E4M3_TABLE[c >> 8 * i & 0xFF]) << 16 * i for i in (0, 1)
    ),
    "cvt.f32.f16": lambda h: float(np.array(h, np.uint16).view(np.float16)),
    "cvt.rn.bf16x2.f32": lambda a, b: bf16_bits(O.round_bf16(np.array([_f32(b), _f32(a)]))),
    "mul.rn.f32": lambda a, b: _f32(a) * _f32(b),
    "cvt.rn.f16x2.f32": lambda a, b: _f16_bits(_f32(b)) | _f16_bits(_f32(a)) << 16,
}
_WIDE = ("add.u64", "selp.b64", "mul.wide", "cvt.u64")  # opcodes with 64-bit results


@dataclasses.dataclass
class Region:
    base: int
    data: bytearray
    space: str  # "global" or "shared"


def _aligned(op: str, address: int, size: int) -> int:
    """``address``, checked to be a multiple of ``size``: a vector access (``.vN``) must be
    aligned to its whole size (the PTX ISA's rule; hardware faults otherwise)."""
    assert address % size == 0, f"{op}: {size}-byte access at {address:#x} is not aligned"
    return address


class Memory:
    """Named byte regions at distinct addresses; a read or write outside them fails."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self._next = 1 << 32

    def add(self, name: str, data, space: str) -> int:
        """A region holding ``data`` (bytes, or a numpy array's bytes); returns its address."""
        blob = bytearray(np.ascontiguousarray(data).tobytes())
        self.regions[name] = Region(self._next, blob, space)
        base, self._next = self._next, self._next + (1 << 32)
        return base

    def array(self, name: str, dtype, shape=None) -> np.ndarray:
        out = np.frombuffer(bytes(self.regions[name].data), dtype)
        return out if shape is None else out.reshape(shape)

    def _find(self, address: int, size: int, space: str) -> tuple[Region, int]:
        for name, region in self.regions.items():
            offset = address - region.base
            if 0 <= offset and offset + size <= len(region.data):
                assert region.space == space, f"{space} access to {name}, a {region.space} buffer"
                return region, offset
        raise AssertionError(
            f"{space} access of {size} bytes at {address:#x}: outside every buffer"
        )

    def read(self, address: int, size: int, space: str) -> bytes:
        region, offset = self._find(address, size, space)
        return bytes(region.data[offset : offset + size])

    def write(self, address: int, data: bytes, space: str) -> None:
        region, offset = self._find(address, len(data), space)
        region.data[offset : offset + len(data)] = data


@dataclasses.dataclass
class Barrier:
    """One mbarrier phase: pending arrivals (1 at init) and expected transaction bytes."""

    pending: int = 1
    tx: int = 0

    @property
    def complete(self) -> bool:
        return self.pending == 0 and self.tx == 0


def _address(text: str, regs: dict) -> int:
    inner = text.strip("[]")
    name, _, offset = inner.partition("+")
    return (regs[name] + int(offset or 0)) & MASK["64"]


def run(text: str, operands: dict | list[dict], *, lanes: int = 1, memory: Memory | None = None):
    """Runs the PTX block ``text`` for each lane (%tid.x = lane) with ``operands`` ($k -> int or
    float; or one such dict per lane) -> (each lane's registers, the barriers armed, by
    address). Lanes run one after the other from one barrier (``bar.sync``, ``bar.red``) to the
    next: every lane reaches a barrier before any passes it."""
    barriers: dict[int, Barrier] = {}
    per_lane = operands if isinstance(operands, list) else [operands] * lanes
    lane_regs = [dict(ops, **{"%tid.x": lane}) for lane, ops in enumerate(per_lane)]
    phases, ends = [[]], []
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        if line.startswith(("bar.sync", "bar.red")):
            phases.append([])
            ends.append(line)
        else:
            phases[-1].append(line)
    for phase, end in zip(phases, [*ends, None], strict=True):
        for regs in lane_regs:
            for line in phase:
                if line.startswith("@"):
                    guard, line = line.split(None, 1)
                    negate, name = guard[1] == "!", guard.lstrip("@!")
                    if bool(regs[name]) == negate:
                        continue
                _step(line, regs, memory, barriers)
        if end and end.startswith("bar.red.or.pred"):  # bar.red.or.pred d, id, count, src
            dst, _, _, src = (x.strip() for x in end.partition(" ")[2].split(","))
            result = any(regs[src] for regs in lane_regs)
            for regs in lane_regs:
                regs[dst] = result
    return lane_regs, barriers


def _value(x: str, regs: dict):
    return regs[x] if x in regs else int(x, 0)


def _step(line: str, regs: dict, memory: Memory | None, barriers: dict) -> None:
    op, _, rest = line.partition(" ")
    operands = [x.strip() for x in rest.replace("{", "").replace("}", "").split(",")]
    if op == "mov.b32" and rest.startswith("{"):  # mov.b32 {lo, hi}, x
        lo, hi, x = operands
        regs[lo], regs[hi] = regs[x] & 0xFFFF, regs[x] >> 16 & 0xFFFF
    elif op in _VALUE_OPS:
        dst, *src = operands
        value = _VALUE_OPS[op](*(_value(x, regs) for x in src))
        width = "64" if op.startswith(_WIDE) else "32"
        regs[dst] = value & MASK[width] if isinstance(value, int) else value
    elif op.startswith("setp."):  # setp.CMP[.or].KIND d, a, b[, c]
        _, cmp, *either, kind = op.split(".")
        dst, a, b, *c = operands
        a, b = (_value(x, regs) for x in (a, b))
        if kind == "f32":
            a, b = _f32(a), _f32(b)
        elif kind == "s32":
            a, b = _signed(a), _signed(b)
        else:
            a, b = a & MASK["32"], b & MASK["32"]
        if either:
            assert either == ["or"], op
        regs[dst] = _COMPARE[cmp](a, b) or (bool(either) and regs[c[0]])
    elif op == "and.pred":
        dst, a, b = operands
        regs[dst] = regs[a] and regs[b]
    elif op in ("ld.global.nc.s32", "ld.shared.s32", "ld.shared.u32"):
        dst, src = operands
        space = op.split(".")[1]
        regs[dst] = int.from_bytes(memory.read(_address(src, regs), 4, space), "little")
    elif op == "red.shared.max.u32":
        dst, src = operands
        address = _address(dst, regs)
        old = int.from_bytes(memory.read(address, 4, "shared"), "little")
        memory.write(address, max(old, regs[src] & MASK["32"]).to_bytes(4, "little"), "shared")
    elif op in ("st.shared.s32", "st.shared.u32", "st.global.b32"):
        dst, src = operands
        space = op.split(".")[1]
        value = _value(src, regs) & MASK["32"]
        memory.write(_address(dst, regs), value.to_bytes(4, "little"), space)
    elif op.startswith("ld.global.nc.v"):  # ld.global.nc.vN.b32 {d0, ..}, [a]
        *dsts, src = operands
        data = memory.read(
            _aligned(op, _address(src, regs), 4 * len(dsts)), 4 * len(dsts), "global"
        )
        for i, dst in enumerate(dsts):
            regs[dst] = int.from_bytes(data[4 * i : 4 * i + 4], "little")
    elif op.startswith(("st.shared.v", "st.global.v")):  # st.SPACE.vN.b32 [a], {s0, ..}
        dst, *srcs = operands
        if op.endswith(".f32"):  # registers holding Python floats
            data = np.array([regs[x] for x in srcs], "<f4").tobytes()
        else:
            data = b"".join((regs[x] & MASK["32"]).to_bytes(4, "little") for x in srcs)
        memory.write(_aligned(op, _address(dst, regs), len(data)), data, op.split(".")[1])
    elif op in ("cp.async.ca.shared.global", "cp.async.cg.shared.global"):
        dst, src, size = operands
        data = memory.read(_address(src, regs), int(size), "global")
        memory.write(_address(dst, regs), data, "shared")
    elif op.startswith("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"):
        dst, src, size, bar = operands
        data = memory.read(_address(src, regs), int(size), "global")
        memory.write(_address(dst, regs), data, "shared")
        barriers.setdefault(_address(bar, regs), Barrier()).tx -= int(size)
    elif op.startswith("cp.async.mbarrier.arrive"):
        assert ".noinc" not in op, op  # +1 pending, then the arrival when the copies land: net 0
        barriers.setdefault(_address(operands[0], regs), Barrier())
    elif op.startswith("mbarrier.arrive.expect_tx"):
        _, bar, size = operands
        barrier = barriers.setdefault(_address(bar, regs), Barrier())
        barrier.pending -= 1
        barrier.tx += int(size)
    elif op == "mbarrier.arrive.release.cta.shared::cta.b64":
        _, bar = operands
        barriers.setdefault(_address(bar, regs), Barrier()).pending -= 1
    elif op.startswith(("cp.async.wait_", "cp.async.commit_group", "fence.")):
        pass  # copies are applied when issued
    else:
        raise NotImplementedError(f"ptx_sim does not know {op!r}")
