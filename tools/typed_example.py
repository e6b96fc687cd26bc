"""A typed caller of the public API.

``mypy --strict`` accepts it as it is (tests/test_typing.py), so the stubs and
annotations give a typical caller precise types without casts or ignores;
``python tools/typed_example.py`` runs it and checks the results.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

import cattention as ca

FloatArray = NDArray[np.floating[Any]]

B, H, H_KV, T, S, D_K, D_V = 2, 4, 2, 6, 10, 16, 8


def chunked_attention(q: FloatArray, k: FloatArray, v: FloatArray,
                      chunk: int) -> tuple[FloatArray, FloatArray]:
    """Attention over all keys, computed chunk by chunk and merged."""
    outs: list[FloatArray] = []
    lses: list[FloatArray] = []
    for start in range(0, k.shape[-2], chunk):
        out, lse = ca.attention(q, k[..., start:start + chunk, :],
                                v[..., start:start + chunk, :], return_lse=True)
        outs.append(out)
        lses.append(lse)
    return ca.merge(outs, lses)


def maybe_lse(q: FloatArray, k: FloatArray, v: FloatArray, want_lse: bool) -> FloatArray:
    """The return type depends on a run-time flag: the caller narrows it."""
    result = ca.attention(q, k, v, return_lse=want_lse)
    if isinstance(result, tuple):
        return result[0]
    return result


def decode(q: NDArray[np.float32], prompt_k: NDArray[np.float32],
           prompt_v: NDArray[np.float32], new_k: NDArray[np.float32],
           new_v: NDArray[np.float32]) -> None:
    """Prefill a KV cache with a prompt, then decode one token against it."""
    k_cache = np.zeros((B, H_KV, 32, D_K), dtype=np.float32)
    v_cache = np.zeros((B, H_KV, 32, D_V), dtype=np.float32)
    lengths: NDArray[np.int64] = np.zeros(B, dtype=np.int64)

    prefill: FloatArray = ca.attention_with_kvcache(
        q[..., :S, :], k_cache, v_cache, lengths, prompt_k, prompt_v)
    assert prefill.shape == (B, H, S, D_V)
    assert lengths.tolist() == [S, S]
    # grouped-query heads over the filled prefix: what the cache attended to
    expected = ca.attention(q[..., :S, :], prompt_k, prompt_v, causal=True,
                            enable_gqa=True)
    assert np.allclose(prefill, expected, atol=1e-6)

    token, token_lse = ca.attention_with_kvcache(
        q[..., S:S + 1, :], k_cache, v_cache, lengths, new_k, new_v, return_lse=True)
    assert token.shape == (B, H, 1, D_V) and token_lse.shape == (B, H, 1)
    assert lengths.tolist() == [S + 1, S + 1]
    assert np.all(np.isfinite(token_lse))


def main() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, T, D_K), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D_K), dtype=np.float32)
    v = rng.standard_normal((B, H, S, D_V), dtype=np.float32)

    out: FloatArray = ca.attention(q, k, v)
    assert out.shape == (B, H, T, D_V) and out.dtype == np.float32

    attn, scores = ca.attention(q, k, v, return_scores=True)
    assert scores.shape == (B, H, T, S)
    assert np.allclose(scores.sum(axis=-1), 1, atol=1e-5)
    assert np.allclose(attn, scores @ v, atol=1e-5)

    # bottom-right alignment: the last query sees every key, the first S - T + 1
    causal: FloatArray = ca.attention(q, k, v, causal=True)
    weights: FloatArray = ca.attention_scores(q, k, causal=True)
    assert np.allclose(causal[..., -1, :], out[..., -1, :], atol=1e-5)
    assert np.count_nonzero(weights[0, 0, 0]) == S - T + 1
    mask: NDArray[np.bool_] = np.tril(np.ones((T, S), dtype=bool), k=S - T)
    assert np.allclose(ca.attention(q, k, v, mask=mask), causal, atol=1e-6)

    both: tuple[FloatArray, FloatArray, FloatArray] = ca.attention(
        q, k, v, return_scores=True, return_lse=True)
    merged, lse = chunked_attention(q, k, v, chunk=4)
    assert np.allclose(merged, out, atol=1e-5)
    assert np.allclose(lse, both[2], atol=1e-5)
    assert np.allclose(maybe_lse(q, k, v, want_lse=True), maybe_lse(q, k, v, False))

    default_threads: int = ca.get_num_threads()
    ca.set_num_threads(1)
    try:
        single = ca.attention(q, k, v, num_threads=None)
    finally:
        ca.set_num_threads(None)
    assert ca.get_num_threads() == default_threads
    # results are bitwise the same for any thread count
    assert np.array_equal(single, out)

    q_decode = rng.standard_normal((B, H, S + 1, D_K), dtype=np.float32)
    decode(q_decode,
           rng.standard_normal((B, H_KV, S, D_K), dtype=np.float32),
           rng.standard_normal((B, H_KV, S, D_V), dtype=np.float32),
           rng.standard_normal((B, H_KV, 1, D_K), dtype=np.float32),
           rng.standard_normal((B, H_KV, 1, D_V), dtype=np.float32))


if __name__ == "__main__":
    main()
