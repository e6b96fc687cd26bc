"""
Attention over a sentence
=========================

A sentence through one layer of self-attention with random weights: token
embeddings and projections drawn from a seeded generator (no model, no
download), causal attention over 4 heads, and the weights of two heads drawn
with :func:`cattention.plot_scores`. Each row is a token looking back at the
tokens before it; each row sums to 1.
"""

import matplotlib.pyplot as plt
import numpy as np

import cattention as ca

tokens = "the quick brown fox jumps over the lazy dog because it was late".split()
T, D, H = len(tokens), 64, 4
d = D // H
rng = np.random.default_rng(7)

# A random embedding per distinct word (both "the" share one) plus a
# sinusoidal position code, as a transformer's first layer sees them.
vocabulary = {word: rng.standard_normal(D) for word in dict.fromkeys(tokens)}
position = np.arange(T)[:, None] / 10_000 ** (np.arange(0, D, 2)[None, :] / D)
x = np.array([vocabulary[word] for word in tokens])
x[:, 0::2] += np.sin(position)
x[:, 1::2] += np.cos(position)

# Random projections to 4 heads of 16 features: (H, T, d) queries, keys, values.
w_q, w_k, w_v = (rng.standard_normal((D, D)) * 0.5 for _ in range(3))
q, k, v = ((x @ w).reshape(T, H, d).transpose(1, 0, 2).astype(np.float32)
           for w in (w_q, w_k, w_v))

attn, scores = ca.attention(q, k, v, causal=True, return_scores=True)
print("ATTN", attn.shape, "SCORES", scores.shape)
print("row sums of head 0:", np.round(scores[0].sum(axis=-1), 6))

# %%
# Two heads side by side. ``plot_scores`` draws into the Axes it is given
# (here from pyplot); without ``ax`` it makes a figure of its own.

fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), layout="constrained")
for head, ax in zip((0, 2), axes):
    ca.plot_scores(scores[head], query_labels=tokens, key_labels=tokens, ax=ax)
    ax.set_title(f"head {head}")
plt.show()

# %%
# Which earlier token each token attends to most, per head:

for head in range(H):
    strongest = [tokens[j] for j in scores[head].argmax(axis=-1)]
    print(f"head {head}:", " ".join(f"{t}->{s}" for t, s in zip(tokens, strongest)))
