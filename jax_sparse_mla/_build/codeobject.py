"""Reading AMDGPU code objects: the kernel resources a compiled FlyDSL kernel uses.

``export_to_c`` writes a host object (``.o``) that embeds the gfx950 code object (an ELF with
``e_machine == EM_AMDGPU``). Its ``NT_AMDGPU_METADATA`` note (MessagePack) lists every kernel
with its register, LDS and scratch usage; the kernel descriptor (``<kernel>.kd``) holds the
register allocation the hardware actually reserves. Pure Python, no ROCm needed.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

EM_AMDGPU = 224
NT_AMDGPU_METADATA = 32
SHT_SYMTAB, SHT_NOTE = 2, 7
STT_FUNC = 2

# gfx950 (CDNA4) compute unit: 4 SIMDs; per SIMD 512 unified VGPRs per lane (architectural
# VGPRs first, AGPRs from the accumulation offset), 800 SGPRs and at most 8 waves; 160 KiB LDS.
SIMDS_PER_CU = 4
VGPRS_PER_SIMD = 512
VGPR_GRANULE = 8
SGPRS_PER_SIMD = 800
SGPR_GRANULE = 16
MAX_WAVES_PER_SIMD = 8
LDS_BYTES_PER_CU = 160 * 1024
WAVE_SIZE = 64


@dataclass(frozen=True)
class KernelResources:
    """What one kernel uses, per lane (registers) or per workgroup (LDS, scratch per lane)."""

    name: str
    vgpr: int  # architectural VGPRs
    agpr: int  # accumulation VGPRs
    vgpr_alloc: int  # unified VGPRs the hardware reserves (descriptor, granule 8)
    sgpr: int
    lds_bytes: int
    scratch_bytes: int
    vgpr_spills: int
    sgpr_spills: int
    workgroup_size: int

    @property
    def waves_per_workgroup(self) -> int:
        return math.ceil(self.workgroup_size / WAVE_SIZE)

    def occupancy(self) -> tuple[int, str]:
        """(waves per SIMD, the resource that limits it)."""
        limits = {"waves": MAX_WAVES_PER_SIMD}
        limits["vgpr"] = VGPRS_PER_SIMD // max(self.vgpr_alloc, VGPR_GRANULE)
        sgpr_alloc = math.ceil(max(self.sgpr, 1) / SGPR_GRANULE) * SGPR_GRANULE
        limits["sgpr"] = SGPRS_PER_SIMD // sgpr_alloc
        if self.lds_bytes:
            groups_per_cu = LDS_BYTES_PER_CU // self.lds_bytes
            limits["lds"] = groups_per_cu * self.waves_per_workgroup // SIMDS_PER_CU
        name = min(limits, key=lambda k: limits[k])
        return limits[name], name


def read_kernel_resources(object_bytes: bytes) -> list[KernelResources]:
    """Every kernel of every AMDGPU code object embedded in (or equal to) ``object_bytes``."""
    found = []
    for elf in _embedded_amdgpu_elfs(object_bytes):
        metadata = _amdgpu_metadata(elf)
        descriptors = _kernel_descriptors(elf)
        for k in metadata.get("amdhsa.kernels", []):
            rsrc1 = descriptors[k[".symbol"]][1]
            found.append(
                KernelResources(
                    name=k[".name"],
                    vgpr=k[".vgpr_count"],
                    agpr=k.get(".agpr_count", 0),
                    vgpr_alloc=((rsrc1 & 0x3F) + 1) * VGPR_GRANULE,
                    sgpr=k[".sgpr_count"],
                    lds_bytes=k[".group_segment_fixed_size"],
                    scratch_bytes=k[".private_segment_fixed_size"],
                    vgpr_spills=k.get(".vgpr_spill_count", 0),
                    sgpr_spills=k.get(".sgpr_spill_count", 0),
                    workgroup_size=k[".max_flat_workgroup_size"],
                )
            )
    return found


def read_kernel_arg_sizes(object_bytes: bytes) -> dict[str, list[int]]:
    """Per kernel, the byte size of each explicit kernel argument (the ``kernelParams`` a
    ``hipModuleLaunchKernel`` passes), in order; the hidden arguments are left out."""
    return {
        k[".name"]: [a[".size"] for a in k[".args"] if not a[".value_kind"].startswith("hidden")]
        for elf in _embedded_amdgpu_elfs(object_bytes)
        for k in _amdgpu_metadata(elf).get("amdhsa.kernels", [])
    }


def read_kernel_code(object_bytes: bytes) -> dict[str, bytes]:
    """Per function symbol (a kernel's name) of the embedded code objects, its machine code."""
    out = {}
    for elf in _embedded_amdgpu_elfs(object_bytes):
        for name, info, value, size in _symbols(elf):
            if info & 0xF == STT_FUNC and size:
                at = _address_to_offset(elf, value)
                out[name] = elf[at : at + size]
    return out


# ---------------------------------------------------------------------------------------------
# ELF64 little-endian
# ---------------------------------------------------------------------------------------------


def _embedded_amdgpu_elfs(data: bytes) -> list[bytes]:
    """The AMDGPU ELF images inside ``data`` (each cut at the end of its section headers)."""
    out, start = [], 0
    while (i := data.find(b"\x7fELF", start)) >= 0:
        start = i + 4
        if len(data) < i + 64 or data[i + 4] != 2 or data[i + 5] != 1:
            continue  # not ELF64 little-endian
        (machine,) = struct.unpack_from("<H", data, i + 18)
        if machine != EM_AMDGPU:
            continue
        shoff, shentsize, shnum = _header(data[i:])
        end = i + shoff + shentsize * shnum
        if end <= len(data):
            out.append(data[i:end])
            start = end
    return out


def _header(elf: bytes) -> tuple[int, int, int]:
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    return shoff, shentsize, shnum


def _sections(elf: bytes) -> list[tuple[int, int, int, int, int]]:
    """(type, offset, size, link, entsize) of every section."""
    shoff, shentsize, shnum = _header(elf)
    out = []
    for n in range(shnum):
        base = shoff + n * shentsize
        _, sh_type, _, _, offset, size, link, _, _, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", elf, base
        )
        out.append((sh_type, offset, size, link, entsize))
    return out


def _amdgpu_metadata(elf: bytes) -> dict:
    for sh_type, offset, size, _, _ in _sections(elf):
        if sh_type != SHT_NOTE:
            continue
        pos, end = offset, offset + size
        while pos + 12 <= end:
            namesz, descsz, note_type = struct.unpack_from("<III", elf, pos)
            name_at = pos + 12
            desc_at = name_at + _align4(namesz)
            name = elf[name_at : name_at + namesz].rstrip(b"\0")
            if name == b"AMDGPU" and note_type == NT_AMDGPU_METADATA:
                value, _ = _unpack_msgpack(elf, desc_at)
                return value
            pos = desc_at + _align4(descsz)
    raise ValueError("no NT_AMDGPU_METADATA note in the code object")


def _symbols(elf: bytes) -> list[tuple[str, int, int, int]]:
    """(name, st_info, st_value, st_size) of every defined symbol."""
    sections = _sections(elf)
    out = []
    for sh_type, offset, size, link, entsize in sections:
        if sh_type != SHT_SYMTAB:
            continue
        strtab = sections[link][1]
        for base in range(offset, offset + size, entsize):
            st_name, info, _, st_shndx, st_value, st_size = struct.unpack_from(
                "<IBBHQQ", elf, base
            )
            name = elf[strtab + st_name : elf.index(b"\0", strtab + st_name)].decode()
            if 0 < st_shndx < len(sections):
                out.append((name, info, st_value, st_size))
    return out


def _kernel_descriptors(elf: bytes) -> dict[str, tuple[int, int]]:
    """``<kernel>.kd`` symbol -> (compute_pgm_rsrc3, compute_pgm_rsrc1) of its descriptor."""
    out = {}
    for name, _, value, _ in _symbols(elf):
        if name.endswith(".kd"):
            # st_value is an address; the descriptor's section maps it to a file offset.
            file_at = _address_to_offset(elf, value)
            rsrc3, rsrc1 = struct.unpack_from("<II", elf, file_at + 44)
            out[name] = (rsrc3, rsrc1)
    return out


def _address_to_offset(elf: bytes, address: int) -> int:
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for n in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", elf, phoff + n * phentsize
        )
        if p_type == 1 and p_vaddr <= address < p_vaddr + p_filesz:  # PT_LOAD
            return p_offset + address - p_vaddr
    raise ValueError(f"address {address:#x} is in no loadable segment")


def _align4(n: int) -> int:
    return (n + 3) & ~3


# ---------------------------------------------------------------------------------------------
# MessagePack (the subset code-object metadata uses)
# ---------------------------------------------------------------------------------------------


def _unpack_msgpack(buf: bytes, pos: int):
    """Decodes one MessagePack value at ``pos``; returns (value, next position)."""
    b = buf[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0x80 <= b <= 0x8F:
        return _unpack_map(buf, pos, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _unpack_array(buf, pos, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return buf[pos : pos + n].decode(), pos + n
    if b in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[b], pos
    fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
    fixed |= {0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if b in fixed:
        (value,) = struct.unpack_from(fixed[b], buf, pos)
        return value, pos + struct.calcsize(fixed[b])
    sized = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str")}
    sized |= {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin")}
    sized |= {0xDC: (">H", "array"), 0xDD: (">I", "array")}
    sized |= {0xDE: (">H", "map"), 0xDF: (">I", "map")}
    if b not in sized:
        raise ValueError(f"unsupported MessagePack type byte {b:#x}")
    fmt, kind = sized[b]
    (n,) = struct.unpack_from(fmt, buf, pos)
    pos += struct.calcsize(fmt)
    if kind == "str":
        return buf[pos : pos + n].decode(), pos + n
    if kind == "bin":
        return bytes(buf[pos : pos + n]), pos + n
    return (_unpack_array if kind == "array" else _unpack_map)(buf, pos, n)


def _unpack_array(buf: bytes, pos: int, n: int):
    out = []
    for _ in range(n):
        value, pos = _unpack_msgpack(buf, pos)
        out.append(value)
    return out, pos


def _unpack_map(buf: bytes, pos: int, n: int):
    out = {}
    for _ in range(n):
        key, pos = _unpack_msgpack(buf, pos)
        out[key], pos = _unpack_msgpack(buf, pos)
    return out, pos
