"""The mask function registered with transformers' AttentionMaskInterface.

transformers asks it, once per forward and kind of layer, for the mask of
the call: a pattern (a mask function over absolute query and key positions)
plus the 2-D padding mask of the batch. For the patterns its decoders and
encoders use, causal, bidirectional, a causal or bidirectional sliding
window, with any left or right padding, this returns a MaskStructure: the
keyword arguments of ``cattention.attention`` that say the same (causal,
window, each sequence's valid key range), built once and read by every
layer. Nothing of size T x S is made. Any other pattern (packed sequences,
chunked attention, image tokens that see each other, a model's own and/or
mask functions, padding with holes) gets transformers' own dense bool mask,
which the attention function hands to cattention as ``mask=``.

Positions: query i of the call is at absolute position ``q_offset + i``,
key j of the K/V arrays at ``kv_offset + j`` (a sliding-window cache holds
only the last keys, so kv_offset > 0). cattention aligns causal masks and
windows at the bottom right of each sequence's valid keys: query i sits at
key index ``i + kv_lengths[b] - T``. Giving ``kv_lengths`` the causal end
``E = q_offset + T - kv_offset`` puts every query where transformers has
it; keys before a sequence's start (left padding) are cut by ``kv_starts``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from numpy.typing import NDArray
from transformers import masking_utils

Window = tuple[Optional[int], Optional[int]]

# a pattern: causal or not, and the window as cattention's (left, right)
Pattern = tuple[bool, Optional[Window]]


@dataclasses.dataclass(frozen=True)
class MaskStructure:
    """What the mask of a call is, in cattention's terms, instead of a dense
    ``(B, 1, T, S)`` mask.

    Attributes
    ----------
    batch_size, n_queries, n_keys : int
        B, T and S of the calls it is made for.
    causal : bool
        Bottom-right causal alignment (see the module docstring).
    window : (int or None, int or None) or None
        cattention's ``window=(left, right)``; None when the window reaches
        every key anyway.
    kv_starts : ndarray of int64, shape (B,), or None
        First valid key of each sequence (left padding); None when all are 0.
    kv_lengths : int, ndarray of int64 of shape (B,), or None
        End of the valid keys (the causal end for causal patterns, each
        sequence's end for bidirectional ones); None when it is S.
    options : dict
        The keyword arguments of ``cattention.attention`` these make, built
        once so that each layer's call only reads them.
    """

    batch_size: int
    n_queries: int
    n_keys: int
    causal: bool
    window: Optional[Window] = None
    kv_starts: Optional[NDArray[np.int64]] = None
    kv_lengths: Union[int, NDArray[np.int64], None] = None
    options: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        options: dict[str, Any] = {"causal": self.causal}
        if self.window is not None:
            options["window"] = self.window
        if self.kv_starts is not None:
            options["kv_starts"] = self.kv_starts
        if self.kv_lengths is not None:
            options["kv_lengths"] = self.kv_lengths
        object.__setattr__(self, "options", options)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of the dense mask it stands for, for code that asks."""
        return (self.batch_size, 1, self.n_queries, self.n_keys)

    @property
    def ndim(self) -> int:
        """4, as the mask it stands for. generate() makes the masks of a
        static cache ahead of the forward and hands them to the model as its
        attention_mask; transformers takes a 2-D one for padding and builds
        on it, anything else it passes to the mask function, which returns a
        structure unchanged."""
        return 4

    def check_call(self, batch_size: int, n_queries: int, n_keys: int) -> None:
        """Raise ValueError unless this structure was made for a call of
        these sizes (a layer whose cache differs from the one the mask was
        sized for would otherwise be masked wrongly)."""
        if (n_queries, n_keys) != (self.n_queries, self.n_keys) or (
                batch_size != self.batch_size and self.batch_size != 1):
            raise ValueError(
                f"the attention mask was made for batch {self.batch_size}, {self.n_queries} "
                f"queries and {self.n_keys} keys; this layer has batch {batch_size}, "
                f"{n_queries} queries and {n_keys} keys")


def _as_int(offset: Any) -> int:
    # a static cache gives its offset as a 0-d tensor (to spare compiled graphs)
    return int(offset.item()) if isinstance(offset, torch.Tensor) else int(offset)


def _sliding_pattern(mask_function: Callable[..., Any], window_size: int, q_offset: int,
                     n_queries: int, kv_offset: int, n_keys: int) -> Optional[Pattern]:
    """The sliding-window pattern mask_function is, if it is one.

    transformers builds sliding-window mask functions as closures (causal:
    ``q - w < kv <= q``; bidirectional: ``|q - kv| <= w``), so they are
    recognised by what they give: evaluated on the call's first and last
    query rows over all its keys, O(S) work, and compared with each."""
    q_idx = torch.tensor(sorted({q_offset, q_offset + n_queries - 1}))[:, None]
    kv_idx = torch.arange(kv_offset, kv_offset + n_keys)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    given = mask_function(zero, zero, q_idx, kv_idx)
    if torch.equal(given, (kv_idx <= q_idx) & (kv_idx > q_idx - window_size)):
        return True, (window_size - 1, 0)
    if torch.equal(given, (kv_idx - q_idx).abs() <= window_size):
        return False, (window_size, window_size)
    return None


def _pattern(mask_function: Callable[..., Any], local_size: Optional[int], use_vmap: bool,
             q_offset: int, n_queries: int, kv_offset: int, n_keys: int) -> Optional[Pattern]:
    """(causal, window) of a pattern cattention expresses, else None."""
    if mask_function is masking_utils.causal_mask_function:
        return True, None
    if mask_function is masking_utils.bidirectional_mask_function:
        return False, None
    # use_vmap is set when a model adds its own and/or mask functions
    if local_size is not None and not use_vmap and n_queries > 0 and n_keys > 0:
        return _sliding_pattern(mask_function, int(local_size), q_offset, n_queries,
                                kv_offset, n_keys)
    return None


@dataclasses.dataclass
class _KeyRanges:
    """Each sequence's valid keys [starts[b], ends[b]) in the K/V arrays."""

    starts: NDArray[np.int64]
    ends: NDArray[np.int64]


def _key_ranges(padding_mask: Optional[torch.Tensor], kv_offset: int,
                n_keys: int) -> tuple[bool, Optional[_KeyRanges]]:
    """(described, ranges): the valid key range of each sequence from the
    2-D padding mask (True: a real token), None when every key is valid;
    described is False when a sequence's valid keys have a hole (then no
    range describes them).

    The padding mask covers absolute positions; keys past its end (the
    unfilled slots of a static cache) are padding. A sequence with no valid
    key gets the empty range [0, 0)."""
    if padding_mask is None:
        return True, None
    seen = padding_mask.to(torch.bool).numpy()[:, kv_offset:kv_offset + n_keys]
    if seen.shape[1] == n_keys and seen.all():
        return True, None
    counts = seen.sum(axis=1)
    firsts = seen.argmax(axis=1)
    ends = seen.shape[1] - seen[:, ::-1].argmax(axis=1)
    empty = counts == 0
    if not np.all(empty | (ends - firsts == counts)):
        return False, None
    return True, _KeyRanges(np.where(empty, 0, firsts).astype(np.int64),
                            np.where(empty, 0, ends).astype(np.int64))


def _structure(pattern: Pattern, ranges: Optional[_KeyRanges], batch_size: int,
               q_offset: int, n_queries: int, kv_offset: int,
               n_keys: int) -> Optional[MaskStructure]:
    """The structure of pattern over these key ranges, or None when
    cattention's options cannot say it."""
    causal, window = pattern
    causal_end = q_offset + n_queries - kv_offset  # E of the module docstring
    aligned = causal or window is not None
    if aligned and not n_queries <= causal_end <= n_keys:
        return None
    starts = ends = None
    if ranges is not None:
        starts, ends = ranges.starts, ranges.ends
    if aligned:
        if causal:
            # a causal row never sees past its own position, so keys after a
            # sequence's end (right padding) are hidden from every real
            # query row by causality alone; only padding rows, whose output
            # no real token reads, could see them
            ends = None
            if starts is not None:
                # a sequence with no valid key sees none: start it at the end
                starts = np.where(ranges.ends == 0, causal_end, starts)  # type: ignore[union-attr]
        elif ends is not None and np.any(ends != causal_end):
            # a bidirectional window over right padding: the window must be
            # aligned at E and cut at each end, which one length cannot do
            return None
        elif ends is None and causal_end != n_keys:
            return None
        lengths: Union[int, NDArray[np.int64], None] = (
            None if causal_end == n_keys else causal_end)
        window = _effective_window(window, causal_end, n_queries, n_keys)
    else:
        lengths = None if ends is None or np.all(ends == n_keys) else ends
    if starts is not None and not np.any(starts):
        starts = None
    return MaskStructure(batch_size, n_queries, n_keys, causal, window, starts, lengths)


def _effective_window(window: Optional[Window], causal_end: int, n_queries: int,
                      n_keys: int) -> Optional[Window]:
    """None for a window that reaches every key of every row (a plain call
    is cheaper than a window option that cuts nothing)."""
    if window is None:
        return None
    left, right = window
    first_row, last_row = causal_end - n_queries, causal_end - 1
    cuts_left = left is not None and last_row - left > 0
    cuts_right = right is not None and first_row + right < n_keys - 1
    return window if cuts_left or cuts_right else None


def structured_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
    mask_function: Callable[..., Any] = masking_utils.causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
    use_vmap: bool = False, **kwargs: Any,
) -> Union[MaskStructure, torch.Tensor, None]:
    """The mask function for transformers' AttentionMaskInterface.

    Takes the arguments transformers gives every mask function and returns a
    MaskStructure when the pattern is causal, bidirectional or a sliding
    window and each sequence's valid keys are one run (left or right
    padding); otherwise transformers' dense ``(B, 1, T, S)`` bool mask (its
    ``sdpa_mask``), which the attention function passes on as ``mask=``."""
    if isinstance(attention_mask, MaskStructure):
        return attention_mask  # made ahead of the forward (see MaskStructure.ndim)
    queries_from, keys_from = _as_int(q_offset), _as_int(kv_offset)
    pattern = _pattern(mask_function, local_size, use_vmap, queries_from, q_length,
                       keys_from, kv_length)
    if pattern is not None:
        described, ranges = _key_ranges(attention_mask, keys_from, kv_length)
        if described:
            structure = _structure(pattern, ranges, batch_size, queries_from, q_length,
                                   keys_from, kv_length)
            if structure is not None:
                return structure
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        local_size=local_size, use_vmap=use_vmap, **kwargs)
