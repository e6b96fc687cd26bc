"""Heatmaps of attention weights, and the built-in example sentence.

matplotlib is an optional extra (``pip install ".[plot]"`` from the source
tree): it is imported only when a plot is drawn, so ``import cattention``
never needs it.
Figures are made with ``matplotlib.figure.Figure`` rather than pyplot, so no
GUI backend is chosen and no global figure state is touched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__all__ = ["plot_scores", "load_demo_sentence"]

_MATPLOTLIB_MISSING = ('plot_scores needs matplotlib: pip install matplotlib '
                       '(from a cattention source tree: pip install ".[plot]")')

# Beyond this many rows or columns every tick label would overlap, so only an
# evenly spaced subset is labelled.
_MAX_LABELLED_TICKS = 40

# Above this size nearest-neighbour drawing can drop isolated large weights
# (a thin diagonal breaks up); antialiasing averages them into view instead.
_NEAREST_MAX_CELLS = 256

class DemoSentence(NamedTuple):
    tokens: list[str]
    q: NDArray[np.floating[Any]]
    k: NDArray[np.floating[Any]]
    v: NDArray[np.floating[Any]]


def _as_weights(scores: ArrayLike) -> NDArray[Any]:
    arr = np.asarray(scores)
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"scores must be numeric attention weights; got dtype {arr.dtype}")
    if arr.ndim != 2:
        hint = ""
        if arr.ndim > 2:
            index = "0, " * (arr.ndim - 2)
            hint = (f"; index one head first, e.g. scores[{index}:, :] for "
                    f"(..., T, S) SCORES")
        raise ValueError(
            f"scores must be 2-D (T queries, S keys); got shape {arr.shape}{hint}")
    if arr.size == 0:
        raise ValueError(f"scores is empty (shape {arr.shape}); there is nothing to plot")
    # float16, integer and bool data are widened so matplotlib's colour
    # normalisation sees the same kind of input for every dtype.
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    return arr


def _as_labels(labels: Sequence[object] | None, name: str, expected: int,
               axis_name: str, shape: tuple[int, ...]) -> list[str] | None:
    if labels is None:
        return None
    if isinstance(labels, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of labels, one per {axis_name}; "
                        f"got a single string {labels!r}")
    try:
        text = [str(label) for label in labels]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of labels, one per {axis_name}; "
                        f"got {type(labels).__name__}") from None
    if len(text) != expected:
        raise ValueError(
            f"{name} has {len(text)} labels but scores has {expected} "
            f"{axis_name}s (shape {shape})")
    return text


def _tick_positions(count: int) -> NDArray[np.intp]:
    if count <= _MAX_LABELLED_TICKS:
        return np.arange(count)
    ticks: NDArray[np.intp] = np.unique(
        np.linspace(0, count - 1, _MAX_LABELLED_TICKS).round().astype(int))
    return ticks


def plot_scores(scores: ArrayLike, query_labels: Sequence[object] | None = None,
                key_labels: Sequence[object] | None = None, ax: Any = None) -> Any:
    """Draw attention weights as a heatmap: queries down, keys across.

    Parameters
    ----------
    scores : array_like, shape (T, S)
        The weights of one head, e.g. ``scores[b, h]`` from
        ``attention(..., return_scores=True)`` or ``attention_scores``.
        float16, float32, float64, integer or bool.
    query_labels : sequence, optional
        T labels (for example tokens) for the rows; each is shown with
        ``str``. Without labels the rows are numbered.
    key_labels : sequence, optional
        S labels for the columns, drawn rotated.
    ax : matplotlib.axes.Axes, optional
        Axes to draw into (a colour bar is added beside it). By default a new
        ``matplotlib.figure.Figure`` is made, sized to T and S within bounds;
        it is not registered with pyplot, so save it with
        ``ax.figure.savefig(path)``.

    Returns
    -------
    ax : matplotlib.axes.Axes
        The axes holding the heatmap (the image is ``ax.images[-1]``); its
        figure is ``ax.figure``.

    Raises
    ------
    ImportError
        If matplotlib is not installed.
    TypeError
        If ``scores`` is not numeric, a label argument is a single string, or
        ``ax`` is neither None nor a matplotlib Axes.
    ValueError
        If ``scores`` is not 2-D or is empty, or the number of labels is not
        T (``query_labels``) or S (``key_labels``).

    Notes
    -----
    The colour scale starts at 0, so heads and layers are comparable and "no
    attention" is always the same colour; its top is the largest weight. An
    array with negative values (logits rather than weights, say) starts at
    its minimum instead, so nothing is clipped. With more than 40 rows or
    columns only an evenly spaced subset of the labels is shown.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> import cattention as ca
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 4, 8))
    >>> k = rng.standard_normal((1, 2, 5, 8))
    >>> attn, scores = ca.attention(q, k, k, causal=True, return_scores=True)
    >>> ax = ca.plot_scores(scores[0, 1], query_labels=["a", "b", "c", "d"])
    >>> [label.get_text() for label in ax.get_yticklabels()]
    ['a', 'b', 'c', 'd']
    >>> bool(np.array_equal(ax.images[0].get_array(), scores[0, 1]))
    True
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = os.path.join(tmp, "head1.png")
    ...     ax.figure.savefig(path)
    ...     os.path.getsize(path) > 0
    True
    """
    weights = _as_weights(scores)
    n_queries, n_keys = weights.shape
    query_labels = _as_labels(query_labels, "query_labels", n_queries, "query row",
                              weights.shape)
    key_labels = _as_labels(key_labels, "key_labels", n_keys, "key column", weights.shape)
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(_MATPLOTLIB_MISSING) from exc

    if ax is None:
        # About 0.4 inch per token: long labels fit and a 10-token sentence
        # is readable; bounded so large T or S still give a screen-sized image.
        width = min(max(2.5 + 0.4 * n_keys, 4.0), 16.0)
        height = min(max(2.0 + 0.4 * n_queries, 3.0), 12.0)
        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.add_subplot()
    else:
        from matplotlib.axes import Axes
        if not isinstance(ax, Axes):
            raise TypeError(f"ax must be a matplotlib Axes (or None for a new figure); "
                            f"got {type(ax).__name__}")
    finite = weights[np.isfinite(weights)]
    lowest = float(finite.min()) if finite.size else 0.0
    image = ax.imshow(
        weights, cmap="viridis", vmin=min(0.0, lowest), aspect="auto",
        interpolation=("nearest" if max(n_queries, n_keys) <= _NEAREST_MAX_CELLS
                       else "antialiased"))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if key_labels is None:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ticks = _tick_positions(n_keys)
        ax.set_xticks(ticks)
        ax.set_xticklabels([key_labels[i] for i in ticks], rotation=45, ha="right",
                           rotation_mode="anchor")
    if query_labels is None:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ticks = _tick_positions(n_queries)
        ax.set_yticks(ticks)
        ax.set_yticklabels([query_labels[i] for i in ticks])
    colorbar = ax.figure.colorbar(image, ax=ax)
    colorbar.set_label("weight")
    return ax


def load_demo_sentence(dtype: DTypeLike = np.float32) -> DemoSentence:
    """The built-in example: a short sentence with small fixed embeddings.

    The embeddings (``cattention/data/demo_sentence.json``) are hand-built so
    that the weights are easy to read: each token attends to itself, "the"
    to its noun, "on" to "mat", "it" mostly to "cat".

    Parameters
    ----------
    dtype : data-type, default float32
        dtype of the returned arrays.

    Returns
    -------
    DemoSentence
        Named tuple ``(tokens, q, k, v)``: a list of T strings and three
        ``(T, d)`` arrays.

    Examples
    --------
    >>> import cattention as ca
    >>> from cattention._api.plot import load_demo_sentence
    >>> sentence = load_demo_sentence()
    >>> " ".join(sentence.tokens)
    'the cat sat on the mat because it was tired'
    >>> scores = ca.attention_scores(sentence.q, sentence.k)
    >>> it, cat = sentence.tokens.index("it"), sentence.tokens.index("cat")
    >>> int(scores[it].argmax()) == cat
    True
    """
    path = resources.files("cattention") / "data" / "demo_sentence.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    arrays = [np.asarray(data[name], dtype=dtype) for name in ("q", "k", "v")]
    return DemoSentence(list(data["tokens"]), *arrays)
