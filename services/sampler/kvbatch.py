"""Sequences decoded together: one left-padded KV cache for every active sequence of one adapter.

Continuous batching needs sequences of different lengths in one forward, joining and leaving
between steps. Each sequence is prefilled alone (exactly as an unbatched generation starts), then
its keys and values join the batch's cache, left-padded to the longest; a 0/1 mask marks the
padding and each row carries its own position, so a row's attention sees exactly its own tokens
(padded keys get a zero softmax weight) and its rotary positions are those of the unbatched run.
A finished row is dropped by index; columns that only hold padding are trimmed.
"""

from __future__ import annotations

from typing import Any


def cache_layers(cache: Any) -> list[list[Any]]:
    """``[[keys, values], ...]`` per layer of a DynamicCache (transformers 5 ``layers``, or 4.x lists)."""
    if hasattr(cache, "layers"):
        return [[layer.keys, layer.values] for layer in cache.layers]
    return [[k, v] for k, v in zip(cache.key_cache, cache.value_cache)]


def set_cache_layers(cache: Any, kv: list[list[Any]]) -> None:
    """Replace every layer's keys and values of ``cache`` (shapes ``[B, H, T, D]``)."""
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:], cache.value_cache[:] = [k for k, _ in kv], [v for _, v in kv]


def _left_pad(t: Any, width: int) -> Any:
    """``t`` (``[B, H, T, D]``) with ``width`` zero columns before its first position."""
    import torch

    if width == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], width, t.shape[3]), t], dim=2)


class KVBatch:
    """The batched cache, padding mask and positions of the sequences one adapter decodes together."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.mask_BT: Any = None  # 1 where a row has a real token, 0 for left padding

    def __len__(self) -> int:
        return 0 if self.mask_BT is None else int(self.mask_BT.shape[0])

    @property
    def lengths(self) -> list[int]:
        """Real tokens in each row's cache (each row's next position)."""
        return [] if self.mask_BT is None else self.mask_BT.sum(dim=1).tolist()

    @property
    def width(self) -> int:
        return 0 if self.mask_BT is None else int(self.mask_BT.shape[1])

    def add(self, cache: Any, length: int) -> None:
        """Append one sequence whose (batch-1) ``cache`` holds its ``length`` prompt tokens."""
        import torch

        kv = cache_layers(cache)
        if self.cache is None:
            self.cache, self.mask_BT = cache, torch.ones(1, length, dtype=torch.long)
            return
        width = max(self.width, length)
        mine = cache_layers(self.cache)
        merged = [[torch.cat([_left_pad(a, width - self.width), _left_pad(b, width - length)], dim=0)
                   for a, b in zip(ours, theirs)] for ours, theirs in zip(mine, kv)]
        set_cache_layers(self.cache, merged)
        row = torch.cat([torch.zeros(width - length, dtype=torch.long), torch.ones(length, dtype=torch.long)])
        old = torch.cat([torch.zeros(len(self), width - self.width, dtype=torch.long), self.mask_BT], dim=1)
        self.mask_BT = torch.cat([old, row[None]], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); trim the columns that are padding in every kept row."""
        import torch

        if not rows:
            self.cache, self.mask_BT = None, None
            return
        index = torch.tensor(rows)
        mask = self.mask_BT.index_select(0, index)
        start = int((mask.sum(dim=0) > 0).nonzero()[0])  # the first column any kept row uses
        set_cache_layers(self.cache, [[t.index_select(0, index)[:, :, start:] for t in pair]
                                      for pair in cache_layers(self.cache)])
        self.mask_BT = mask[:, start:]

    def step_inputs(self, tokens: list[int]) -> dict[str, Any]:
        """The forward's keyword arguments to feed one token per row (cache kwarg added by the caller)."""
        import torch

        mask = torch.cat([self.mask_BT, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        return {"input_ids": torch.tensor(tokens)[:, None], "attention_mask": mask,
                "position_ids": torch.tensor(self.lengths)[:, None]}

    def advance(self) -> None:
        """Record the token every row was just fed (the cache grew by one column in place)."""
        import torch

        self.mask_BT = torch.cat([self.mask_BT, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
