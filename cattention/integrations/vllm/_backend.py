"""The backend vLLM's V1 engine is given for ``CPU_ATTN``: its class (what
it serves, its cache layout), the metadata of a step (built once per step,
NumPy views of vLLM's tensors, shared by every layer) and the per-layer
implementation (the append at vLLM's slots, one paged call per step).

Every configuration the backend cannot serve is refused in ``__init__`` of
the implementation, which vLLM runs as it builds the model: at engine
start, never at the first request.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Optional

import numpy as np
import torch
from numpy.typing import NDArray
from vllm.logger import init_logger
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayer,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import AttentionSpec, CrossAttentionSpec, KVCacheLayout

import cattention

from ..._native import driver
from .._torch import as_array, as_fp8_array, as_index_array

logger = init_logger("vllm.cattention")  # under vLLM's logger, so its log shows it

_Array = NDArray[Any]
_ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
# vLLM's fp8 caches (bytes, uint8 tensors) as the ml_dtypes format they hold
_FP8_CACHES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
               "fp8_e5m2": "float8_e5m2"}


# (vLLM's classes are Any to mypy, which follows no vLLM import: pyproject.toml)
class CattentionBackend(AttentionBackend):  # type: ignore[misc]
    """cattention in ``CPU_ATTN``'s place: float32, bfloat16 and float16
    models, caches of the model's dtype or fp8 (E4M3FN, E5M2, with vLLM's
    per-tensor scales), any head size and block size, decoder, encoder,
    encoder-only and cross-attention, windows, softcap, ALiBi, sinks."""

    # the append is its own call (do_kv_cache_update), at vLLM's slots
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(_FP8_CACHES) + ["auto"]

    @staticmethod
    def get_name() -> str:
        # the slot it fills: vLLM's CPU platform and messages know this name
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[CattentionImpl]:
        return CattentionImpl

    @staticmethod
    def get_builder_cls() -> type[CattentionMetadataBuilder]:
        return CattentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # (block, head) outermost, each holding its K rows then its V rows
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER,
                             AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER)


@dataclasses.dataclass
class CattentionMetadata:
    """One step, as every layer of a KV cache group reads it: NumPy views of
    vLLM's CPU tensors (no copies), the first n_reqs requests."""

    num_actual_tokens: int
    query_start_loc: NDArray[np.integer[Any]]   # (n_reqs + 1,)
    seq_lens: NDArray[np.integer[Any]]          # (n_reqs,) keys of each request
    block_table: NDArray[np.integer[Any]]       # (n_reqs, max_blocks)
    causal: bool
    # every request brings this many query rows (decode steps: 1), else 0:
    # the step is then padded (B, H, T, d), the paged call's compiled path
    uniform_query_len: int
    # vLLM's dynamic causal (DFlash's drafts): a causal flag per request
    causal_per_request: Optional[NDArray[np.bool_]] = None


class CattentionMetadataBuilder(AttentionMetadataBuilder[CattentionMetadata]):  # type: ignore[misc]
    """Builds a step's metadata once for every layer of a group."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.is_cross_attention = isinstance(kv_cache_spec, CrossAttentionSpec)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CattentionMetadata:
        meta = common_attn_metadata
        n_reqs = meta.num_reqs
        causal: Any = meta.causal
        if isinstance(causal, torch.Tensor):
            # a causal flag per request (vLLM's dynamic causal, int32: 1 causal)
            causal = causal[:n_reqs].numpy().astype(bool)
        else:
            causal = bool(causal) and not self.is_cross_attention
        return step_metadata(
            meta.num_actual_tokens,
            as_index_array(meta.query_start_loc_cpu[:n_reqs + 1], "query_start_loc"),
            as_index_array(meta.seq_lens[:n_reqs], "seq_lens"),
            as_index_array(meta.block_table_tensor[:n_reqs], "block_table"), causal)


def step_metadata(num_actual_tokens: int, query_start_loc: NDArray[np.integer[Any]],
                  seq_lens: NDArray[np.integer[Any]], block_table: NDArray[np.integer[Any]],
                  causal: Any) -> CattentionMetadata:
    """A step's metadata from its arrays (the requests' query rows from
    query_start_loc, their keys, their blocks); causal a flag for the step
    or a bool array, one flag per request."""
    query_lens = np.diff(query_start_loc)
    uniform = (int(query_lens[0]) if query_lens.size and (query_lens == query_lens[0]).all()
               else 0)
    if isinstance(causal, np.ndarray):
        return CattentionMetadata(num_actual_tokens, query_start_loc, seq_lens, block_table,
                                  False, 0, causal)
    return CattentionMetadata(num_actual_tokens, query_start_loc, seq_lens, block_table,
                              bool(causal), uniform)


class CattentionImpl(AttentionImpl[CattentionMetadata]):  # type: ignore[misc]
    """One attention layer: its options, checked once, and its calls."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None, alibi_slopes: Optional[list[float]] = None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if kv_cache_dtype != "auto" and kv_cache_dtype not in _FP8_CACHES:
            raise NotImplementedError(
                f"cattention's vLLM backend does not serve kv_cache_dtype={kv_cache_dtype!r}: "
                f"it reads caches of the model's dtype ('auto') and fp8 ones "
                f"({', '.join(map(repr, _FP8_CACHES))}); unset CATTENTION_VLLM to run "
                "vLLM's CPU_ATTN")
        n_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if n_kv_heads < 1 or num_heads % n_kv_heads:
            raise ValueError(f"cattention's vLLM backend: {num_heads} query heads are not a "
                             f"multiple of {n_kv_heads} key/value heads")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"cattention's vLLM backend: sinks of shape {tuple(sinks.shape)} "
                             f"for {num_heads} query heads (one sink per head)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = n_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        # an fp8 cache's bytes as their format (ml_dtypes, the vllm extra's)
        self.fp8: Optional[np.dtype[Any]] = None
        if kv_cache_dtype in _FP8_CACHES:
            import ml_dtypes
            self.fp8 = np.dtype(getattr(ml_dtypes, _FP8_CACHES[kv_cache_dtype]))
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.alibi_slopes = (None if alibi_slopes is None
                             else np.asarray(alibi_slopes, dtype=np.float32))
        if self.alibi_slopes is not None and self.alibi_slopes.shape != (num_heads,):
            raise ValueError(f"cattention's vLLM backend: {self.alibi_slopes.size} ALiBi "
                             f"slopes for {num_heads} query heads")
        self.softcap = logits_soft_cap or None      # vLLM's "no softcap" is None or 0
        # vLLM's window of W positions: a query sees itself and the W - 1
        # before it, and in non-causal layers the W - 1 after it too
        self.window_reach = (sliding_window - 1 if sliding_window is not None
                             and sliding_window > 0 else None)
        self._pages: Optional[tuple[Any, _Array, _Array]] = None
        self.precision = precision_from_environment()
        logger.info_once("cattention %s serves vLLM's attention (CPU_ATTN): kernel table %s, "
                         "OpenMP runtime %s, threads as torch's (%d now), precision %s",
                         cattention.__version__, driver.get_simd(), driver.openmp_runtime(),
                         torch.get_num_threads(), self.precision or "default (high)")

    # ------------------------------------------------------------ the cache

    def pages(self, kv_cache: torch.Tensor) -> tuple[_Array, _Array]:
        """K and V pages (n_blocks, H_kv, block_size, d): views of the layer's
        cache tensor (n_blocks, H_kv, block_size, 2 d), whose (block, head)
        holds block_size rows of K, then block_size rows of V. The tensor
        stays the same from step to step: the views are made once."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()))
        if self._pages is None or self._pages[0] != key:
            # vLLM keeps fp8 caches as bytes: read as the codes they are
            cache = (as_array(kv_cache, "kv_cache") if self.fp8 is None
                     else as_fp8_array(kv_cache, self.fp8, "kv_cache"))
            n_blocks, n_kv_heads, block_size, row = cache.shape
            d = row // 2
            item = cache.itemsize
            if n_kv_heads != self.num_kv_heads or d != self.head_size or row != 2 * d:
                raise ValueError(f"cattention's vLLM backend: a KV cache of shape "
                                 f"{cache.shape} for {self.num_kv_heads} K/V heads of size "
                                 f"{self.head_size}")
            if cache.strides[2:] != (row * item, item):
                # each (block, head) must be one run of rows: the pages below
                # are views into it (a copy would take the appends away)
                raise ValueError(f"cattention's vLLM backend: a KV cache whose (block, head) "
                                 f"is not contiguous (strides {cache.strides})")
            # row j of K at j * d, of V at (block_size + j) * d within the
            # (block, head), one run of rows: split without a copy
            halves = cache.reshape(n_blocks, n_kv_heads, 2, block_size, d)
            self._pages = (key, halves[:, :, 0], halves[:, :, 1])
        return self._pages[1], self._pages[2]

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """The step's new K/V rows into their slots (compiled, in place)."""
        if self.attn_type in _ENCODER_TYPES:
            return      # encoder attention keeps no cache
        k_pages, v_pages = self.pages(kv_cache)
        n_rows = slot_mapping.shape[0]
        cattention.paged_append(k_pages, v_pages, as_index_array(slot_mapping, "slot_mapping"),
                               as_array(key[:n_rows], "key"), as_array(value[:n_rows], "value"),
                               **self._scales(layer))

    def _scales(self, layer: Any) -> dict[str, Any]:
        """An fp8 cache's scales: vLLM's per tensor, one for K and one for V
        (1 unless the checkpoint gives them), stored value = value / scale;
        none for other caches."""
        if self.fp8 is None:
            return {}
        return {"k_scale": np.float32(layer._k_scale_float),
                "v_scale": np.float32(layer._v_scale_float)}

    # ----------------------------------------------------------- the step

    def _paged(self, q: _Array, out: _Array, pages: tuple[_Array, _Array], table: _Array,
               seq_lens: _Array, query_start_loc: _Array, uniform_query_len: int,
               causal: bool, options: dict[str, Any]) -> None:
        """One paged call: packed rows (n_rows, H, d) of the requests of
        query_start_loc into out, bottom-right causal or not."""
        n_reqs = seq_lens.shape[0]
        rows = uniform_query_len
        window = _window(self.window_reach, causal)
        if rows and rows * n_reqs == q.shape[0]:
            # every request brings `rows` query rows (decode steps): the padded
            # layout (B, H, T, d) as views of the packed rows
            q4 = q.reshape(n_reqs, rows, self.num_heads, -1).transpose(0, 2, 1, 3)
            out4 = out.reshape(n_reqs, rows, self.num_heads, -1).transpose(0, 2, 1, 3)
            cattention.attention_with_paged_kvcache(q4, pages[0], pages[1], table, seq_lens,
                                                    causal=causal, window=window, out=out4,
                                                    **options)
        else:
            cattention.attention_with_paged_kvcache(q, pages[0], pages[1], table, seq_lens,
                                                    cu_seqlens_q=query_start_loc,
                                                    causal=causal, window=window, out=out,
                                                    **options)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[CattentionMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ATTN of the step's query rows into ``output`` (n_tokens, H, d)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("cattention's vLLM backend does not fuse output "
                                      "quantization")
        if attn_metadata is None:   # vLLM's warm-up and profiling runs
            return output
        meta = attn_metadata
        n_tokens = meta.num_actual_tokens
        q = as_array(query[:n_tokens], "query")
        out = as_array(output[:n_tokens].view(n_tokens, self.num_heads, -1), "output")
        encoder = self.attn_type in _ENCODER_TYPES
        reach = self.window_reach
        options: dict[str, Any] = dict(
            scale=self.scale, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
            num_threads=torch.get_num_threads(), precision=self.precision,
            sinks=None if self.sinks is None else as_array(
                self.sinks.detach().to(torch.float32), "sinks"))
        if encoder:
            k = as_array(key[:n_tokens], "key")
            v = as_array(value[:n_tokens], "value")
            cattention.attention_varlen(q, k, v, meta.query_start_loc, meta.query_start_loc,
                                        causal=False, enable_gqa=True, out=out,
                                        window=_window(reach, False), **options)
            return output
        pages = self.pages(kv_cache)
        options.update(self._scales(layer))
        if meta.causal_per_request is None:
            self._paged(q, out, pages, meta.block_table, meta.seq_lens, meta.query_start_loc,
                        meta.uniform_query_len, meta.causal, options)
            return output
        # each request with its own flag: the causal requests in one call,
        # the others in another (their query rows gathered, then put back)
        query_lens = np.diff(meta.query_start_loc)
        for causal in (True, False):
            chosen = np.flatnonzero(meta.causal_per_request == causal)
            if chosen.size == 0:
                continue
            rows = np.concatenate([np.arange(meta.query_start_loc[b],
                                             meta.query_start_loc[b + 1]) for b in chosen])
            part = np.empty((rows.size,) + out.shape[1:], dtype=out.dtype)
            cu = np.concatenate([[0], np.cumsum(query_lens[chosen])]).astype(np.int64)
            self._paged(q[rows], part, pages, meta.block_table[chosen],
                        meta.seq_lens[chosen], cu, 0, causal, options)
            out[rows] = part
        return output


#: The precision level of bfloat16 and float16 models' attention
#: (cattention's ``precision=``), read when the engine starts.
PRECISION_VARIABLE = "CATTENTION_PRECISION"


def precision_from_environment() -> Optional[str]:
    """CATTENTION_PRECISION ("highest", "high" or "medium"), or None (unset
    or empty: cattention's default); anything else is refused naming it."""
    value = os.environ.get(PRECISION_VARIABLE, "") or None
    try:
        driver.check_precision(value, True)
    except ValueError:
        raise ValueError(f"{PRECISION_VARIABLE}={value!r}: set it to highest, high or medium, "
                         "or unset it for cattention's default (high)") from None
    return value


def _window(reach: Optional[int], causal: bool) -> Optional[tuple[int, int]]:
    """vLLM's window as cattention's: it reaches back, and forward too where
    attention is not causal."""
    return None if reach is None else (reach, 0 if causal else reach)
