"""
Masks as pictures
=================

Which keys each query sees, as cattention computes it: every picture below is
``SCORES > 0`` for queries and keys of ones (so every visible key gets the
same weight), drawn black where a query may attend. Queries run
down, keys across. See :ref:`conventions` for the rules.
"""

import matplotlib.pyplot as plt
import numpy as np

import cattention as ca


def visible(n_queries, n_keys, **options):
    """The (T, S) pattern of keys each query sees, for the options given."""
    q = np.ones((1, n_queries, 4), np.float32)
    k = np.ones((1, n_keys, 4), np.float32)
    attn, scores = ca.attention(q, k, k, return_scores=True, **options)
    return scores[0] > 0


cases = [
    ("causal, T = S = 12", visible(12, 12, causal=True)),
    ("causal, T = 6 < S = 12\n(bottom-right: the last 6 positions)",
     visible(6, 12, causal=True)),
    ("sliding window (3, 0), causal", visible(12, 12, causal=True, window=(3, 0))),
    ("window (2, 2), not causal", visible(12, 12, window=(2, 2))),
    ("right padding: kv_lengths = 8\n(causal aligned at key 7)",
     visible(6, 12, causal=True, kv_lengths=8)),
    ("left padding: kv_starts = 4", visible(6, 12, causal=True, kv_starts=4)),
]

fig, axes = plt.subplots(2, 3, figsize=(12, 7.5), layout="constrained")
for ax, (title, pattern) in zip(axes.flat, cases):
    ax.imshow(pattern, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_xticks(range(pattern.shape[1]))
    ax.set_yticks(range(pattern.shape[0]))
    ax.tick_params(labelsize=7)
plt.show()

# %%
# A batch padded on both sides needs no dense mask: one call with per-sequence
# ``kv_starts`` and ``kv_lengths``. Sequence b sees keys
# ``kv_starts[b] <= j < kv_lengths[b]``; rows that see no key are zero.

q = np.ones((3, 1, 5, 4), np.float32)        # (B, H, T, d)
k = np.ones((3, 1, 10, 4), np.float32)
attn, scores = ca.attention(q, k, k, causal=True, kv_starts=[0, 3, 2], kv_lengths=[10, 10, 7],
                            return_scores=True)
patterns = scores[:, 0] > 0

fig, axes = plt.subplots(1, 3, figsize=(12, 3), layout="constrained")
labels = ["full length", "left-padded by 3", "padded: keys 2 to 6"]
for ax, pattern, label in zip(axes, patterns, labels):
    ax.imshow(pattern, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(label, fontsize=10)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
plt.show()
