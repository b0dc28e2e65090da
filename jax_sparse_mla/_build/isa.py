"""Reading gfx950 ISA text: each ``s_barrier``'s waits, over the kernel's control-flow graph.

The build keeps the final ISA of every kernel (``objects/<symbol>.s``, FlyDSL's dump of the
compilation the code object comes from). For each ``s_barrier`` this module finds, on every
path of the kernel's control-flow graph that reaches it, whether an LDS operation (``ds_*``)
is still outstanding (no ``s_waitcnt`` with ``lgkmcnt(0)`` after it) and whether an LDS DMA
(``global_load_lds_*`` / ``buffer_load_* ... lds``) may still be in flight (no ``vmcnt(0)``
after it), and the nearest ``s_waitcnt`` or ``ds_*`` before the barrier in program order.
Standard library only; ``assemble_kernel`` runs ziglang's clang (the gfx950-build extra).
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_WAIT_FIELD = re.compile(r"(vmcnt|expcnt|lgkmcnt)\((\d+)\)")
_LABEL = re.compile(r"^([.\w$]+):")


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line of the ISA text
    mnemonic: str
    operands: str

    @property
    def is_lds(self) -> bool:
        """An LDS instruction (counted by lgkmcnt)."""
        return self.mnemonic.startswith("ds_")

    @property
    def is_lds_dma(self) -> bool:
        """A load that writes LDS (counted by vmcnt): ``global_load_lds_*``, ``buffer_load_*
        ... lds``."""
        if self.mnemonic.startswith("global_load_lds"):
            return True
        return self.mnemonic.startswith("buffer_load") and "lds" in self.operands.split()

    def waits(self) -> dict[str, int] | None:
        """``s_waitcnt``'s counters (only those it names), else None."""
        if self.mnemonic != "s_waitcnt":
            return None
        return {k: int(v) for k, v in _WAIT_FIELD.findall(self.operands)}


@dataclass(frozen=True)
class Barrier:
    """One ``s_barrier`` and what reaches it."""

    line: int
    lds_pending: bool  # some path reaches it with a ds_* not followed by lgkmcnt(0)
    dma_in_flight: bool  # some path reaches it with an LDS DMA not followed by vmcnt(0)
    # The nearest s_waitcnt or ds_* before it in program order (None at the kernel's start).
    nearest: Instruction | None

    @property
    def nearest_wait(self) -> dict[str, int] | None:
        """The counters of the nearest preceding s_waitcnt when no ds_* lies between them."""
        return None if self.nearest is None else self.nearest.waits()


def kernel_text(isa: str, name: str) -> list[tuple[int, str]]:
    """(line number, line) of kernel ``name``'s code: from its label to ``.Lfunc_end``."""
    lines = isa.splitlines()
    try:
        start = lines.index(f"{name}:")
    except ValueError:
        raise ValueError(f"no kernel {name!r} in the ISA") from None
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(".Lfunc_end"))
    return [(i + 1, lines[i]) for i in range(start + 1, end)]


def _blocks(code: list[tuple[int, str]]) -> tuple[list[list[Instruction]], list[list[int]]]:
    """Basic blocks (instructions) and the successors of each, by index."""
    blocks: list[list[Instruction]] = [[]]
    labels: dict[str, int] = {}
    targets: list[tuple[str | None, bool]] = []  # per block: branch target, falls through

    def close(target: str | None, falls: bool) -> None:
        targets.append((target, falls))
        blocks.append([])

    for number, raw in code:
        text = raw.split(";", 1)[0].strip()
        if not text:
            continue
        if m := _LABEL.match(text):
            if blocks[-1]:
                close(None, True)
            labels[m.group(1)] = len(blocks) - 1
            continue
        if text.startswith("."):
            continue  # directive (.p2align ...)
        mnemonic, _, operands = text.partition(" ")
        blocks[-1].append(Instruction(number, mnemonic, operands.strip()))
        if mnemonic == "s_branch":
            close(operands.strip(), False)
        elif mnemonic.startswith("s_cbranch_"):
            close(operands.strip(), True)
        elif mnemonic == "s_endpgm":
            close(None, False)
    targets.append((None, False))
    successors = []
    for i, (target, falls) in enumerate(targets):
        succ = [labels[target]] if target is not None else []
        if falls and i + 1 < len(blocks):
            succ.append(i + 1)
        successors.append(succ)
    return blocks, successors


def _step(state: tuple[bool, bool], ins: Instruction) -> tuple[bool, bool]:
    lds, dma = state
    if ins.is_lds:
        lds = True
    if ins.is_lds_dma:
        dma = True
    if (w := ins.waits()) is not None:
        lds = lds and w.get("lgkmcnt") != 0
        dma = dma and w.get("vmcnt") != 0
    return lds, dma


def barriers(isa: str, name: str) -> list[Barrier]:
    """Every ``s_barrier`` of kernel ``name`` in ``isa``, in program order."""
    code = kernel_text(isa, name)
    blocks, successors = _blocks(code)
    entry: list[tuple[bool, bool] | None] = [None] * len(blocks)
    entry[0] = (False, False)
    work = [0]
    while work:  # forward "may" dataflow: join = or
        b = work.pop()
        state = entry[b]
        for ins in blocks[b]:
            state = _step(state, ins)
        for s in successors[b]:
            old = entry[s]
            new = state if old is None else (old[0] or state[0], old[1] or state[1])
            if new != old:
                entry[s] = new
                work.append(s)
    order = [ins for block in blocks for ins in block]
    found = []
    for b, block in enumerate(blocks):
        state = entry[b]
        for ins in block:
            if ins.mnemonic == "s_barrier" and state is not None:
                at = order.index(ins)
                nearest = next(
                    (p for p in reversed(order[:at]) if p.is_lds or p.mnemonic == "s_waitcnt"),
                    None,
                )
                found.append(Barrier(ins.line, state[0], state[1], nearest))
            if state is not None:
                state = _step(state, ins)
    return sorted(found, key=lambda x: x.line)


def count_waits(isa: str, name: str, counter: str, value: int = 0) -> int:
    """How many ``s_waitcnt`` of kernel ``name`` wait for ``counter`` = ``value``."""
    return sum(
        (w := ins.waits()) is not None and w.get(counter) == value
        for block in _blocks(kernel_text(isa, name))[0]
        for ins in block
    )


def assemble_kernel(isa: str, name: str) -> bytes:
    """The machine code of kernel ``name``'s instructions in ``isa``, assembled for gfx950 by
    ziglang's clang: the bytes a code object built from this ISA holds for the kernel."""
    code = "\n".join(line for _, line in kernel_text(isa, name))
    with tempfile.TemporaryDirectory() as tmp:
        source, obj = Path(tmp) / "k.s", Path(tmp) / "k.o"
        source.write_text(f"\t.text\n{name}:\n{code}\n")
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "amdgcn-amdhsa-none"]
        cmd += ["-mcpu=gfx950", "-g0", "-c", str(source), "-o", str(obj)]
        subprocess.run(cmd, check=True, capture_output=True)
        return _text_section(obj.read_bytes())


def _text_section(elf: bytes) -> bytes:
    """The ``.text`` bytes of a relocatable ELF64."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(n):
        return struct.unpack_from("<IIQQQQ", elf, shoff + n * shentsize)

    names = section(shstrndx)[4]
    for n in range(shnum):
        name_at, _, _, _, offset, size = section(n)
        if elf[names + name_at : elf.index(b"\0", names + name_at)] == b".text":
            return elf[offset : offset + size]
    raise ValueError("no .text")
