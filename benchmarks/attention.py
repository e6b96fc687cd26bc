"""Benchmark of attention alone: ``python benchmarks/attention.py`` (``make bench``).

Times cattention beside its peers on a fixed grid of attention shapes, in one
process, and prints one table row per (case, thread count, implementation).

Implementations
    ``cattention``      ATTN only (nothing of size T x S is allocated)
    ``cattention+S``    ATTN and SCORES (``return_scores=True``)
    ``numpy``           plain matmul + stable softmax + matmul in the input
                        dtype; materialises T x S
    ``torch-sdpa``      ``torch.nn.functional.scaled_dot_product_attention``
    ``torch-explicit``  torch matmul + softmax + matmul, also returns weights
    ``onnxruntime``     the ONNX Attention operator (opset 23) in onnxruntime
    ``openvino``        OpenVINO's ScaledDotProductAttention (opset 13), f32
    ``cattention-f32``  bfloat16 cases only: cattention in float32 on the
                        same values (what a runtime pays by upcasting)
    ``cattention-medium`` bfloat16 full-attention cases only: cattention at
                        ``precision="medium"`` (P rounded to bfloat16 for
                        P.V, the peers' numerics); ``cattention`` runs the
                        default, ``"high"``

The peers that materialise T x S (``cattention+S``, ``numpy``,
``torch-explicit``) are run only where B*H*T*S is moderate, and not on the
bfloat16 cases; the torch peers only when torch is importable (it is
imported lazily).

bfloat16 cases (issues 41 and 48; they need ml_dtypes, and are left out
without it) give cattention ``ml_dtypes.bfloat16`` arrays, PyTorch SDPA the
same bits as ``torch.bfloat16`` tensors, and OpenVINO bf16 parameters with
``INFERENCE_PRECISION_HINT: bf16``. onnxruntime is asked for a bfloat16
Attention (opset 23), then com.microsoft MultiHeadAttention, through I/O
binding; where its CPU provider has neither (1.32 has not), its row says so
instead of a time. The bfloat16 decode case is one step of
``attention_with_kvcache`` (the cache holds S - 1 keys, the call appends the
S-th), and ``cattention-f32`` the same step over a float32 cache; the peers
attend over the S keys in place, without the append.

Method
    * Each thread count is a separate pass. cattention gets ``num_threads=N``
      per call, torch ``torch.set_num_threads(N)`` and NumPy's BLAS
      ``threadpoolctl.threadpool_limits(N, user_api="blas")`` when available.
    * Per case every implementation is called once untimed (warm-up; its
      output gives the error column), then timed round-robin: in every round
      each implementation runs once, the starting one rotating, so machine
      noise hits all of them alike. The table shows medians. With more than
      one thread, a multi-threaded NumPy call is followed by an untimed pause
      so that OpenBLAS's spinning workers do not slow the next one.
    * Errors are max |out - ref| against a float64 NumPy reference computed
      one (batch, head) slice at a time, once per case.
    * Throughput is GFLOP/s with FLOPs = 4*B*H*T*S*d (halved for causal with
      T == S), or for decode (T == 1) the GB/s of K and V read (in the
      dtype each implementation reads: float32 for ``cattention-f32``),
      also as a fraction of a DRAM bandwidth probe (``np.dot`` of two large
      float32 vectors) measured in the same pass.
    * "vs ca" is peer time / cattention time (above 1: cattention is faster);
      "vs ca+S" compares the peers that return the weights with
      ``cattention+S``.
    * Throughput of float32 attention is also given as a fraction of a GEMM
      probe (NumPy's ``a @ b`` of two square float32 matrices, the BLAS's
      own register-tiled kernel on the same cores; its fastest round) measured
      in the same pass: about the rate the two matmuls inside attention
      could reach.
    * cattention's GFLOP/s is also given as a share of the fastest
      multiply-add loop of the kernel table its kernels ran on
      (``driver.loop_flops``: vector FMAs, or AMX tile products on the
      ``amx`` table), timed in the same run per table and thread count in
      process CPU time, so that other processes' load does not count; at 2
      threads two Python threads run it at once (:func:`measure_loop_rate`).
      bfloat16 calls take the loop of the table in use
      (``driver.get_simd()``), float32 ones that of the table whose FMA
      kernels they run (the ``amx`` table's float32 is ``avx512``'s). On
      ``avx512bf16`` the loop is the FMA loop, while VDPBF16PS (its scores)
      does two multiply-adds per lane where an FMA does one.
    * ``--simd TABLE[,TABLE]`` (or ``all``) runs every case on each kernel
      table in turn (``driver.set_simd``), a pass per table and thread
      count; ``make bench-bf16`` runs the bfloat16 cases on every table
      this CPU runs, so bf16 and float32 can be set side by side for the
      avx2, avx512bf16 and amx tables in one run.
    * A separate memory probe runs one long causal case in a fresh
      subprocess and reports its peak RSS increase (see
      :func:`measure_memory`).
    * The header names the instruction set PyTorch's own kernels run
      (``torch.backends.cpu.get_cpu_capability()``) and the one asked of
      MKL, which does PyTorch's matrix products (SDPA's included) and picks
      its own otherwise. To set the avx2 table against an AVX2 PyTorch on an
      AVX-512 machine, run with ``CATTENTION_SIMD=avx2
      ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``: with
      ATEN_CPU_CAPABILITY alone, SDPA still multiplies with AVX-512 (on an
      Intel Xeon, (1, 8, 1024, 1024, 64) at 106 GFLOP/s, and 58 with MKL at
      AVX2 too). onnxruntime and OpenVINO keep their own choice.

Nothing here asserts on timings; :func:`run_benchmark` is the in-process
entry point and returns plain dict records (see ``--json``).
"""

import contextlib
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

import numpy as np

from cattention import attention, attention_with_kvcache, show_config
from cattention._native import driver

__all__ = ["Case", "DEFAULT_CASES", "add_arguments", "main", "run_benchmark"]

#: Peers that materialise a T x S matrix run only up to this many elements
#: B*H*T*S (2**25: 128 MiB of float32 weights, e.g. 8 heads at 2048 x 2048).
MATERIALISE_LIMIT = 1 << 25
#: The float64 reference (one T x S slice at a time) is computed up to this.
REFERENCE_LIMIT = 1 << 27

DEFAULT_ROUNDS = 7
QUICK_ROUNDS = 3
DEFAULT_THREADS = (1, 2)
#: DRAM probe: two float32 vectors of this many elements (2 x 256 MiB).
PROBE_ELEMENTS = 64 << 20
PROBE_ROUNDS = 5
#: GEMM probe: a @ b of two float32 matrices of this order.
GEMM_SIZE = 2048
#: Pause after a multi-threaded NumPy (OpenBLAS) or PyTorch call before the
#: next implementation runs. OpenBLAS's idle worker threads keep spinning
#: (with no system call: strace counts no sched_yield between 200 matmuls)
#: for about 2**28 cycles after a call, PyTorch's OpenMP
#: workers similarly; on a 2-core machine that slowed the implementation run
#: next by 25-75 % (1024-token case) and a tiny call tenfold.
BLAS_SETTLE_SECONDS = 0.2
#: Cases with at most this many score elements (B*H*T*S) are timed in runs
#: of TINY_REPEATS calls.
TINY_ELEMENTS = 4096
TINY_REPEATS = 200
#: Memory probe shape (B, H, T, S, d), causal, without SCORES.
MEMORY_SHAPE = (1, 1, 32768, 32768, 64)

CATTENTION = "cattention"
CATTENTION_SCORES = "cattention+S"
CATTENTION_F32 = "cattention-f32"
CATTENTION_MEDIUM = "cattention-medium"
NUMPY = "numpy"
TORCH_SDPA = "torch-sdpa"
TORCH_EXPLICIT = "torch-explicit"
ONNXRUNTIME = "onnxruntime"
OPENVINO = "openvino"
PROBE = "np.dot"
GEMM_PROBE = "np.matmul"
LOOP_PROBE = "loop_flops"

#: ml_dtypes' bfloat16 (an optional dependency: without it the bfloat16
#: cases are left out, and the run says so)
BFLOAT16 = "bfloat16"


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One attention shape: q (B, H, T, d), k and v (B, H_kv, S, d).

    ``kv_heads`` below ``heads`` is grouped-query attention; ``kv_dtype``
    (e.g. float16, a halved KV cache) may differ from q's ``dtype``.
    ``kvcache`` makes a decode case one step of ``attention_with_kvcache``:
    the cache holds S - 1 keys and the call appends the S-th."""

    batch: int
    heads: int
    n_queries: int
    n_keys: int
    dim: int
    causal: bool = False
    dtype: str = "float32"
    quick: bool = False  # part of the --quick subset
    kv_heads: int = 0    # 0: as many as query heads
    kv_dtype: str = ""   # "": as q
    window: int = 0      # > 0: causal sliding window of this many earlier keys
    kvcache: bool = False

    @property
    def n_kv_heads(self):
        return self.kv_heads or self.heads

    @property
    def kv_type(self):
        return self.kv_dtype or self.dtype

    @property
    def name(self):
        shape = f"{self.batch}x{self.heads}x{self.n_queries}x{self.n_keys}x{self.dim}"
        name = f"{shape} causal" if self.causal else f"{shape} full"
        if self.n_kv_heads != self.heads:
            name += f" gqa{self.heads}/{self.n_kv_heads}"
        if self.kv_type != self.dtype:
            name += f" kv-{np.dtype(self.kv_type).name}"
        if self.window:
            name += f" window{self.window}"
        if self.kvcache:
            name += " kvcache"
        return name

    @property
    def is_decode(self):
        return self.n_queries == 1

    @property
    def score_elements(self):
        return self.batch * self.heads * self.n_queries * self.n_keys

    @property
    def materialise(self):
        """Whether peers that build the T x S weights are affordable here."""
        return self.score_elements <= MATERIALISE_LIMIT

    @property
    def visible_fraction(self):
        """Share of (query, key) pairs computed: 1/2 for causal with T == S."""
        if self.window:
            return float(visible_mask(self.n_queries, self.n_keys, self.window).mean())
        if not self.causal:
            return 1.0
        if self.n_queries == self.n_keys:
            return 0.5
        offset = self.n_keys - self.n_queries
        rows = np.arange(self.n_queries)
        visible = np.clip(rows + offset + 1, 0, self.n_keys).sum()
        return float(visible) / (self.n_queries * self.n_keys)

    @property
    def flops(self):
        return 4.0 * self.score_elements * self.dim * self.visible_fraction

    def kv_bytes(self, dtype=None):
        """Bytes of K and V read, stored in ``dtype`` (default: the case's)."""
        dtype = dtype or self.kv_type
        itemsize = 2 if dtype == BFLOAT16 else np.dtype(dtype).itemsize
        return 2.0 * self.batch * self.n_kv_heads * self.n_keys * self.dim * itemsize

    def matches(self, patterns):
        """True if any substring in ``patterns`` occurs in the case's label."""
        if not patterns:
            return True
        label = f"{self.name} {self.dtype}" + (" decode" if self.is_decode else "")
        return any(p in label for p in patterns)


DEFAULT_CASES = (
    Case(1, 8, 1024, 1024, 64, causal=False, quick=True),
    Case(1, 8, 1024, 1024, 64, causal=True, quick=True),
    Case(1, 8, 2048, 2048, 64, causal=False),
    Case(1, 8, 2048, 2048, 64, causal=True),
    Case(1, 4, 4096, 4096, 64, causal=True),
    Case(1, 8, 1024, 1024, 128, causal=True),
    # 512-token prefill chunks of 7B-class models, and longer heads
    Case(1, 8, 2048, 2048, 128, causal=False),
    Case(4, 32, 512, 512, 128, causal=False),
    Case(4, 32, 512, 512, 128, causal=True),
    Case(8, 12, 512, 512, 64, causal=False),
    Case(1, 32, 2048, 2048, 128, causal=True),
    Case(8, 12, 128, 128, 64, causal=False, quick=True),
    Case(1, 32, 1, 4096, 128),
    Case(1, 32, 1, 1024, 128, quick=True),
    Case(1, 32, 1, 4096, 128, kv_heads=8),
    Case(1, 32, 1, 4096, 128, kv_heads=8, kv_dtype="float16"),
    Case(1, 1, 8, 8, 8, quick=True),
    Case(1, 2, 8192, 8192, 64, causal=True, window=1024),
    Case(1, 8, 1024, 1024, 64, causal=False, dtype="float64"),
    Case(1, 8, 1024, 1024, 64, causal=True, dtype="float64"),
    # bfloat16 (issues 41 and 48), each beside cattention in float32 on the
    # same values; the decode step appends to a bfloat16 cache, beside the
    # same step over a float32 cache
    Case(1, 8, 1024, 1024, 64, dtype=BFLOAT16, quick=True),
    Case(4, 32, 512, 512, 128, dtype=BFLOAT16),
    Case(8, 12, 512, 512, 64, dtype=BFLOAT16),
    Case(1, 8, 2048, 2048, 64, causal=True, dtype=BFLOAT16),
    Case(1, 32, 1, 8192, 128, dtype=BFLOAT16, kvcache=True, quick=True),
)


def bfloat16_dtype():
    """ml_dtypes.bfloat16 as a NumPy dtype, or None without ml_dtypes."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(name):
    """The NumPy dtype called ``name``, bfloat16 included (needs ml_dtypes)."""
    if name == BFLOAT16:
        dtype = bfloat16_dtype()
        if dtype is None:
            raise ImportError("bfloat16 cases need ml_dtypes: pip install ml_dtypes")
        return dtype
    return np.dtype(name)


def make_inputs(case):
    """Standard-normal q, k, v for ``case``; the same arrays on every call
    (bfloat16: float32 draws rounded to bfloat16)."""
    rng = np.random.default_rng(0)
    dtype = numpy_dtype(case.dtype)
    draw = np.float32 if case.dtype == BFLOAT16 else dtype
    q_shape = (case.batch, case.heads, case.n_queries, case.dim)
    kv_shape = (case.batch, case.n_kv_heads, case.n_keys, case.dim)
    q = rng.standard_normal(q_shape, dtype=draw).astype(dtype, copy=False)
    k, v = (rng.standard_normal(kv_shape, dtype=draw).astype(numpy_dtype(case.kv_type))
            for _ in range(2))
    return q, k, v


def full_heads(case, x):
    """K or V with each head repeated for its query heads, in q's dtype (what
    peers without grouped-query support or float16 need)."""
    group = case.heads // case.n_kv_heads
    x = x.astype(numpy_dtype(case.dtype), copy=False)
    return np.repeat(x, group, axis=-3) if group > 1 else x


def visible_mask(n_queries, n_keys, window=0):
    """Bool (T, S): query i sees key j iff j <= i + S - T (bottom-right) and,
    with a window, j >= i + S - T - window."""
    visible = np.tri(n_queries, n_keys, n_keys - n_queries, dtype=bool)
    if window:
        visible &= ~np.tri(n_queries, n_keys, n_keys - n_queries - window - 1, dtype=bool)
    return visible


# ---------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------

def numpy_attention(q, k, v, causal, scale):
    """Plain attention in the inputs' dtype; returns (ATTN, weights)."""
    weights = q @ np.swapaxes(k, -1, -2)
    weights *= weights.dtype.type(scale)
    if causal:
        np.copyto(weights, -np.inf, where=~visible_mask(*weights.shape[-2:]))
    weights -= weights.max(axis=-1, keepdims=True)
    np.exp(weights, out=weights)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v, weights


def reference_attention(q, k, v, causal, scale):
    """float64 ATTN, one (batch, head) slice at a time to bound memory (K/V
    with as many heads as q)."""
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=np.float64)
    for index in np.ndindex(q.shape[:-2]):
        out[index], _ = numpy_attention(q64[index], k64[index], v64[index], causal, scale)
    return out


def _import_torch():
    """torch, or None when it is not installed (tests monkeypatch this)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def build_implementations(case, q, k, v, threads, torch, notes=None):
    """{name: callable() -> ATTN} for the implementations that run on ``case``.

    Conversions (torch views, masks) happen here, outside the timed calls.
    A peer that is installed but cannot take the case (onnxruntime without
    bfloat16 kernels) is left out with its reason in ``notes`` ({name: why}).
    """
    scale = 1.0 / math.sqrt(case.dim)
    impls = {CATTENTION: cattention_call(case, q, k, v, threads)}
    if case.dtype == BFLOAT16:
        # the same values in float32: what a runtime without bfloat16 support
        # computes after upcasting (issue 41's "our own float32")
        impls[CATTENTION_F32] = cattention_call(
            case, *(a.astype(np.float32) for a in (q, k, v)), threads)
        if not case.kvcache:
            impls[CATTENTION_MEDIUM] = cattention_call(case, q, k, v, threads, "medium")
    elif case.materialise:
        causal = case.causal
        gqa = case.n_kv_heads != case.heads
        impls[CATTENTION_SCORES] = lambda: attention(
            q, k, v, causal=causal, scale=scale, return_scores=True, enable_gqa=gqa,
            num_threads=threads)[0]
        # NumPy has no grouping or float16 arithmetic: it repeats and converts
        # K/V inside the timed call, as a NumPy user would
        impls[NUMPY] = lambda: numpy_attention(q, full_heads(case, k), full_heads(case, v),
                                               causal, scale)[0]
    if torch is not None:
        impls.update(_torch_implementations(case, q, k, v, scale, torch))
    impls.update(_runtime_implementations(case, q, k, v, scale, threads,
                                          {} if notes is None else notes))
    return impls


def cattention_call(case, q, k, v, threads, precision=None):
    """callable() -> ATTN: ``attention`` on the case (at ``precision``), or
    for a KV-cache case
    one decode step of ``attention_with_kvcache``: the cache (k, v) holds
    S - 1 keys and the call appends the last row (the values already there,
    so the cache is the same after every call) and attends to all S."""
    scale = 1.0 / math.sqrt(case.dim)
    if case.kvcache:
        k_new, v_new = k[..., -1:, :].copy(), v[..., -1:, :].copy()
        held = case.n_keys - 1
        # the call advances the lengths in place: a fresh array each step
        return lambda: attention_with_kvcache(
            q, k, v, np.full(case.batch, held), k_new, v_new, scale=scale,
            enable_gqa=case.n_kv_heads != case.heads, num_threads=threads)
    window = (case.window, 0) if case.window else None
    return lambda: attention(q, k, v, causal=case.causal, scale=scale,
                             enable_gqa=case.n_kv_heads != case.heads, window=window,
                             precision=precision, num_threads=threads)


class NotRun(Exception):
    """A peer that is installed but cannot run a case; the message says why
    (shown in the peer's row)."""


def _runtime_implementations(case, q, k, v, scale, threads, notes):
    """onnxruntime's Attention operator (ONNX opset 23) and OpenVINO's
    ScaledDotProductAttention (opset 13), each a one-operator graph compiled
    for ``threads`` threads, where installed and where they express the case:
    both align a causal mask top-left, so causal cases need T == S; sliding
    windows are left out (neither has them without a full mask). A float16
    cache is cast to float32 inside the graph, as their users do. OpenVINO's
    CPU plugin has no float64 precision, so float64 cases leave it out.

    bfloat16: OpenVINO takes the bfloat16 tensors and computes with a bf16
    inference precision; onnxruntime runs whichever of its CPU provider's
    Attention (opset 23) and com.microsoft MultiHeadAttention takes
    bfloat16, and where neither does its reason goes into ``notes``."""
    impls = {}
    if case.window or (case.causal and case.n_queries != case.n_keys):
        return impls
    try:
        if case.dtype == BFLOAT16:
            impls[ONNXRUNTIME] = _onnxruntime_bfloat16(case, q, k, v, threads)
        else:
            impls[ONNXRUNTIME] = _onnxruntime_attention(case, q, k, v, scale, threads)
    except ImportError:
        pass
    except NotRun as why:
        notes[ONNXRUNTIME] = str(why)
    if case.dtype != "float64":  # OpenVINO's CPU plugin computes in f32 at most
        try:
            impls[OPENVINO] = _openvino_attention(case, q, k, v, scale, threads)
        except ImportError:
            pass
    return impls


#: The onnxruntime operators tried for bfloat16, in order.
ORT_BFLOAT16_OPERATORS = ("Attention", "MultiHeadAttention")


def _onnxruntime_bfloat16(case, q, k, v, threads):
    """The first of :data:`ORT_BFLOAT16_OPERATORS` that onnxruntime's CPU
    provider runs in bfloat16 (:func:`onnxruntime_runner`); NotRun if none.

    onnxruntime 1.32 has neither: Attention is expanded into its ONNX
    function, whose Expand has no bfloat16 CPU kernel, and MultiHeadAttention
    has no bfloat16 CPU kernel (nor have MatMul and Softmax)."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    for op in ORT_BFLOAT16_OPERATORS:
        try:
            return onnxruntime_runner(case, q, k, v, threads, op)
        except OrtNotImplemented:
            pass
    raise NotRun(f"onnxruntime {ort.__version__}'s CPU provider has no bfloat16 Attention "
                 "(opset 23) or com.microsoft MultiHeadAttention kernel")


def onnxruntime_runner(case, q, k, v, threads, op="Attention"):
    """callable() -> ATTN: one ONNX ``op`` node on onnxruntime's CPU
    provider, inputs and output bound once through I/O binding (the way a
    bfloat16 tensor reaches onnxruntime from NumPy: its Python layer
    converts no bfloat16 array, either way). ``op`` is "Attention" (opset
    23; q, k and v as (B, H, T, d)) or "MultiHeadAttention" (com.microsoft;
    q as (B, T, H*d), made here, K and V as (B, H, S, d)); q, k and v of one
    dtype. Raises onnxruntime's NotImplemented where the provider has no
    kernel for the dtype."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
            BFLOAT16: TensorProto.BFLOAT16}[case.dtype]
    stored = np.uint16 if case.dtype == BFLOAT16 else q.dtype  # the bits as NumPy holds them
    batch, heads, n_queries, _ = q.shape
    d_v = v.shape[-1]
    scale = 1.0 / math.sqrt(case.dim)
    if op == "Attention":
        node = helper.make_node("Attention", ["q", "k", "v"], ["out"], scale=scale,
                                is_causal=int(case.causal))
        opsets = [helper.make_opsetid("", 23)]
        query, out_shape = q, (batch, heads, n_queries, d_v)
    elif op == "MultiHeadAttention":
        node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["out"],
                                domain="com.microsoft", num_heads=heads, scale=scale,
                                unidirectional=int(case.causal))
        opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
        query = q.transpose(0, 2, 1, 3).reshape(batch, n_queries, -1)
        out_shape = (batch, n_queries, heads * d_v)
    else:
        raise ValueError(f"unknown operator {op!r}")
    feeds = {name: np.ascontiguousarray(a).view(stored)
             for name, a in (("q", query), ("k", k), ("v", v))}
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(name, elem, a.shape) for name, a in feeds.items()],
        [helper.make_tensor_value_info("out", elem, None)])
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    out = np.empty(out_shape, dtype=stored)
    binding = session.io_binding()
    # the OrtValues hold their arrays; the binding holds only the tensors
    values = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, elem)
              for name, a in feeds.items()}
    values["out"] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, elem)
    for name in feeds:
        binding.bind_ortvalue_input(name, values[name])
    binding.bind_ortvalue_output("out", values["out"])
    result = out.view(q.dtype)
    if op == "MultiHeadAttention":
        result = result.reshape(batch, n_queries, heads, d_v).transpose(0, 2, 1, 3)

    def run():
        session.run_with_iobinding(binding)
        return result

    run.bound = values
    return run


def _onnxruntime_attention(case, q, k, v, scale, threads):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    types = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE,
             "float16": TensorProto.FLOAT16}
    nodes, key, value = [], "k", "v"
    if case.kv_type != case.dtype:
        nodes += [helper.make_node("Cast", ["k"], ["k_q"], to=types[case.dtype]),
                  helper.make_node("Cast", ["v"], ["v_q"], to=types[case.dtype])]
        key, value = "k_q", "v_q"
    nodes.append(helper.make_node("Attention", ["q", key, value], ["out"], scale=scale,
                                  is_causal=int(case.causal)))
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("q", types[case.dtype], q.shape),
         helper.make_tensor_value_info("k", types[case.kv_type], k.shape),
         helper.make_tensor_value_info("v", types[case.kv_type], v.shape)],
        [helper.make_tensor_value_info("out", types[case.dtype], None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = {"q": q, "k": k, "v": v}
    del onnx
    return lambda: session.run(None, feeds)[0]


def _openvino_attention(case, q, k, v, scale, threads):
    import openvino as ov
    from openvino import opset13

    types = {"float32": ov.Type.f32, "float64": ov.Type.f64, "float16": ov.Type.f16,
             BFLOAT16: ov.Type.bf16}
    bfloat16 = case.dtype == BFLOAT16
    group = case.heads // case.n_kv_heads
    q_in = opset13.parameter(list(q.shape), types[case.dtype], name="q")
    k_in = opset13.parameter(list(k.shape), types[case.kv_type], name="k")
    v_in = opset13.parameter(list(v.shape), types[case.kv_type], name="v")
    query, key, value = q_in, k_in, v_in
    if case.kv_type != case.dtype:
        key = opset13.convert(key, types[case.dtype])
        value = opset13.convert(value, types[case.dtype])
    if group > 1:  # grouped heads by broadcasting: (B, H_kv, G, T, d) against (B, H_kv, 1, S, d)
        b, h, t, d = q.shape
        query = opset13.reshape(query, [b, case.n_kv_heads, group, t, d], False)
        key = opset13.unsqueeze(key, 2)
        value = opset13.unsqueeze(value, 2)
    # bfloat16: no scale input (a bf16 constant would round 1/sqrt(d) for
    # d = 128); the operator's default is the same 1/sqrt(d)
    scale_input = ({} if bfloat16
                   else {"scale": opset13.constant(np.array(scale, dtype=q.dtype))})
    out = opset13.scaled_dot_product_attention(query, key, value, causal=case.causal,
                                               **scale_input)
    if group > 1:
        out = opset13.reshape(out, list(q.shape[:-1]) + [v.shape[-1]], False)
    model = ov.Model([out], [q_in, k_in, v_in], "attention")
    # f32 precision, not the bf16/f16 an AVX-512 or AMX CPU would pick; bf16
    # for bfloat16 inputs
    compiled = ov.Core().compile_model(model, "CPU", {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "bf16" if bfloat16 else "f32"})
    request = compiled.create_infer_request()
    if not bfloat16:
        return lambda: request.infer([q, k, v])[0]
    # OpenVINO's Python layer holds bfloat16 as 16-bit words (its arrays say
    # float16): the tensors wrap the bits, and the output's bits are viewed
    # as bfloat16
    feeds = [ov.Tensor(np.ascontiguousarray(a).view(np.uint16), list(a.shape), ov.Type.bf16)
             for a in (q, k, v)]
    return lambda: request.infer(feeds)[0].view(np.uint16).view(q.dtype)


def _torch_implementations(case, q, k, v, scale, torch):
    import torch.nn.functional as F

    tq, tk, tv = (torch_tensor(a, torch) for a in (q, k, v))
    T, S = case.n_queries, case.n_keys
    sdpa_kwargs = {"scale": scale}
    if case.n_kv_heads != case.heads:
        sdpa_kwargs["enable_gqa"] = True
    # SDPA needs one dtype: a float16 cache is converted in the timed call
    to_q_dtype = (lambda t: t.to(tq.dtype)) if case.kv_type != case.dtype else (lambda t: t)
    if case.window:  # PyTorch has no windows: the mask is materialised
        sdpa_kwargs["attn_mask"] = torch.from_numpy(visible_mask(T, S, case.window))
    elif case.causal and T == S:
        sdpa_kwargs["is_causal"] = True
    elif case.causal:  # bottom-right alignment, as cattention
        from torch.nn.attention.bias import causal_lower_right
        sdpa_kwargs["attn_mask"] = causal_lower_right(T, S)
    hidden = torch.from_numpy(~visible_mask(T, S, case.window)) if case.causal else None

    def sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, to_q_dtype(tk), to_q_dtype(tv),
                                                  **sdpa_kwargs)

    group = case.heads // case.n_kv_heads

    def explicit():
        with torch.no_grad():
            k_full, v_full = to_q_dtype(tk), to_q_dtype(tv)
            if group > 1:
                k_full = k_full.repeat_interleave(group, dim=-3)
                v_full = v_full.repeat_interleave(group, dim=-3)
            logits = torch.matmul(tq, k_full.transpose(-1, -2)) * scale
            if hidden is not None:
                logits.masked_fill_(hidden, float("-inf"))
            weights = torch.softmax(logits, dim=-1)
            return torch.matmul(weights, v_full), weights

    impls = {TORCH_SDPA: sdpa}
    if case.materialise and case.dtype != BFLOAT16:
        impls[TORCH_EXPLICIT] = lambda: explicit()[0]
    return impls


def torch_tensor(a, torch):
    """A torch tensor sharing ``a``'s memory (bfloat16: its bits viewed as
    torch.bfloat16; torch.from_numpy takes no ml_dtypes array)."""
    if a.dtype.name == BFLOAT16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


#: Implementations that also return the attention weights.
RETURNS_WEIGHTS = (CATTENTION_SCORES, NUMPY, TORCH_EXPLICIT)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

#: After a settle pause the cores have idled: keep every core the next call
#: uses busy for this long before it is timed, so that it does not pay for
#: waking up (``--wake``). One core costs tens of microseconds (the whole of
#: a tiny call); on a virtual machine an idle second core took 5-10 ms to
#: join a parallel region, more than a whole decode step, and on another
#: (an Intel Xeon with AMX under KVM) a 2-thread call after a 0.25 s pause
#: ran at one thread's speed until the cores had been busy for about
#: 100 ms: 17.4 ms median after 5 ms awake, 10.8 after 50, 9.1 after 100,
#: 8.5 after 200, 8.1-8.8 back to back.
WAKE_SECONDS = 0.1


def _busy_wait(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wake_cores(n_cores, seconds=WAKE_SECONDS):
    """Keep ``n_cores`` cores busy for ``seconds``: this thread spins, and
    n_cores - 1 others run NumPy additions, which release the GIL, so each
    keeps a core of its own busy whatever library runs next."""
    end = time.perf_counter() + seconds

    def spin():
        a = np.ones(1 << 16, dtype=np.float32)
        b = np.empty_like(a)
        while time.perf_counter() < end:
            np.add(a, a, out=b)

    helpers = [threading.Thread(target=spin) for _ in range(n_cores - 1)]
    for helper in helpers:
        helper.start()
    _busy_wait(seconds)
    for helper in helpers:
        helper.join()


def time_round_robin(impls, rounds, settle=None, repeats=1, threads=1, wake=WAKE_SECONDS):
    """{name: [seconds]}: in every round each implementation runs once
    (``repeats`` calls back to back, timed together, for calls too short to
    time one by one).

    The starting implementation rotates from round to round. Freeing a
    result is not timed. ``settle`` maps names to an untimed pause after
    each of their calls (see :data:`BLAS_SETTLE_SECONDS`), after which
    ``threads`` cores are kept busy for ``wake`` seconds (:func:`_wake_cores`).
    """
    settle = settle or {}
    names = list(impls)
    times = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            t0 = time.perf_counter()
            for _ in range(repeats):
                result = impls[name]()
            times[name].append((time.perf_counter() - t0) / repeats)
            del result
            if name in settle:
                time.sleep(settle[name])
                _wake_cores(threads, wake)
    return times


def _cpu_counters():
    """(busy CPU seconds of the whole machine, CPU seconds of this process)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    own = os.times()
    return ((user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system)


def background_cores(before, after, seconds):
    """Mean number of cores that other processes kept busy between two
    :func:`_cpu_counters` readings, or None if unknown or too short to tell."""
    if before is None or after is None or seconds < 0.25:
        return None
    busy = after[0] - before[0]
    own = after[1] - before[1]
    return max(0.0, (busy - own) / seconds)


#: Cases during whose timed rounds other processes kept at least this many
#: cores busy on average are flagged in the table.
BACKGROUND_FLAG = 0.1


def relative_spread(times):
    """Interquartile range over the median: how noisy the timings were."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


def _as_numpy(result):
    if hasattr(result, "numpy"):  # a torch tensor
        if str(result.dtype) == "torch.bfloat16":  # which .numpy() refuses
            import torch
            return result.view(torch.int16).numpy().view(bfloat16_dtype())
        return result.numpy()
    return np.asarray(result)


def measure_dram_bandwidth(threads, n_elements, rounds=PROBE_ROUNDS):
    """Record for ``np.dot`` of two float32 vectors: GB/s of the bytes read."""
    a = np.ones(n_elements, dtype=np.float32)
    b = np.ones(n_elements, dtype=np.float32)
    times = time_round_robin({PROBE: lambda: np.dot(a, b)}, rounds + 1)[PROBE][1:]
    time.sleep(BLAS_SETTLE_SECONDS if threads > 1 else 0)
    median = statistics.median(times)
    nbytes = a.nbytes + b.nbytes
    return {
        "case": f"DRAM probe: dot 2x{n_elements / 2**20:g}M",
        "kind": "probe",
        "dtype": "float32",
        "threads": threads,
        "impl": PROBE,
        "bytes": nbytes,
        "median_ms": median * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "spread": relative_spread(times),
        "gbps": nbytes / median / 1e9,
    }


def measure_gemm_rate(threads, size, rounds=PROBE_ROUNDS):
    """Record for ``a @ b`` of two ``size`` x ``size`` float32 matrices: the
    GFLOP/s of the fastest round (a peak rate: in a 2-thread pass the
    median of the same rounds was as low as 0.6x a run alone, after the
    peers of the pass before)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    time.sleep(BLAS_SETTLE_SECONDS if threads > 1 else 0)
    times = time_round_robin({GEMM_PROBE: lambda: a @ b}, rounds + 1)[GEMM_PROBE][1:]
    time.sleep(BLAS_SETTLE_SECONDS if threads > 1 else 0)
    fastest = min(times)
    return {
        "case": f"GEMM probe: {size}^3",
        "kind": "probe",
        "dtype": "float32",
        "threads": threads,
        "impl": GEMM_PROBE,
        "median_ms": statistics.median(times) * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "spread": relative_spread(times),
        "gflops": 2.0 * size**3 / fastest / 1e9,
        "gbps": None,
    }


#: Process CPU seconds per thread of a round of the multiply-add loop, and
#: its rounds (the fastest is kept).
LOOP_SECONDS = 0.1
LOOP_ROUNDS = 3
#: The table whose multiply-add loop bounds float32 calls made on a table
#: whose own loop is another: the AMX table's tiles take bfloat16 only, and
#: it multiplies float32 with the AVX-512 FMA kernels.
FLOAT32_TABLE = {"amx": "avx512"}
#: What a table's loop_flops runs (the vector FMA loop unless listed).
LOOP_KINDS = {"amx": "AMX tile", "baseline": "plain C"}


def loop_table(table, compute_dtype):
    """The kernel table whose multiply-add loop bounds a call computed in
    ``compute_dtype`` (bfloat16 or float32) on ``table``: bfloat16 calls run
    on the table itself, float32 calls on its float32 kernels' table."""
    return table if compute_dtype == BFLOAT16 else FLOAT32_TABLE.get(table, table)


def _run_loop(steps, threads):
    """(flops, process CPU seconds) of ``threads`` Python threads each
    running ``driver.loop_flops(steps)`` at once (it releases the GIL)."""
    if threads == 1:
        t0 = time.process_time()
        flops = driver.loop_flops(steps)
        return flops, time.process_time() - t0
    start = threading.Barrier(threads)
    done = []

    def work():
        start.wait()
        done.append(driver.loop_flops(steps))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.process_time()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done), time.process_time() - t0


def measure_loop_rate(table, threads, seconds=LOOP_SECONDS, rounds=LOOP_ROUNDS):
    """Record for kernel table ``table``'s fastest multiply-add loop
    (``driver.loop_flops``: vector FMAs, or AMX tile products): the GFLOP/s
    no kernel of the table can pass on ``threads`` cores.

    Timed in process CPU time (``time.process_time``), so that time slices
    other processes take on a loaded machine do not count. With several
    threads, that many Python threads run the loop at once and the rate is
    ``threads`` x flops / CPU seconds: the rate of that many cores busy
    together, measured, not twice one core's (two hyperthreads of one core
    would show as one core). Rounds of about ``seconds`` CPU seconds per
    thread; the fastest round is kept (a peak, as the GEMM probe's)."""
    previous = driver.get_simd()
    driver.set_simd(table)
    try:
        steps = 1 << 10
        flops, cpu = _run_loop(steps, 1)
        while cpu < seconds / 10:  # calibrate on one thread
            steps *= 4
            flops, cpu = _run_loop(steps, 1)
        steps = max(1, round(steps * seconds / cpu))
        rates, per_thread = [], []
        for _ in range(rounds):
            flops, cpu = _run_loop(steps, threads)
            rates.append(threads * flops / cpu / 1e9)
            per_thread.append(cpu / threads)
    finally:
        driver.set_simd(previous)
    kind = LOOP_KINDS.get(table, "FMA")
    return {
        "case": f"{kind} loop: {table} table",
        "kind": "probe",
        "dtype": BFLOAT16 if table == "amx" else "float32",
        "threads": threads,
        "simd": table,
        "impl": LOOP_PROBE,
        "clock": "process_time",
        "median_ms": statistics.median(per_thread) * 1e3,
        "times_ms": [t * 1e3 for t in per_thread],
        "spread": relative_spread(per_thread),
        "gflops": max(rates),
        "gbps": None,
    }


@contextlib.contextmanager
def thread_limits(threads, torch):
    """Limit NumPy's BLAS and torch to ``threads`` (restored afterwards)."""
    with contextlib.ExitStack() as stack:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            pass
        else:
            stack.enter_context(threadpool_limits(limits=threads, user_api="blas"))
        if torch is not None:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            stack.callback(torch.set_num_threads, previous)
        yield


def benchmark_case(case, threads, rounds, torch, reference=None, wake=WAKE_SECONDS):
    """Records (one per implementation) for ``case`` at ``threads`` threads.

    ``reference`` is the float64 ATTN (or None to skip the error column);
    ``wake`` the seconds the cores are kept busy after each settle pause.
    """
    q, k, v = make_inputs(case)
    notes = {}
    impls = build_implementations(case, q, k, v, threads, torch, notes)
    # with several threads, pause after the peers whose idle workers spin
    # (OpenBLAS, PyTorch's OpenMP) so they do not slow whatever runs next
    settle = ({name: BLAS_SETTLE_SECONDS
               for name in (NUMPY, TORCH_SDPA, TORCH_EXPLICIT, ONNXRUNTIME, OPENVINO)
               if name in impls} if threads > 1 else {})
    errors = {}
    for name, fn in impls.items():  # warm-up, and the output for the error
        out = _as_numpy(fn())
        if reference is not None:
            errors[name] = float(np.max(np.abs(out.astype(np.float64) - reference),
                                        initial=0.0))
        del out
    if threads > 1:  # after NumPy and the reference
        time.sleep(BLAS_SETTLE_SECONDS)
        _wake_cores(threads, wake)
    counters, t0 = _cpu_counters(), time.perf_counter()
    # microsecond calls are timed in runs: one call alone measures the timer
    # and whatever the previous implementation left in the caches
    repeats = TINY_REPEATS if case.score_elements <= TINY_ELEMENTS else 1
    times = time_round_robin(impls, rounds, settle, repeats, threads, wake)
    background = background_cores(counters, _cpu_counters(), time.perf_counter() - t0)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    records = []
    for name, ts in times.items():
        median = medians[name]
        record = {
            "case": case.name,
            "kind": "decode" if case.is_decode else "attention",
            "shape": [case.batch, case.heads, case.n_queries, case.n_keys, case.dim],
            "causal": case.causal,
            "dtype": case.dtype,
            "threads": threads,
            "impl": name,
            "median_ms": median * 1e3,
            "times_ms": [t * 1e3 for t in ts],
            "spread": relative_spread(ts),
            "gflops": case.flops / median / 1e9,
            # cattention-f32 reads a float32 copy of the K/V
            "gbps": (case.kv_bytes("float32" if name == CATTENTION_F32 else None)
                     / median / 1e9 if case.is_decode else None),
            "vs_ca": median / medians[CATTENTION],
            "vs_ca_scores": (median / medians[CATTENTION_SCORES]
                             if name in RETURNS_WEIGHTS and CATTENTION_SCORES in medians
                             else None),
            "max_abs_err": errors.get(name),
            "background_cores": background,
        }
        records.append(record)
    for name, note in notes.items():  # installed, but not able to run the case
        records.append({
            "case": case.name, "kind": "decode" if case.is_decode else "attention",
            "shape": [case.batch, case.heads, case.n_queries, case.n_keys, case.dim],
            "causal": case.causal, "dtype": case.dtype, "threads": threads, "impl": name,
            "median_ms": None, "times_ms": [], "spread": None, "gflops": None, "gbps": None,
            "vs_ca": None, "vs_ca_scores": None, "max_abs_err": None,
            "background_cores": background, "note": note})
    return records


def compute_dtype(case, impl):
    """The dtype cattention's kernels multiply in for ``impl`` on ``case``
    (float16 caches are widened to float32), or None for a peer."""
    if impl == CATTENTION_F32:
        return "float32"
    if impl not in (CATTENTION, CATTENTION_SCORES, CATTENTION_MEDIUM):
        return None
    return case.dtype if case.dtype in ("float64", BFLOAT16) else "float32"


def run_benchmark(cases=DEFAULT_CASES, threads=DEFAULT_THREADS, rounds=DEFAULT_ROUNDS,
                  probe_elements=None, on_records=None, gemm_size=None, wake=WAKE_SECONDS,
                  simd=None, loop_seconds=None):
    """Run every case at every thread count; returns the list of records.

    One pass per thread count and kernel table (``simd``: names from
    ``driver.available_simd()``; default: the table in use, as chosen at
    import or by CATTENTION_SIMD); the table in use is restored at the end.
    Each thread count starts with the DRAM probe of ``probe_elements``
    float32 elements per vector (default ``PROBE_ELEMENTS``; 0 skips it),
    whose GB/s is attached to decode records as ``probe_fraction``, and the
    GEMM probe of order ``gemm_size`` (default ``GEMM_SIZE``; 0 skips it),
    whose GFLOP/s is attached to the other float32 records as
    ``gemm_fraction``. Each table starts with the multiply-add loops its
    calls run on (:func:`measure_loop_rate`, rounds of ``loop_seconds``,
    default :data:`LOOP_SECONDS`; 0 skips them): cattention's records other
    than decode and float64 get ``loop_fraction``, their GFLOP/s over the
    loop of ``loop_table`` (:func:`loop_table`). ``on_records(records)`` is
    called as each case (and probe) completes, for progressive output. In
    passes of more than one thread the cores are kept busy for ``wake``
    seconds after each settle pause (default :data:`WAKE_SECONDS`).
    """
    if probe_elements is None:
        probe_elements = PROBE_ELEMENTS
    if gemm_size is None:
        gemm_size = GEMM_SIZE
    if loop_seconds is None:
        loop_seconds = LOOP_SECONDS
    in_use = driver.get_simd()
    tables = list(simd) if simd else [in_use]
    torch = _import_torch()
    references = {}
    loops = {}  # (table, threads): loop record
    records = []

    def emit(new):
        records.extend(new)
        if on_records is not None:
            on_records(new)

    try:
        for n in threads:
            with thread_limits(n, torch):
                probe = measure_dram_bandwidth(n, probe_elements) if probe_elements else None
                if probe is not None:
                    emit([probe])
                gemm = measure_gemm_rate(n, gemm_size) if gemm_size else None
                if gemm is not None:
                    emit([gemm])
                for table in tables:
                    driver.set_simd(table)
                    for needed in dict.fromkeys((loop_table(table, "float32"),
                                                 loop_table(table, BFLOAT16))):
                        if loop_seconds and (needed, n) not in loops:
                            loops[needed, n] = measure_loop_rate(needed, n, loop_seconds)
                            emit([loops[needed, n]])
                    for case in cases:
                        if case not in references:
                            references[case] = _reference(case)
                        new = benchmark_case(case, n, rounds, torch, references[case], wake)
                        used = driver.get_simd()  # the table the calls ran on
                        for record in new:
                            _attach_fractions(record, case, used, probe, gemm, loops)
                        emit(new)
    finally:
        driver.set_simd(in_use)
    return records


def _reference(case):
    """float64 ATTN of ``case`` (None where too large or windowed)."""
    if case.score_elements > REFERENCE_LIMIT or case.window:
        return None
    q, k, v = make_inputs(case)
    return reference_attention(q, full_heads(case, k), full_heads(case, v), case.causal,
                               1.0 / math.sqrt(case.dim))


def _attach_fractions(record, case, table, probe, gemm, loops):
    """Add the kernel table and the shares of the probes and loops to a
    record of ``case`` run on ``table``."""
    record["simd"] = table
    if record["median_ms"] is None:  # a note
        return
    if record["gbps"] is not None and probe is not None:
        record["probe_fraction"] = record["gbps"] / probe["gbps"]
    elif record["gbps"] is None and record["dtype"] == "float32" and gemm is not None:
        record["gemm_fraction"] = record["gflops"] / gemm["gflops"]
    dtype = compute_dtype(case, record["impl"])
    if record["gbps"] is None and dtype in ("float32", BFLOAT16):
        loop = loops.get((loop_table(table, dtype), record["threads"]))
        if loop is not None:
            record["loop_table"] = loop["simd"]
            record["loop_fraction"] = record["gflops"] / loop["gflops"]


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    import cattention

    def status_kib(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])

    B, H, T, S, d, threads = map(int, sys.argv[1:7])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, T, d), dtype=np.float32)
    k = rng.standard_normal((B, H, S, d), dtype=np.float32)
    v = rng.standard_normal((B, H, S, d), dtype=np.float32)
    # start the OpenMP thread pool before the baseline
    cattention.attention(q[..., :256, :], k[..., :256, :], v[..., :256, :],
                         causal=True, num_threads=threads)
    try:  # reset VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    rss_before = status_kib("VmRSS")
    hwm_before = status_kib("VmHWM")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = cattention.attention(q, k, v, causal=True, num_threads=threads)
    seconds = time.perf_counter() - t0
    print(json.dumps({
        "hwm_reset": reset, "rss_before_kib": rss_before, "hwm_before_kib": hwm_before,
        "hwm_after_kib": status_kib("VmHWM"), "maxrss_before_kib": maxrss_before,
        "maxrss_after_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "seconds": seconds, "output_bytes": out.nbytes}))
""")


def measure_memory(shape=MEMORY_SHAPE, threads=1):
    """Peak RSS increase of one causal call without SCORES, in a fresh process.

    The inputs are allocated and the thread pool started first; then the
    peak is read just before and just after the call, so the increase is the
    call's own: its output plus scratch. The peak is the process's VmHWM,
    reset to the current RSS just before the call. ``ru_maxrss`` (also
    recorded) cannot serve here: a child started by vfork + exec, as
    ``subprocess`` does, inherits the parent's peak as its ``ru_maxrss``,
    which in a benchmark process holding large arrays hides the call's peak.
    """
    args = [str(x) for x in (*shape, threads)]
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, *args],
                          capture_output=True, text=True, check=True)
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    if raw["hwm_reset"]:
        increase_kib = raw["hwm_after_kib"] - raw["rss_before_kib"]
        method = "VmHWM reset before the call"
    else:
        increase_kib = raw["maxrss_after_kib"] - raw["maxrss_before_kib"]
        method = "ru_maxrss (VmHWM could not be reset)"
    B, H, T, S, d = shape
    return {
        "case": f"{B}x{H}x{T}x{S}x{d} causal",
        "dtype": "float32",
        "threads": threads,
        "seconds": raw["seconds"],
        "peak_rss_increase_mib": increase_kib / 1024,
        "method": method,
        "rss_before_mib": raw["rss_before_kib"] / 1024,
        "ru_maxrss_before_mib": raw["maxrss_before_kib"] / 1024,
        "ru_maxrss_after_mib": raw["maxrss_after_kib"] / 1024,
        "output_mib": raw["output_bytes"] / 2**20,
        "scores_would_be_mib": B * H * T * S * 4 / 2**20,
    }


# ---------------------------------------------------------------------------
# Machine description and output
# ---------------------------------------------------------------------------

def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _torch_kernels(torch):
    """The instruction set of PyTorch's CPU kernels ("AVX512", "AVX2", ...;
    ATEN_CPU_CAPABILITY lowers it), or None without torch."""
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def machine_config(torch):
    """Dict describing the machine, libraries and environment."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        show_config()
    blas = "threadpoolctl not installed: NumPy's BLAS threads are not limited"
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        pass
    else:
        libs = [f"{i.get('internal_api')} {i.get('version')} "
                f"({i.get('architecture', '?')}, {i.get('threading_layer', '?')})"
                for i in threadpool_info() if i.get("user_api") == "blas"]
        blas = "; ".join(libs) or "none found"
    return {
        "cattention": buffer.getvalue().rstrip(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_kernels": _torch_kernels(torch),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS") or None,
        "blas": blas,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "openblas_env": {key: value for key, value in sorted(os.environ.items())
                         if key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
        "omp_env": {key: value for key, value in sorted(os.environ.items())
                    if key.startswith(("OMP_", "GOMP_"))},
    }


def format_config(config):
    openblas = config["openblas_env"]
    lines = [
        config["cattention"],
        f"machine: {config['cpu']} ({config['cpu_count']} CPUs), Python {config['python']}, "
        f"load average at start {config['load_average'][0]:.2f}",
        "torch:   " + (f"{config['torch']} ({config['torch_kernels']} kernels, matrix products "
                       + (f"MKL_ENABLE_INSTRUCTIONS={config['mkl_instructions']})"
                          if config.get("mkl_instructions") else "by MKL's own choice)")
                       if config["torch"] else "not installed (torch peers skipped)"),
        f"BLAS:    {config['blas']}",
        "env:     " + (", ".join(f"{k}={v}" for k, v in openblas.items())
                       + " set (OpenBLAS kernel/cache tuning overridden)"
                       if openblas else "OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE not set"),
    ]
    if config["omp_env"]:
        lines.append("         " + ", ".join(f"{k}={v}" for k, v in config["omp_env"].items()))
    return "\n".join(lines)


_COLUMNS = (("case", 28, "<"), ("dtype", 5, "<"), ("thr", 3, ">"), ("simd", 10, "<"),
            ("impl", 14, "<"), ("median ms", 10, ">"), ("iqr", 4, ">"),
            ("throughput", 23, "<"), ("of loop", 7, ">"), ("vs ca", 7, ">"),
            ("vs ca+S", 7, ">"), ("max err", 8, ">"))
#: The dtype column's short names.
_DTYPES = {"float16": "f16", "float32": "f32", "float64": "f64", BFLOAT16: "bf16"}


def _row(cells):
    return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS))


def table_header():
    header = _row([name for name, _, _ in _COLUMNS])
    return f"{header}\n{'-' * len(header)}"


def _throughput(record):
    if record["kind"] == "probe":
        if record["gbps"] is None:
            return f"{_number(record['gflops'])} GFLOP/s"
        return f"{record['gbps']:.1f} GB/s"
    if record["gbps"] is not None:
        fraction = record.get("probe_fraction")
        share = f" ({fraction:.0%} probe)" if fraction is not None else ""
        return f"{record['gbps']:.1f} GB/s{share}"
    fraction = record.get("gemm_fraction")
    share = f" ({fraction:.0%} gemm)" if fraction is not None else ""
    return f"{_number(record['gflops'])} GFLOP/s{share}"


def _number(x):
    """Compact: one decimal from 1 upwards, three significant digits below."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _share(fraction):
    """A share of a loop: whole percent, one decimal below 10 %."""
    return f"{fraction:.1%}" if fraction < 0.1 else f"{fraction:.0%}"


def _group(record):
    return record["case"], record["dtype"], record["threads"], record.get("simd")


def format_records(records):
    """Table rows; case, dtype, threads and table are shown on a group's
    first row. A peer that could not run the case says why."""
    lines = []
    for i, record in enumerate(records):
        first = i == 0 or _group(records[i - 1]) != _group(record)
        busy = (record.get("background_cores") or 0) >= BACKGROUND_FLAG
        head = [
            record["case"] + (" *" if busy else "") if first else "",
            _DTYPES.get(record["dtype"], record["dtype"]) if first else "",
            str(record["threads"]) if first else "",
            record.get("simd", "") if first else "",
            record["impl"],
        ]
        if record["median_ms"] is None:
            lines.append(f"{_row(head)} not run: {record.get('note', '')}")
            continue
        ratio = record.get("vs_ca")
        ratio_scores = record.get("vs_ca_scores")
        error = record.get("max_abs_err")
        share = record.get("loop_fraction")
        lines.append(_row(head + [
            f"{record['median_ms']:.2f}" if record["median_ms"] >= 1
            else f"{record['median_ms']:.3g}",
            f"{record['spread']:.0%}",
            _throughput(record),
            _share(share) if share is not None else "",
            f"{ratio:.2f}x" if ratio is not None else "",
            f"{ratio_scores:.2f}x" if ratio_scores is not None else "",
            f"{error:.1e}" if error is not None else "-",
        ]))
    return "\n".join(lines)


#: Generation loop: (heads, kv_heads, dim, tokens already cached, new tokens)
GENERATION_SHAPE = (32, 8, 128, 1024, 256)


def measure_generation(threads, shape=GENERATION_SHAPE, kv_dtype="float32"):
    """Tokens per second of a decode loop: one query per step against a KV
    cache that grows by one token per step.

    cattention appends into a preallocated cache with attention_with_kvcache;
    the NumPy baseline keeps its cache as arrays it concatenates every step
    and repeats the K/V heads for its query heads, as plain NumPy code must.
    """
    from cattention import attention_with_kvcache

    heads, kv_heads, dim, cached, steps = shape
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim)
    rng = np.random.default_rng(1)
    prefix = rng.standard_normal((2, 1, kv_heads, cached, dim), dtype=np.float32)
    step_q = rng.standard_normal((steps, 1, heads, 1, dim), dtype=np.float32)
    step_kv = rng.standard_normal((steps, 2, 1, kv_heads, 1, dim), dtype=np.float32)

    k_cache = np.zeros((1, kv_heads, cached + steps, dim), dtype=kv_dtype)
    v_cache = np.zeros_like(k_cache)
    k_cache[:, :, :cached] = prefix[0]
    v_cache[:, :, :cached] = prefix[1]
    lengths = np.array([cached])
    t0 = time.perf_counter()
    for t in range(steps):
        attention_with_kvcache(step_q[t], k_cache, v_cache, lengths, step_kv[t, 0],
                               step_kv[t, 1], num_threads=threads)
    ours = time.perf_counter() - t0

    k_np, v_np = prefix[0], prefix[1]
    t0 = time.perf_counter()
    for t in range(steps):
        k_np = np.concatenate([k_np, step_kv[t, 0]], axis=2)
        v_np = np.concatenate([v_np, step_kv[t, 1]], axis=2)
        numpy_attention(step_q[t], np.repeat(k_np, group, axis=1),
                        np.repeat(v_np, group, axis=1), False, scale)
    baseline = time.perf_counter() - t0
    return {"shape": list(shape), "kv_dtype": kv_dtype, "threads": threads,
            "cattention_tokens_per_s": steps / ours, "numpy_tokens_per_s": steps / baseline,
            "speedup": baseline / ours}


def format_generation(result):
    heads, kv_heads, dim, cached, steps = result["shape"]
    return (f"generation: {steps} tokens after {cached} cached, H={heads}, H_kv={kv_heads}, "
            f"d={dim}, {result['kv_dtype']} cache, {result['threads']} thread(s): cattention "
            f"{result['cattention_tokens_per_s']:.0f} tokens/s (attention_with_kvcache), NumPy "
            f"{result['numpy_tokens_per_s']:.0f} tokens/s (concatenating its cache), "
            f"{result['speedup']:.1f}x")


def format_memory(memory):
    extra = memory["peak_rss_increase_mib"] - memory["output_mib"]
    return (f"memory: {memory['case']} f32, no SCORES, {memory['threads']} thread(s), in a "
            f"fresh process: peak RSS +{memory['peak_rss_increase_mib']:.1f} MiB = output "
            f"{memory['output_mib']:.1f} MiB + {extra:.1f} MiB other (SCORES alone would be "
            f"{memory['scores_would_be_mib']:.0f} MiB); RSS before "
            f"{memory['rss_before_mib']:.0f} MiB; {memory['seconds']:.2f} s; "
            f"measured by {memory['method']}")


def plot_results(records, path):
    """GFLOP/s against sequence length for the d=64, T == S float32 cases."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install matplotlib)") from None
    selected = [r for r in records
                if r["kind"] == "attention" and r["dtype"] == "float32"
                and r["gflops"] is not None
                and r["shape"][4] == 64 and r["shape"][2] == r["shape"][3]
                and r["shape"][2] >= 256]
    impls = list(dict.fromkeys(r["impl"] for r in selected))
    thread_counts = sorted({r["threads"] for r in selected})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        for color, impl in enumerate(impls):
            for style, n in zip(styles, thread_counts):
                points = sorted((r["shape"][2], r["gflops"]) for r in selected
                                if r["impl"] == impl and r["threads"] == n
                                and r["causal"] == causal)
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, style, marker="o", color=f"C{color}",
                            label=f"{impl}, {n} thr")
        lengths = sorted({r["shape"][2] for r in selected if r["causal"] == causal})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("sequence length T = S (d = 64, float32)")
        ax.set_title("causal" if causal else "full")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GFLOP/s")
    labelled = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    fig.legend(labelled.values(), labelled.keys(), loc="lower center",
               ncol=len(impls), fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def add_arguments(parser):
    parser.add_argument("--threads", type=int, nargs="+", metavar="N",
                        help=f"thread counts, one pass each (default: "
                             f"{' and '.join(map(str, DEFAULT_THREADS))})")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help=f"timed rounds per case (default {DEFAULT_ROUNDS}, "
                             f"--quick {QUICK_ROUNDS})")
    parser.add_argument("--quick", action="store_true",
                        help="a small subset of cases, fewer rounds, no memory probe")
    parser.add_argument("--cases", metavar="SUBSTR[,SUBSTR]",
                        help="run only cases whose label (e.g. '1x8x1024x1024x64 "
                             "causal float32', 'decode', 'bfloat16', 'kvcache') contains "
                             "one of these")
    parser.add_argument("--simd", metavar="TABLE[,TABLE]",
                        help="run every case on each of these kernel tables (names as in "
                             "show_config(), or 'all' for every table this CPU runs; "
                             "default: the table in use, which CATTENTION_SIMD sets)")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="plot GFLOP/s against sequence length (needs matplotlib)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the memory probe")
    parser.add_argument("--wake", type=float, metavar="SECONDS", default=WAKE_SECONDS,
                        help="with several threads, keep the cores busy this long after "
                             "each peer's settle pause, before the next call is timed "
                             f"(default {WAKE_SECONDS:g}: idle cores of a virtual machine "
                             "can take 100 ms to reach full speed)")
    return parser


def parse_simd(value):
    """The kernel tables of ``--simd`` (None: the one in use), checked
    against those this CPU runs."""
    available = driver.available_simd()
    if not value:
        return [driver.get_simd()]
    if value.strip() == "all":
        return available
    tables = [name.strip() for name in value.split(",") if name.strip()]
    for name in tables:
        if name not in available:
            raise SystemExit(f"--simd: {name!r} is not a kernel table this CPU runs; "
                             f"available: {', '.join(available)} (or all)")
    return list(dict.fromkeys(tables))


def main(args=None):
    """Run the benchmark described by parsed ``args`` (default: the command
    line); returns an exit code."""
    if args is None or isinstance(args, list):
        import argparse
        parser = argparse.ArgumentParser(
            prog="python benchmarks/attention.py",
            description="Time cattention beside NumPy and PyTorch on a grid of attention "
                        "shapes, round-robin in one process.")
        args = add_arguments(parser).parse_args(args)
    started = time.perf_counter()
    patterns = [p.strip() for p in args.cases.split(",")] if args.cases else []
    cases = [c for c in DEFAULT_CASES if (c.quick or not args.quick) and c.matches(patterns)]
    threads = args.threads or list(DEFAULT_THREADS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    if any(n < 1 for n in threads) or rounds < 1:
        raise SystemExit("--threads and --rounds must be positive")
    if not args.wake >= 0:
        raise SystemExit("--wake must be 0 or more seconds")
    tables = parse_simd(args.simd)
    skipped = [c for c in cases if BFLOAT16 in (c.dtype, c.kv_type)]
    if skipped and bfloat16_dtype() is None:
        cases = [c for c in cases if c not in skipped]
        print(f"{len(skipped)} bfloat16 case(s) left out: ml_dtypes is not installed "
              "(pip install ml_dtypes)")

    torch = _import_torch()
    config = machine_config(torch)
    print(format_config(config))
    print()
    print(textwrap.fill(
        f"{len(cases)} cases x threads {threads} x kernel tables {tables}, {rounds} rounds "
        "round-robin; median times, iqr = interquartile range / median. 'vs ca' = peer "
        "time / cattention time (above 1: cattention is faster; for cattention-f32, "
        "float32 on the bfloat16 case's values, the bfloat16 speed-up); 'vs ca+S' the "
        "same against cattention+S, for the peers that also return the weights. 'of "
        "loop': cattention's GFLOP/s over the multiply-add loop of the table its kernels "
        "ran on (the loop_flops rows: process CPU time, with 2 threads two threads at "
        "once; float32 on the amx table runs the avx512 FMA kernels). max err: max abs "
        "error of ATTN against a float64 NumPy reference (bfloat16: of the upcast "
        "inputs).", width=100))
    print()
    print(table_header())

    def show(new):
        print(format_records(new), flush=True)

    counters, t0 = _cpu_counters(), time.perf_counter()
    records = run_benchmark(cases, threads, rounds, on_records=show, wake=args.wake,
                            simd=tables)
    background = background_cores(counters, _cpu_counters(), time.perf_counter() - t0)
    flagged = sum(1 for r in records if r["impl"] == CATTENTION
                  and (r.get("background_cores") or 0) >= BACKGROUND_FLAG)
    if background is not None:
        print()
        print(textwrap.fill(
            f"other processes kept {background:.2f} cores busy on average during the run"
            + (f"; * marks the {flagged} case(s) where they used {BACKGROUND_FLAG} cores "
               "or more during the timed rounds: those timings are suspect" if flagged else ""),
            width=100))

    generation = []
    if not args.quick and not patterns:
        print()
        for n in threads:
            with thread_limits(n, torch):
                for kv_dtype in ("float32", "float16"):
                    generation.append(measure_generation(n, kv_dtype=kv_dtype))
                    print(format_generation(generation[-1]), flush=True)

    memory_case = Case(*MEMORY_SHAPE, causal=True)
    memory = None
    if not args.quick and not args.no_memory and memory_case.matches(patterns):
        print()
        memory = measure_memory(MEMORY_SHAPE, threads=max(threads))
        print(format_memory(memory))

    elapsed = time.perf_counter() - started
    print()
    print(f"total {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config,
                       "settings": {"threads": threads, "rounds": rounds,
                                    "quick": args.quick, "cases": patterns,
                                    "wake_s": args.wake, "simd": tables},
                       "records": records, "memory": memory, "generation": generation,
                       "elapsed_s": elapsed,
                       "background_cores": background},
                      f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_results(records, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
