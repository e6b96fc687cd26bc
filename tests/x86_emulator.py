"""Run the C kernel tables on an emulated x86-64 CPU (Bochs, through the
``bochscpu`` package), so that instruction sets this machine lacks
(AVX-512) are tested anyway.

The kernels are compiled freestanding and linked into one flat image at a
fixed address (tests/emulated/image.ld): the emulator is a CPU without an
operating system, so there is no loader, no relocation and no libc, and a
kernel that is not a leaf fails at link time. The guest runs in 64-bit ring
0 with identity-mapped 2 MiB pages over one host mapping, which NumPy views
read and write directly. A call sets the System V argument registers (and
stack arguments), returns into a ``hlt`` and reads rax / xmm0.

The facts this relies on (CPU state, the CPU-model switch, the pitfalls of
bochscpu 0.4.0) are in the project's notes on ISA emulation; those that
shape the code are repeated where they matter.
"""

import ctypes
import importlib.machinery
import importlib.util
import mmap
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
HERE = Path(__file__).resolve().parent / "emulated"

#: the files of the image: every x86 kernel table, what they call, and the
#: table registry with its CPUID / XGETBV checks
IMAGE_SOURCES = [SRC / "kernels_baseline.c", SRC / "kernels_avx2.c", SRC / "kernels_avx512.c",
                 SRC / "kernels_avx512bf16.c", SRC / "kernels_amx.c",
                 SRC / "scalar.c", SRC / "dispatch.c", HERE / "image_support.c"]
CFLAGS = ["-O3", "-fno-math-errno", "-fno-pic", "-fno-stack-protector",
          "-fno-asynchronous-unwind-tables", "-fcf-protection=none",
          "-fno-tree-loop-distribute-patterns", "-ffunction-sections", "-fdata-sections",
          "-Wno-unused-function"]
IMAGE_BASE = 0x400000          # tests/emulated/image.ld
RAM_BYTES = 96 << 20
PAGE_TABLES = 0x1000           # PML4, PDPT and PD at 0x1000, 0x2000, 0x3000
HALT = 0x8000                  # a hlt that kernels return into
ARENA = 16 << 20               # operands from here up
STACK_TOP = RAM_BYTES - 4096

#: Bochs CPU models by index (bochscpu 0.4.0's own name table is broken)
SKYLAKE_X = 26                 # AVX-512 F CD BW DQ VL

#: the entries of ca_kernels in the order of image_support.c's field table
FIELDS = ["score_f32", "score_f64", "pv_f32", "pv_f64", "row_max_f32", "row_max_f64",
          "exp_sum_f32", "exp_sum_f64", "score_direct_f32", "score_direct_f64",
          "pv_direct_f32", "pv_direct_f64", "half_rows_to_f32", "softcap_f32",
          "pack_kt_f32", "pack_v_f32", "int8_rows_to_f32", "score_direct_i8",
          "pv_direct_i8", "tile_rows", "tile_cols_f32", "tile_cols_f64",
          "score_direct_f16", "pv_direct_f16", "divide_rows_f32", "divide_rows_f64",
          "bf16_rows_to_f32", "score_direct_bf16", "pv_direct_bf16", "fp8_rows_to_f32",
          "score_direct_fp8", "pv_direct_fp8"]
TABLES = {"baseline": "ca_kernels_baseline", "avx2": "ca_kernels_avx2",
          "avx512": "ca_kernels_avx512"}


class EmulationError(RuntimeError):
    pass


def build_image(workdir):
    """Compile and link the image; return (flat binary bytes, {symbol: address})."""
    workdir = Path(workdir)
    objects = []
    for source in IMAGE_SOURCES:
        obj = workdir / (source.stem + ".o")
        subprocess.run(["cc", *CFLAGS, "-I", str(SRC), "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        objects.append(str(obj))
    elf = workdir / "image.elf"
    roots = [f"-u{name}" for name in (*TABLES.values(), "ca_image_fields",
                                      "ca_available_kernels", "ca_default_kernels",
                                      "ca_image_cpuid7_ecx")]
    subprocess.run(["ld", "-static", "-nostdlib", "--gc-sections", "-T", str(HERE / "image.ld"),
                    *roots, *objects, "-o", str(elf)], check=True, capture_output=True, text=True)
    flat = workdir / "image.bin"
    subprocess.run(["objcopy", "-O", "binary", str(elf), str(flat)], check=True,
                   capture_output=True)
    listing = subprocess.run(["nm", str(elf)], check=True, capture_output=True, text=True).stdout
    symbols = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3:
            symbols[parts[2]] = int(parts[0], 16)
    return flat.read_bytes(), symbols


def _preload_glibc_shim(workdir):
    """bochscpu 0.4.0's wheel calls glibc 2.38's __isoc23_strtoull and
    __isoc23_sscanf; on an older glibc two forwarding functions, loaded
    globally before the import, stand in for them."""
    version = os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0.0"
    major, minor = (int(x) for x in version.split()[-1].split(".")[:2])
    if (major, minor) >= (2, 38):
        return
    source = Path(workdir) / "isoc23.c"
    source.write_text(
        "#include <stdarg.h>\n#include <stdio.h>\n#include <stdlib.h>\n"
        "unsigned long long __isoc23_strtoull(const char *s, char **end, int base)\n"
        "{ return strtoull(s, end, base); }\n"
        "int __isoc23_sscanf(const char *s, const char *format, ...)\n"
        "{ va_list ap; va_start(ap, format); int n = vsscanf(s, format, ap);"
        " va_end(ap); return n; }\n")
    shim = Path(workdir) / "libisoc23.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", str(source), "-o", str(shim)],
                   check=True, capture_output=True)
    ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)


def import_bochscpu():
    """import bochscpu, and return it. bochscpu 0.4.0's wheel for Python 3.12
    and later is tagged cp312-abi3 (built for the stable ABI) but names its
    extension _bochscpu.cpython-312-x86_64-linux-gnu.so, a name no other
    Python imports: there the extension is loaded by its path first (an
    ImportError of it, such as an old glibc's, is the import's)."""
    name = "bochscpu._bochscpu"
    spec = importlib.util.find_spec("bochscpu")
    if name not in sys.modules and spec is not None and spec.submodule_search_locations:
        package = Path(list(spec.submodule_search_locations)[0])
        names = {"_bochscpu" + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES}
        built = sorted(package.glob("_bochscpu.*.so"))
        if built and not any(path.name in names for path in built):
            loader = importlib.machinery.ExtensionFileLoader(name, str(built[0]))
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
            loader.exec_module(module)
            sys.modules[name] = module
    import bochscpu
    if not hasattr(bochscpu, "_bochscpu"):
        bochscpu._bochscpu = sys.modules[name]
    return bochscpu


def _select_cpu_model(bochscpu_module, index):
    """Set the emulated CPU model through the library's parameter tree (must
    precede the Session)."""
    lib = ctypes.CDLL(bochscpu_module._bochscpu.__file__)
    lib.sim_get_param_enum.restype = ctypes.c_void_p
    lib.sim_get_param_enum.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    param = lib.sim_get_param_enum(b"cpu.model", None)
    if not param:
        raise EmulationError("bochscpu: no cpu.model parameter")
    set_enum = lib._ZN15bx_param_enum_c3setEl
    set_enum.argtypes = [ctypes.c_void_p, ctypes.c_long]
    set_enum(param, index)


# The hooks are module-level functions reading module-level state: a hook
# that refers back to an object holding the Session forms a cycle that
# crashes the interpreter at exit (bochscpu 0.4.0).
_host_base = 0
_outcome = {}
_counter = [0]


def _missing_page(gpa):
    if gpa >= RAM_BYTES:
        raise EmulationError(f"guest touched physical address {gpa:#x} outside its RAM")
    import bochscpu.memory
    page = gpa & ~0xFFF
    bochscpu.memory.page_insert(page, _host_base + page)


def _on_hlt(sess, cpu_id):
    sess.stop()


def _on_exception(sess, cpu_id, vector, error_code):
    _outcome["exception"] = (vector, error_code, sess.cpu.rip)
    sess.stop()


def _count(sess, cpu_id, insn):
    _counter[0] += 1


class Machine:
    """One emulated CPU with the image loaded; only one per process (a second
    bochscpu Session aborts the process)."""

    def __init__(self, cpu_model=SKYLAKE_X):
        global _host_base
        self._tmp = tempfile.TemporaryDirectory(prefix="cattention-bochs-")
        _preload_glibc_shim(self._tmp.name)
        import_bochscpu()
        import bochscpu
        import bochscpu.cpu
        self._bochscpu = bochscpu
        image, self.symbols = build_image(self._tmp.name)
        self._ram = mmap.mmap(-1, RAM_BYTES)
        self.ram = np.frombuffer(self._ram, dtype=np.uint8)
        _host_base = ctypes.addressof(ctypes.c_char.from_buffer(self._ram))
        self._write_page_tables()
        self.ram[HALT] = 0xF4                       # hlt
        self.ram[IMAGE_BASE:IMAGE_BASE + len(image)] = np.frombuffer(image, np.uint8)
        _select_cpu_model(bochscpu, cpu_model)
        self._session = bochscpu.Session()
        self._session.missing_page_handler = _missing_page
        self._plain = self._hook(count=False)
        self._counting = self._hook(count=True)
        self._arena = ARENA
        fields = self.read(self.symbols["ca_image_fields"], np.int64, len(FIELDS))
        self.tables = {}
        for name, symbol in TABLES.items():
            base = self.symbols[symbol]
            entry = {}
            for field, offset in zip(FIELDS, fields):
                if field.startswith("tile_"):
                    entry[field] = int(self.read(base + int(offset), np.int32, 1)[0])
                else:
                    entry[field] = int(self.read(base + int(offset), np.uint64, 1)[0])
            self.tables[name] = entry

    def _hook(self, count):
        hook = self._bochscpu.Hook()
        hook.hlt = _on_hlt
        hook.exception = _on_exception
        if count:
            hook.after_execution = _count
        return hook

    def _write_page_tables(self):
        # identity map of the RAM with 2 MiB pages: PML4[0] -> PDPT[0] -> PD
        entries = self.ram[PAGE_TABLES:PAGE_TABLES + 3 * 4096].view(np.uint64)
        entries[0] = (PAGE_TABLES + 0x1000) | 0x3          # present, writable
        entries[512] = (PAGE_TABLES + 0x2000) | 0x3
        for i in range(RAM_BYTES >> 21):
            entries[1024 + i] = (i << 21) | 0x83           # present, writable, 2 MiB

    def _state(self, xcr0):
        b = self._bochscpu
        state = b.State()
        state.cr0 = 0x80010033      # PE MP ET NE WP PG
        state.cr3 = PAGE_TABLES
        state.cr4 = 0x40620         # PAE OSFXSR OSXMMEXCPT OSXSAVE
        state.efer = 0xD00          # LME LMA NXE
        state.xcr0 = xcr0
        state.mxcsr = 0x1F80
        state.rflags = 0x2
        cs = b.Segment()
        cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x8, 0, 0xFFFFFFFF, 0xA09B
        state.cs = cs
        for name in ("ds", "es", "ss", "fs", "gs"):
            seg = b.Segment()
            seg.present, seg.selector, seg.base, seg.limit, seg.attr = (
                True, 0x10, 0, 0xFFFFFFFF, 0xC093)
            setattr(state, name, seg)
        return state

    # ---- guest memory ----

    def reset_arena(self):
        self._arena = ARENA

    def alloc(self, n_bytes):
        address = (self._arena + 63) & ~63
        if address + n_bytes > STACK_TOP - (1 << 20):
            raise EmulationError("guest arena exhausted")
        self._arena = address + n_bytes
        return address

    def put(self, array):
        """Copy array into guest memory; return its address."""
        array = np.ascontiguousarray(array)
        address = self.alloc(max(array.nbytes, 1))
        self.ram[address:address + array.nbytes] = array.view(np.uint8).reshape(-1)
        return address

    def empty(self, shape, dtype, fill=0):
        """A guest buffer filled with `fill`: (address, NumPy view of it)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        address = self.alloc(max(count * dtype.itemsize, 1))
        view = self.view(address, dtype, shape)
        view[...] = fill
        return address, view

    def view(self, address, dtype, shape):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        return self.ram[address:address + count * dtype.itemsize].view(dtype).reshape(shape)

    def read(self, address, dtype, count):
        return self.view(address, dtype, (count,)).copy()

    def read_string(self, address):
        end = address
        while self.ram[end] != 0:
            end += 1
        return bytes(self.ram[address:end]).decode()

    # ---- calls ----

    def call(self, address, args, returns=None, count=False, xcr0=0xE7):
        """Call the function at address with args, a list of ("i", int),
        ("f", float) or ("d", float). Returns the result (returns: None,
        "i", "f", "d", or "p" for a pointer) and, if count, the number of
        instructions run. xcr0 is the register state the "OS" enabled (by
        default x87, SSE, AVX, opmask, ZMM_Hi256 and Hi16_ZMM)."""
        integer_regs = ["rdi", "rsi", "rdx", "rcx", "r8", "r9"]
        state = self._state(xcr0)
        ints = [int(v) for kind, v in args if kind == "i"]
        floats = [(kind, v) for kind, v in args if kind != "i"]
        if len(floats) > 8:
            raise EmulationError("more than 8 floating-point arguments")
        on_stack = ints[6:]
        # at entry rsp points at the return address and rsp + 8 is 16-aligned
        rsp = (STACK_TOP - 8 * len(on_stack) - 64) & ~63
        rsp -= 8
        self.view(rsp, np.uint64, (1,))[0] = HALT
        for i, value in enumerate(on_stack):
            self.view(rsp + 8 + 8 * i, np.int64, (1,))[0] = value
        for reg, value in zip(integer_regs, ints):
            setattr(state, reg, value & 0xFFFFFFFFFFFFFFFF)
        state.rsp = rsp
        state.rip = address
        zmm = state.zmm
        for i, (kind, value) in enumerate(floats):
            if kind == "f":
                bits = struct.unpack("<I", struct.pack("<f", value))[0]
            else:
                bits = struct.unpack("<Q", struct.pack("<d", value))[0]
            reg = zmm[i]
            reg.q = [bits] + [0] * 7
            zmm[i] = reg
        state.zmm = zmm
        _outcome.clear()
        _counter[0] = 0
        self._session.cpu.state = state
        self._session.run([self._counting if count else self._plain])
        if "exception" in _outcome:
            vector, code, rip = _outcome["exception"]
            raise EmulationError(f"exception {vector} (error code {code}) at rip {rip:#x}")
        final = self._session.cpu.state
        if final.rip != HALT + 1:
            raise EmulationError(f"stopped at rip {final.rip:#x}, not at the return hlt")
        result = None
        if returns == "p":
            result = final.rax
        elif returns == "i":
            result = final.rax & 0xFFFFFFFF
            result = result - (1 << 32) if result >> 31 else result
        elif returns == "f":
            bits = final.zmm[0].q[0] & 0xFFFFFFFF
            result = struct.unpack("<f", struct.pack("<I", bits))[0]
        elif returns == "d":
            result = struct.unpack("<d", struct.pack("<Q", final.zmm[0].q[0]))[0]
        return (result, _counter[0]) if count else result

    def close(self):
        self._session = None
        self._tmp.cleanup()
