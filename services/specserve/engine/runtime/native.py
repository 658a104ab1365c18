"""The C kernels of ``kernels.c``, built for this machine at first use and called via ctypes.

Why C: the runtime needs linears and attention whose result for one token does not depend
on the other tokens in the call (see :mod:`specserve.engine.runtime.kernels`). oneDNN's packed linear
has that property but reads a decode's weights well below memory bandwidth at one or two
rows; MKL is fast at one row but rounds differently at 1, 2-3 and >= 4 rows. A small
hand-written kernel has the property by construction and streams a decode's weights at
close to bandwidth (docs/BENCHMARKS.md, "Runtime").

The library is compiled once per source, compiler and CPU (``-O3 -march=native``) into
``$SPECSERVE_CACHE_DIR`` (default ``~/.cache/specserve``), in a second or so. It links the
OpenMP runtime torch already loaded, so both share one thread pool. A compiler that does not
know this CPU (``-march=native`` fails) builds the portable kernels instead: the same code on
the compiler's generic vectors, row-invariant the same way, slower (:func:`build_flags` says
which). ``SPECSERVE_NATIVE_FLAGS`` adds flags to the native build: ``-mno-avx512f`` builds the
AVX2 code on an AVX512 machine (``make test-avx2`` runs the suite so). Where no C compiler
works, or ``SPECSERVE_NATIVE=0``, :func:`library` returns None
and the runtime falls back to oneDNN's packed linears and the blocked attention in
``kernels.py`` (row-invariant too, slower); :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.machine import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
PORTABLE_FLAGS = [flag for flag in FLAGS if not flag.startswith("-march=")]

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_flags: list[str] | None = None  # the build's, once loaded
_loaded = False
_lock = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (see :func:`unavailable_reason`).
    Decided once per process, under a lock: two threads must never run different kernels."""
    global _lib, _reason, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _lib = _load()
                except (_Unavailable, OSError, subprocess.SubprocessError) as exc:
                    # OSError / SubprocessError: the cache dir, the compiler, dlopen
                    _reason = str(exc) if isinstance(exc, _Unavailable) else f"{type(exc).__name__}: {exc}"
                    log.warning("native kernels unavailable (%s); using oneDNN and blocked "
                                "attention", _reason)
                _loaded = True
    return _lib


def unavailable_reason() -> str | None:
    library()
    return _reason


def build_flags() -> list[str] | None:
    """The flags the loaded kernels were built with (:data:`FLAGS` and any of
    ``SPECSERVE_NATIVE_FLAGS``, or :data:`PORTABLE_FLAGS` where the compiler did not know this
    CPU); None without kernels."""
    library()
    return _flags


class _Unavailable(Exception):
    pass


def _load() -> ctypes.CDLL:
    global _flags
    if os.environ.get("SPECSERVE_NATIVE", "1") == "0":
        raise _Unavailable("SPECSERVE_NATIVE=0")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise _Unavailable("no C compiler on PATH")
    native_flags = FLAGS + os.environ.get("SPECSERVE_NATIVE_FLAGS", "").split()
    try:
        path, flags = _built_with(compiler, native_flags), native_flags
    except _Unavailable as exc:
        log.warning("%s; building the portable kernels", exc)
        path, flags = _built_with(compiler, PORTABLE_FLAGS), PORTABLE_FLAGS
    lib = declare(ctypes.CDLL(str(path)))
    _flags = flags
    return lib


def _built_with(compiler: str, flags: list[str]) -> Path:
    """The cached build of the kernels with ``flags``, compiled first if it is not there.

    Processes that start at once (a unit's ranks, a test run's Serve apps on a new machine)
    take turns on a lock file: the first compiles, the others find its build. Each compiling
    its own copy cost a fresh machine a few CPU-seconds per process, on cores they share."""
    path = _cache_dir() / f"kernels-{_build_key(compiler, flags)}.so"
    if not path.exists():
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                _compile(compiler, flags, path)
    return path


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the kernels of a loaded build their argument types."""
    ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.linear_rows.argtypes = [ptr] * 4 + [i32] * 4
    lib.linear_rows.restype = None
    lib.attention_rows.argtypes = [ptr, i32] + [ptr] * 3 + [i32] + [ptr] * 5 + [i32] * 6 + [f32, i32]
    lib.rms_norm_rows.argtypes = [ptr] * 3 + [i32] * 2 + [f32, i32]
    lib.silu_mul_rows.argtypes = [ptr] * 2 + [i32] * 3
    lib.rope_and_store.argtypes = [ptr] * 6 + [i32] + [ptr] * 2 + [i32] * 7
    lib.exponential_noise_rows.argtypes = [ptr] + [i32] * 2 + [ptr, i32]
    lib.decoder_layer.argtypes = [ptr, ptr, ctypes.POINTER(LayerRef), ctypes.POINTER(ForwardRef)]
    lib.decoder_layers.argtypes = [ptr] * 3 + [ctypes.POINTER(ctypes.POINTER(LayerRef)), i32,
                                               ctypes.POINTER(ForwardRef)]
    lib.decoder_layer_scratch.argtypes = [ctypes.POINTER(LayerRef), i32]
    lib.decoder_layer_scratch.restype = ctypes.c_long
    lib.dequantize_rows.argtypes = [i32, ptr, i32, ptr, i32, i32, ptr]
    lib.dequantize_rows.restype = i32
    quantized = [getattr(lib, f"linear_rows_{kind.lower()}{x8}") for kind in QUANT_BLOCKS
                 for x8 in ("", "_x8")]
    for fn in quantized:
        fn.argtypes = [ptr] * 4 + [i32] * 4
    for fn in (lib.linear_rows, lib.attention_rows, lib.rms_norm_rows, lib.silu_mul_rows,
               lib.rope_and_store, lib.exponential_noise_rows, lib.decoder_layer,
               lib.decoder_layers, *quantized):
        fn.restype = None
    return lib


def _cache_dir() -> Path:
    path = default_cache_dir() / "native"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key(compiler: str, flags: list[str]) -> str:
    """Source, flags, compiler version and CPU: a shared cache never serves another CPU's build."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(), _cpu().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    # Build beside the target and rename: processes that build at once each get a whole file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [compiler, *flags, str(SOURCE), "-o", str(out), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise _Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, path)


def _built() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {_reason}")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for float32 CPU tensors (``x``: ``[..., K]``; ``weight``:
    ``[N, K]`` contiguous), each output row computed the same way whatever the row count."""
    k = weight.shape[1]
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32)
    _built().linear_rows(flat.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(),
                         flat.shape[0], weight.shape[0], k, torch.get_num_threads())
    return out.view(*x.shape[:-1], weight.shape[0])


# -- quantized weights -------------------------------------------------------------------------
QUANT_BLOCK = 32  # weights per block, in every type here
GROUP_ROWS = 16   # rows a group of the integer kernels' layout interleaves (kernels.c's X8_ROWS)
# GGUF block types the kernels read (kernels.c, "Quantized linears"): the bytes of a block in
# the file and as packed here (its scales as float32, then its quants).
QUANT_BLOCKS = {"Q4_0": (18, 20), "Q4_1": (20, 24), "Q8_0": (34, 36)}


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight ``[out_features, in_features]`` as packed blocks (:func:`pack_blocks`):
    ``data`` ``[out_features, in_features / 32 * packed bytes]`` uint8, a row's blocks in
    order; with ``x8_inputs``, ``[groups of 16 rows, the same bytes x 16]``, the rows
    interleaved (:func:`interleave_rows`)."""

    kind: str  # a key of QUANT_BLOCKS
    data: torch.Tensor
    out_features: int
    in_features: int
    x8_inputs: bool = False  # met by 8-bit inputs in integer dots (``kernels: integer``)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack_blocks(kind: str, raw: torch.Tensor, out_features: int, in_features: int,
                x8_inputs: bool = False) -> QuantizedWeight:
    """A GGUF tensor's blocks (``raw``: its bytes, uint8, rows of ``in_features / 32`` blocks)
    in the kernels' layout: each block's half-precision scales (``d``, and Q4_1's ``m``)
    converted to float32 (exact), then its quants as they are. ``x8_inputs``: see
    :class:`QuantizedWeight`."""
    if kind not in QUANT_BLOCKS:
        raise ValueError(f"no kernel reads {kind} blocks (they read {', '.join(QUANT_BLOCKS)})")
    if in_features % QUANT_BLOCK:
        raise ValueError(f"{in_features} inputs are not whole blocks of {QUANT_BLOCK}")
    file_bytes, _ = QUANT_BLOCKS[kind]
    blocks = raw.reshape(out_features, in_features // QUANT_BLOCK, file_bytes)
    scales = _scales(kind)
    as_float = [blocks[..., 2 * i:2 * i + 2].contiguous().view(torch.float16).float().view(torch.uint8)
                for i in range(scales)]
    packed = torch.cat([*as_float, blocks[..., 2 * scales:]], dim=-1).reshape(out_features, -1)
    if x8_inputs:
        packed = interleave_rows(kind, packed)
    return QuantizedWeight(kind, packed.contiguous(), out_features, in_features, x8_inputs)


def interleave_rows(kind: str, packed: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[N, blocks x bytes]`` in the integer kernels' layout (kernels.c, "Integer
    dot products"): rows in groups of :data:`GROUP_ROWS` (the last padded with zero blocks), and
    per group and block the rows' ``d``, their ``m`` (Q4_1), then their quants in chunks of 4
    bytes, chunk by chunk. ``[groups, blocks x 16 x bytes]``: the same bytes, moved."""
    n, scales, block = packed.shape[0], _scales(kind), QUANT_BLOCKS[kind][1]
    padded = torch.cat([packed, packed.new_zeros((-n % GROUP_ROWS, packed.shape[1]))])
    blocks = padded.view(-1, GROUP_ROWS, packed.shape[1] // block, block).transpose(1, 2)  # [g, nb, 16, B]
    groups = blocks.shape[0]
    parts = [blocks[..., 4 * i:4 * i + 4] for i in range(scales)]     # each [groups, nb, 16, 4]
    quants = blocks[..., 4 * scales:].unflatten(-1, (-1, 4)).transpose(2, 3)  # [.., chunk, row, 4]
    return torch.cat([p.flatten(2) for p in (*parts, quants)], dim=-1).reshape(groups, -1)


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64


def huge_pages(nbytes: int) -> torch.Tensor:
    """``[nbytes]`` uint8 of memory of its own, 2 MiB aligned, asked of the kernel in 2 MiB pages
    (``madvise(MADV_HUGEPAGE)``, Linux's transparent huge pages; elsewhere, or where they are
    off, plain pages). What it is for: a forward streams its weights once, and in 4 KiB pages
    each page is a TLB miss, a walk of the page tables (two levels of them in a VM). On a 2-core
    Zen 4 VM the 30 layers' linears from memory at 9 rows took 0.86x the time in huge pages,
    at one row 0.93x (docs/BENCHMARKS.md, "... the weights in huge pages"). A private mapping:
    a shared anonymous one is shmem, which takes huge pages only where shmem is set to. The
    memory lives as long as the tensor or a view of it (``torch.frombuffer`` holds the
    mapping)."""
    size = nbytes + HUGE_PAGE  # room to start on a 2 MiB boundary
    size += -size % HUGE_PAGE
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or no transparent huge pages
        pass
    memory = torch.frombuffer(area, dtype=torch.uint8)
    start = -memory.data_ptr() % HUGE_PAGE
    return memory[start:start + nbytes]


def gathered(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """``weights``, each one's blocks copied into one :func:`huge_pages` buffer, in this order
    (a forward's: a layer's linears, layer after layer, then the head), each at a 64-byte
    boundary; the same bytes, so the same outputs."""
    offsets, total = [], 0
    for w in weights:
        offsets.append(total)
        total += w.nbytes + -w.nbytes % 64
    memory = huge_pages(total)
    moved = []
    for w, at in zip(weights, offsets):
        data = memory[at:at + w.nbytes].view(w.data.shape)
        data.copy_(w.data)
        moved.append(QuantizedWeight(w.kind, data, w.out_features, w.in_features, w.x8_inputs))
    return moved


def standard_rows(weight: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``weight``'s packed rows ``[N, blocks x bytes]`` (or its ``rows``, ``[R]`` indices), row
    by row (:func:`interleave_rows` undone where it was done: only the rows' groups)."""
    if not weight.x8_inputs:
        return weight.data if rows is None else weight.data[rows]
    if rows is not None:  # an embedding's lookup, each token: one gather
        where = _group_offsets(weight.kind, weight.in_features)
        return weight.data[(rows // GROUP_ROWS)[:, None], where[rows % GROUP_ROWS]]
    scales, block, g = _scales(weight.kind), QUANT_BLOCKS[weight.kind][1], GROUP_ROWS
    nb = weight.in_features // QUANT_BLOCK
    groups = weight.data.view(-1, nb, g * block)                      # [groups, nb, 16 x bytes]
    parts = [groups[..., 4 * g * i:4 * g * (i + 1)].unflatten(-1, (g, 4)) for i in range(scales)]
    quants = groups[..., 4 * g * scales:].unflatten(-1, (-1, g, 4)).transpose(2, 3).flatten(3)
    unpacked = torch.cat([*parts, quants], dim=-1).transpose(1, 2)    # [groups, 16, nb, bytes]
    return unpacked.reshape(-1, nb * block)[:weight.out_features]


@functools.cache
def _group_offsets(kind: str, in_features: int) -> torch.Tensor:
    """``[16, row bytes]``: where each byte of a group's row ``r`` lies in the group's
    interleaved bytes (row ``r``'s byte ``j`` is at ``[r, j]``), found by interleaving the
    bytes' own indices."""
    width = in_features // QUANT_BLOCK * QUANT_BLOCKS[kind][1]
    moved = interleave_rows(kind, torch.arange(GROUP_ROWS * width).view(GROUP_ROWS, width)).flatten()
    where = torch.empty_like(moved)
    where[moved] = torch.arange(moved.numel())
    return where.view(GROUP_ROWS, width)


def _scales(kind: str) -> int:
    return 2 if kind == "Q4_1" else 1


def dequantize_blocks(weight: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight ``[out_features, in_features]`` of packed blocks (or its ``rows``,
    ``[R]`` indices: an embedding's lookup), in torch: the dequantizer's arithmetic
    (``d * (q - 8)``, ``d * q + m``, ``q * d``, each operation rounded to float32), so the
    weight the float32 path loads, bit for bit."""
    k = weight.in_features
    data = standard_rows(weight, rows)
    n = data.shape[0]
    blocks = data.view(n, k // QUANT_BLOCK, QUANT_BLOCKS[weight.kind][1])
    scales = _scales(weight.kind)
    d, m = (blocks[..., 4 * i:4 * i + 4].contiguous().view(torch.float32) for i in (0, 1))
    qs = blocks[..., 4 * scales:]
    if weight.kind == "Q8_0":
        return (qs.contiguous().view(torch.int8).float() * d).view(n, k)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()            # [n, blocks, 32]
    out = d * (q - 8) if weight.kind == "Q4_0" else d * q + m
    return out.view(n, k)


def dequantized_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_blocks` of ``rows`` (``[R]`` indices, CPU), in C: an embedding's lookup
    without its dozen small torch operations (one row: 6 us against 40 on a 2-core EPYC).
    The same bits."""
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), weight.in_features)
    kind = WEIGHT_KINDS[weight.kind] + X8_INPUTS * weight.x8_inputs
    if _built().dequantize_rows(kind, weight.data.data_ptr(), weight.out_features, rows.data_ptr(),
                                rows.numel(), weight.in_features, out.data_ptr()):
        raise IndexError(f"a row off the table of {weight.out_features}")
    return out


def linear_quantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear` with a weight of packed blocks: the float32 path's outputs bit for bit
    (the weight formed in registers as the dequantizer forms it); with ``weight.x8_inputs``,
    each row's inputs quantized to 8 bits (16 in an outlier's block) and met by the blocks in
    integer dot products (kernels.c, "Integer dot products": row-invariant, not the float32
    path's bits)."""
    k, n = weight.in_features, weight.out_features
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    kernel = getattr(_built(), f"linear_rows_{weight.kind.lower()}{'_x8' if weight.x8_inputs else ''}")
    kernel(flat.data_ptr(), weight.data.data_ptr(), _ptr(bias), out.data_ptr(), flat.shape[0], n, k,
           torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


def check_table(table: torch.Tensor, rows: int, block_len: int, end: int) -> None:
    """The kernels trust a block table (a key past its blocks would be read from anywhere):
    ``[rows, W]`` int32, contiguous, and positions below ``end`` within its ``W`` blocks."""
    assert table.dtype == torch.int32 and table.is_contiguous() and table.shape[0] == rows
    assert end <= table.shape[1] * block_len, \
        f"positions up to {end} past the block table ({table.shape[1]} x {block_len})"


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
              lo: torch.Tensor, hi: torch.Tensor, scale: float, tree: torch.Tensor | None = None,
              starts: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` ``[B, T, H, D]`` (each token's heads contiguous; tokens may be
    further apart, as the q part of a fused projection is) over the cache storage ``keys`` /
    ``values`` ``[blocks, Hk, BS, D]``, row ``b``'s positions in the blocks ``table[b]``
    (``[B, W]`` int32: position ``j`` at offset ``j % BS`` of block ``table[b, j // BS]``; a
    slot cache passes its slots as ``[B, 1]``, a block being a whole slot); query ``(b, t)``
    reads keys ``lo[b, t] <= j < hi[b, t]`` (int32, at least one). Returns ``[B, T, H * D]``.

    Token trees: with ``tree`` ``[B, T]`` (int64 bitmasks) and ``starts`` ``[B]`` (int32, the
    position of each row's first new token; -1: the row is a chain), query ``(b, t)`` of a
    tree row reads the keys before ``starts[b]`` (from ``lo``) and those new tokens ``i``
    whose bit ``i`` is set (at most 64 new tokens in a tree row)."""
    b, t, h, d = q.shape
    if q.stride(3) != 1 or q.stride(2) != d or q.stride(0) != t * q.stride(1):
        q = q.contiguous()
    out = torch.empty(b, t, h * d, dtype=torch.float32)
    check_table(table, b, keys.shape[2], int(hi.max()))
    _built().attention_rows(q.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(),
                            table.data_ptr(), table.shape[1], lo.data_ptr(), hi.data_ptr(),
                            _ptr(tree), _ptr(starts),
                            out.data_ptr(), b, t, h,
                            keys.shape[1], keys.shape[2], d, scale, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a float32 ``x``, row by row."""
    n = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    _built().rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                           torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[..., 2 * n]`` float32 tensor laid out ``[gate | up]``."""
    n = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], n, dtype=torch.float32)
    _built().silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n,
                           torch.get_num_threads())
    return out


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                   kv_heads: int, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                   starts: torch.Tensor, lens: torch.Tensor) -> None:
    """In place on the fused projection ``qkv`` ``[B, T, (heads + 2 kv_heads) * D]``
    (contiguous): rotate-half RoPE on its q and k heads (``cos`` / ``sin``: ``[B, T, 1, D]``),
    then store the k and v heads of row ``b``'s first ``lens[b]`` tokens at positions
    ``starts[b]..`` of row ``b`` in the cache storage ``keys`` / ``values`` through its
    block table (``table``: as :func:`attention`'s)."""
    b, t, _ = qkv.shape
    d = keys.shape[3]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    check_table(table, b, keys.shape[2], int((starts + lens).max()))
    _built().rope_and_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                            values.data_ptr(), table.data_ptr(), table.shape[1], starts.data_ptr(),
                            lens.data_ptr(),
                            b, t, heads, kv_heads, keys.shape[2], d, torch.get_num_threads())


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` Exp(1) noise of int64 ``keys`` ``[N]``
    (:func:`specserve.engine.step.sampling.exponential_noise`'s formula, in one pass)."""
    keys = keys.contiguous()
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32)
    _built().exponential_noise_rows(keys.data_ptr(), keys.shape[0], vocab, out.data_ptr(),
                                    torch.get_num_threads())
    return out


# -- a decoder layer in one call (kernels.c, "A decoder layer in one call") ----------------------
WEIGHT_KINDS = {"float32": 0, "Q4_0": 1, "Q4_1": 2, "Q8_0": 3}  # kernels.c's W_F32 ...
X8_INPUTS = 8  # kernels.c's W_X8, added to a block kind whose inputs go in 8 bits (16: outliers')


class WeightRef(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class LayerRef(ctypes.Structure):
    _fields_ = [("qkv", WeightRef), ("o", WeightRef), ("gate_up", WeightRef), ("down", WeightRef),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                *((name, ctypes.c_int) for name in ("H", "Hk", "D", "hidden", "intermediate", "window")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class ForwardRef(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in ("B", "T", "BS", "W", "threads")),
                *((name, ctypes.c_void_p) for name in ("cos", "sin", "table", "start", "lens", "lo",
                                                       "lo_window", "hi", "tree_start", "tree",
                                                       "scratch"))]


def weight_ref(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> WeightRef:
    """What the C kernels read of a linear (its weight's storage must outlive the ref)."""
    if isinstance(weight, QuantizedWeight):
        return WeightRef(WEIGHT_KINDS[weight.kind] + X8_INPUTS * weight.x8_inputs,
                         weight.out_features, weight.in_features,
                         weight.data.data_ptr(), _ptr(bias))
    assert cpu_float32_contiguous(weight), "the C kernels read float32 rows"
    return WeightRef(WEIGHT_KINDS["float32"], weight.shape[0], weight.shape[1], weight.data_ptr(),
                     _ptr(bias))


def cpu_float32_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def layer_scratch(layer: LayerRef, tokens: int) -> int:
    """Floats of scratch :func:`decoder_layer` needs for ``tokens`` rows."""
    return _built().decoder_layer_scratch(ctypes.byref(layer), tokens)


def decoder_layer(x: torch.Tensor, layer: LayerRef, forward: ForwardRef) -> torch.Tensor:
    """A decoder layer over ``x`` ``[B, T, hidden]`` (contiguous float32) in one call: its
    output, and its keys and values in the cache (see :class:`LayerRef`, :class:`ForwardRef`;
    the tensors they point to are the caller's to keep alive)."""
    out = torch.empty_like(x)
    _built().decoder_layer(x.data_ptr(), out.data_ptr(), ctypes.byref(layer), ctypes.byref(forward))
    return out


def layer_stack(layers: list[LayerRef]) -> ctypes.Array:
    """``layers`` as :func:`decoder_layers` takes them (the refs must outlive the array)."""
    return (ctypes.POINTER(LayerRef) * len(layers))(*(ctypes.pointer(layer) for layer in layers))


def decoder_layers(x: torch.Tensor, stack: ctypes.Array, forward: ForwardRef) -> torch.Tensor:
    """:func:`decoder_layer` of each layer of ``stack`` (:func:`layer_stack`) in turn, in one
    call: the last layer's output. ``forward``'s scratch fits the widest layer."""
    out = torch.empty_like(x)
    spare = torch.empty_like(x) if len(stack) > 1 else out
    _built().decoder_layers(x.data_ptr(), out.data_ptr(), spare.data_ptr(), stack, len(stack),
                            ctypes.byref(forward))
    return out
