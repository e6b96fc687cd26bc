"""Fingerprints of cattention's results, to prove that a refactor changed no bit.

    python tools/fingerprints.py record tools/fingerprints.json
    python tools/fingerprints.py check tools/fingerprints.json

Each case is one call on seeded inputs; its fingerprint is the sha256 of the
bytes of every array it returns. The cases cover every option of every entry
point, both dtypes, float16, int8 and fp8 K/V, bfloat16 (fp8 and bfloat16
when ml_dtypes is installed), SCORES, LSE, grouped heads, the decode (direct) path with and
without split keys, the packed and per-entry paths, and every kernel table
this CPU runs. ``check`` compares the tables both
runs have and exits 1 on any difference; ``record`` replaces the tables this
CPU runs and keeps the file's others (an AVX2 machine keeps the avx512
fingerprints an AVX-512 machine recorded).

``merge`` combines chunks with NumPy's exp and log, whose float64 bits
follow NumPy's own CPU dispatch: on an AVX-512 CPU, record and check with
``NPY_DISABLE_CPU_FEATURES=X86_V4`` to compare with fingerprints taken where
NumPy ran its AVX2 code (as the recorded ones were).
"""

import hashlib
import json
import sys

import numpy as np

import cattention as ca
from cattention._native import driver as _attention

try:
    from ml_dtypes import bfloat16, float8_e4m3fn, float8_e5m2
except ImportError:      # the bfloat16 and fp8 cases are then neither run nor compared
    bfloat16 = float8_e4m3fn = float8_e5m2 = None


def cast(values, dtype):
    """float64 draws in dtype; bfloat16 through float32, which every
    ml_dtypes rounds the same way (0.5 rounds float64 through float32, 0.7
    directly, and the two differ on about 5 draws in a million)."""
    if bfloat16 is not None and np.dtype(dtype) == np.dtype(bfloat16):
        return values.astype(np.float32).astype(dtype)
    return values.astype(dtype)

def quantized(x, kv_dtype, rule="row"):
    """int8 or fp8 codes of float32 x with their scales (per row, or for
    fp8 the rule of quantize_kv_fp8)."""
    if kv_dtype == np.int8:
        return ca.quantize_kv(x)
    return ca.quantize_kv_fp8(x, kv_dtype, rule)


def is_quantized(kv_dtype):
    return np.dtype(kv_dtype).itemsize == 1


#: (T, S): decode (direct path, split keys at S >= 1024), tails, packed paths
#: (700 keys: P.V tiles of several runs joining a non-zero accumulator)
SHAPES = [(1, 1), (1, 300), (1, 2048), (5, 7), (8, 1025), (9, 300), (97, 300),
          (300, 97), (260, 300), (130, 129), (97, 700)]

OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "bool-mask": dict(mask="bool"),
    "additive-mask": dict(mask="additive", causal=True),
    "kv-lengths": dict(kv_lengths=True, causal=True),
    "window": dict(window=(7, 3)),
    "window-causal": dict(window=(20, None), causal=True),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi_slopes=True, causal=True),
    "scale": dict(scale=-0.3),
    "gqa": dict(enable_gqa=True, causal=True),
    "combined": dict(enable_gqa=True, window=(37, 5), softcap=1.5, alibi_slopes=True,
                     kv_lengths=True, causal=True),
}


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:32]


def attention_cases(dtype, kv_dtype):
    for T, S in SHAPES:
        for name, option in OPTIONS.items():
            seed = (T * 7919 + S * 104729 + len(name)) % 2**31
            rng = np.random.default_rng(seed)
            heads = 4
            kv_heads = 2 if option.get("enable_gqa") else heads
            q = cast(rng.standard_normal((2, heads, T, 16)), dtype)
            kwargs = dict(option)
            if is_quantized(kv_dtype):
                # int8 or fp8 K/V with their row scales, quantized from float32
                (k, kwargs["k_scale"]), (v, kwargs["v_scale"]) = (
                    quantized(cast(rng.standard_normal((2, kv_heads, S, d)), np.float32),
                              kv_dtype) for d in (16, 12))
            else:
                k = cast(rng.standard_normal((2, kv_heads, S, 16)), kv_dtype)
                v = cast(rng.standard_normal((2, kv_heads, S, 12)), kv_dtype)
            if kwargs.get("mask") == "bool":
                kwargs["mask"] = rng.random((T, S)) > 0.3
            elif kwargs.get("mask") == "additive":
                kwargs["mask"] = np.where(rng.random((heads, T, S)) > 0.2,
                                          rng.standard_normal((heads, T, S)), -np.inf)
            if kwargs.get("kv_lengths"):
                kwargs["kv_lengths"] = np.array([S, max(0, S // 3)])
            if kwargs.get("alibi_slopes"):
                kwargs["alibi_slopes"] = np.linspace(0.05, 0.4, heads)
            key = f"{np.dtype(dtype).name}/{np.dtype(kv_dtype).name}/{T}x{S}/{name}"
            yield key + "/attn", lambda q=q, k=k, v=v, kw=kwargs: (ca.attention(q, k, v, **kw),)
            yield key + "/lse", lambda q=q, k=k, v=v, kw=kwargs: ca.attention(
                q, k, v, return_lse=True, **kw)
            if T * S <= 40000:
                yield key + "/scores+lse", lambda q=q, k=k, v=v, kw=kwargs: ca.attention(
                    q, k, v, return_scores=True, return_lse=True, **kw)
                yield key + "/scores-only", lambda q=q, k=k, kw=kwargs: (ca.attention_scores(
                    q, k, **{o: x for o, x in kw.items() if o != "v_scale"}),)


def layout_cases(dtype):
    rng = np.random.default_rng(5)
    q = cast(rng.standard_normal((3, 40, 16)), dtype)
    k = cast(rng.standard_normal((3, 70, 16)), dtype)
    v = cast(rng.standard_normal((3, 70, 8)), dtype)
    name = np.dtype(dtype).name
    yield f"{name}/layout/transposed", lambda: (ca.attention(
        np.asfortranarray(q), k[:, ::-1][:, ::-1], v, causal=True),)
    yield f"{name}/layout/broadcast-kv", lambda: (ca.attention(q, k[:1], v[:1]),)
    yield f"{name}/layout/2d", lambda: (ca.attention(q[0], k[0], v[0], causal=True),)


def kvcache_cases(dtype, cache_dtype, rule="row"):
    """Steps of attention_with_kvcache; an int8 or fp8 cache with its scales
    per row (written on append), or for fp8 a scale per tensor (fixed)."""
    for T_new in (1, 4, 40):
        for option in ({}, dict(window=(9, 0), softcap=2.0,
                                alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]))):
            def run(T_new=T_new, option=option):
                rng = np.random.default_rng(T_new)
                float_cache = np.float32 if is_quantized(cache_dtype) else cache_dtype
                k_cache = cast(rng.standard_normal((2, 2, 96, 16)), float_cache)
                v_cache = cast(rng.standard_normal((2, 2, 96, 8)), float_cache)
                scales = {}
                if is_quantized(cache_dtype):
                    (k_cache, scales["k_scale"]), (v_cache, scales["v_scale"]) = (
                        quantized(k_cache, cache_dtype, rule),
                        quantized(v_cache, cache_dtype, rule))
                lengths = np.array([10, 50])
                q = cast(rng.standard_normal((2, 4, T_new, 16)), dtype)
                new_k = cast(rng.standard_normal((2, 2, T_new, 16)), float_cache)
                new_v = cast(rng.standard_normal((2, 2, T_new, 8)), float_cache)
                out, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new_k,
                                                     new_v, return_lse=True, **option,
                                                     **scales)
                return (out, lse, k_cache, v_cache, lengths) + tuple(scales.values())
            yield (f"{np.dtype(dtype).name}/{np.dtype(cache_dtype).name}/kvcache/{T_new}/"
                   f"{'options' if option else 'plain'}" + ("" if rule == "row" else f"/{rule}")
                   ), run


def wide_decode_cases(kv_dtype):
    """Decode steps over an fp8 cache of 64 and 128 features: the direct
    kernels' whole vectors (held query rows, pairs of vectors where a
    table reads them so), one and four query rows per K/V head."""
    for d in (64, 128):
        for heads in (2, 8):
            def run(d=d, heads=heads):
                rng = np.random.default_rng(d + heads)
                q = rng.standard_normal((2, heads, 1, d)).astype(np.float32)
                (k, k_scale), (v, v_scale) = (
                    quantized(rng.standard_normal((2, 2, 300, d)).astype(np.float32),
                              kv_dtype) for _ in range(2))
                return ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale,
                                    enable_gqa=True, return_lse=True)
            yield f"float32/{np.dtype(kv_dtype).name}/decode/d{d}/heads{heads}", run


def merge_cases(dtype):
    rng = np.random.default_rng(9)
    q = cast(rng.standard_normal((2, 5, 8)), dtype)
    k = cast(rng.standard_normal((2, 30, 8)), dtype)
    v = cast(rng.standard_normal((2, 30, 4)), dtype)

    def run():
        parts = [ca.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
                 for a, b in ((0, 11), (11, 30))]
        return ca.merge([p[0] for p in parts], [p[1] for p in parts])
    yield f"{np.dtype(dtype).name}/merge", run


def deep_cases(dtype):
    """d_k of several runs of features in the score tiles (130: the last
    run of 2, across the 128-feature chunk of the avx512 tiles; 256), on
    the packed path, with SCORES, and the direct one."""
    for d_k in (130, 256):
        for T, S in ((1, 300), (9, 300), (97, 300)):
            rng = np.random.default_rng(d_k * 1000 + T)
            q = cast(rng.standard_normal((2, 3, T, d_k)), dtype)
            k = cast(rng.standard_normal((2, 3, S, d_k)), dtype)
            v = cast(rng.standard_normal((2, 3, S, 24)), dtype)
            key = f"{np.dtype(dtype).name}/deep/d{d_k}/{T}x{S}"
            yield key + "/attn", lambda q=q, k=k, v=v: (ca.attention(q, k, v, causal=True),)
            yield key + "/scores+lse", lambda q=q, k=k, v=v: ca.attention(
                q, k, v, return_scores=True, return_lse=True)


def all_cases():
    for dtype in (np.float32, np.float64):
        yield from attention_cases(dtype, dtype)
        yield from deep_cases(dtype)
        yield from layout_cases(dtype)
        yield from kvcache_cases(dtype, dtype)
        yield from merge_cases(dtype)
    yield from attention_cases(np.float32, np.float16)
    yield from kvcache_cases(np.float32, np.float16)
    yield from attention_cases(np.float32, np.int8)
    yield from kvcache_cases(np.float32, np.int8)
    if bfloat16 is not None:
        # the tile tables' (amx, avx512bf16) own products and sums
        yield from attention_cases(bfloat16, bfloat16)
        yield from deep_cases(bfloat16)
        yield from kvcache_cases(bfloat16, bfloat16)
        yield from kvcache_cases(np.float32, bfloat16)
        for fp8 in (float8_e4m3fn, float8_e5m2):
            yield from attention_cases(np.float32, fp8)
            yield from attention_cases(bfloat16, fp8)
            yield from kvcache_cases(np.float32, fp8)
            yield from kvcache_cases(bfloat16, fp8, "tensor")
            yield from wide_decode_cases(fp8)


def fingerprints():
    tables = {}
    previous = _attention.get_simd()
    try:
        for table in _attention.available_simd():
            _attention.set_simd(table)
            tables[table] = {key: digest(*run()) for key, run in all_cases()}
    finally:
        _attention.set_simd(previous)
    return tables


def main(argv):
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    mode, path = argv
    current = fingerprints()
    if mode == "record":
        try:
            with open(path) as f:
                kept = json.load(f)
        except FileNotFoundError:
            kept = {}
        with open(path, "w") as f:
            json.dump({**kept, **current}, f, indent=0, sort_keys=True)
        print(f"recorded {sum(map(len, current.values()))} fingerprints "
              f"({', '.join(current)}) in {path}"
              + (f"; kept {', '.join(sorted(set(kept) - set(current)))}"
                 if set(kept) - set(current) else ""))
        return 0
    with open(path) as f:
        recorded = json.load(f)
    differences = 0
    compared = 0
    for table in sorted(set(recorded) & set(current)):
        for key, value in recorded[table].items():
            if bfloat16 is None and ("bfloat16" in key or "float8" in key):
                continue
            compared += 1
            if current[table].get(key) != value:
                differences += 1
                print(f"differs: {table} {key}")
    missing = sorted(set(recorded) ^ set(current))
    print(f"{compared} fingerprints compared over tables "
          f"{', '.join(sorted(set(recorded) & set(current)))}: {differences} differ"
          + (f"; tables in one run only: {', '.join(missing)}" if missing else ""))
    return 1 if differences or compared == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
