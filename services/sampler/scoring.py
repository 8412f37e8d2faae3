"""Prompt scoring on CPU: the log-probability of every prompt token (vLLM's ``prompt_logprobs``), fast.

A router scores each candidate continuation of one prompt: K prompts that share a long prefix (the
system turn, the same for every request with the same providers, then the query) and differ in a
few last tokens (the candidate's name). Three things keep that cheap:

* **A prefix cache** (:class:`PrefixCache`): the keys/values of past token prefixes, least recently
  used out first, keyed by adapter slot and token tuple, with what each position's distribution said
  about the next token. A request reuses the longest cached prefix it shares (cropped to the shared
  length) and forwards only the rest.
* **One forward for the rest of every prompt of a batch**: the uncached tokens of all prompts go into
  a prefix tree (a token shared by several prompts is computed once), packed into one row with a 4-D
  attention mask that lets each token see exactly its own prompt's earlier tokens (the cached prefix,
  then its ancestors in the tree) and position ids equal to its index in its prompt. So K prompts that
  differ only in their last 1-4 tokens cost one forward of the query part plus K short branches, and
  concurrent requests that share the system prompt (gathered by :mod:`services.sampler.batching`)
  share one forward.
* **The output layer only where needed**: the decoder runs once; the output layer and the
  log-softmax run in chunks over the tree's tokens that need them, and only the statistics vLLM
  reports are kept (the actual next token's logprob and 1-based vocabulary rank, the top-k), plus the
  full row after each prompt's last token, from which the first generated token is drawn. A prompt
  scored *lean* (``k`` None: a one-token completion without ``prompt_logprobs``, such as the router's
  first-token decision) needs only that last row, so its other tokens skip the output layer (on
  SmolLM2, a 49,152-wide layer: a third of a 44-token forward); a batch of lean prompts caches what
  it forwarded as keys/values without the per-position statistics (``Prefix.stats`` None), which
  later lean prompts reuse and prompts that want their logprobs pass over.

The numbers are those of a plain forward pass over each whole prompt (same weights, same adapter,
each token attending to the same keys): the unit tests check them against
``model(input_ids).logits.log_softmax(-1)`` to 1e-4. Not thread-safe: the caller holds the engine's lock.
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

HEAD_CHUNK = 256  # tree tokens per output-layer chunk: 256 x vocab floats at a time
#: Each forward's key length (cached prefix + row width) is padded to a multiple of this: torch's CPU
#: flash attention takes about twice as long on a key length that is not (bf16, 3 rows of 191 tokens
#: after 96 cached: 1.5-1.6 ms against 0.73-0.78 ms at 192, in two runs; fp32 1.2x).
KV_ALIGN = 16


@dataclass(frozen=True)
class PositionStats:
    """What one position's next-token distribution says about the token that follows it there."""

    token: int
    logprob: float
    rank: int  # 1-based: how many vocabulary entries have a logprob >= the token's (vLLM's rule)
    top: tuple[tuple[int, float], ...]  # the most likely (token, logprob), best first


@dataclass
class Prefix:
    """A cached token prefix: per-layer keys/values ``[1, kv_heads, T, head_dim]``, what positions
    0..T-2 said about tokens 1..T-1, and the log-softmax row after its last token."""

    tokens: tuple[int, ...]
    keys: list[Any]
    values: list[Any]
    stats: list[PositionStats] | None  # None: cached by a lean batch (keys/values only)
    last: Any

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.last))


def shared_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The keys/values of recent token prefixes, per adapter slot, least recently used out first."""

    def __init__(self, capacity: int = 8, min_tokens: int = 16) -> None:
        self.capacity, self.min_tokens = capacity, min_tokens
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], Prefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, slot: str | None, tokens: list[int], *, stats: bool = True) -> tuple[Prefix | None, int]:
        """The entry sharing the most leading tokens with ``tokens`` (a full match of a shorter entry
        wins a tie), and that shared length; (None, 0) when none shares any. ``stats``: only entries
        that know their positions' statistics (not those a lean batch cached)."""
        best, best_key, best_rank = None, None, (0, False)
        for key, entry in self._entries.items():
            if key[0] != slot or (stats and entry.stats is None):
                continue
            n = shared_length(entry.tokens, tokens)
            rank = (n, n == len(entry.tokens))
            if n and rank > best_rank:
                best, best_key, best_rank = entry, key, rank
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best, best_rank[0]

    def put(self, slot: str | None, entry: Prefix) -> None:
        if self.capacity <= 0 or len(entry.tokens) < self.min_tokens:
            return
        self._entries[(slot, entry.tokens)] = entry
        self._entries.move_to_end((slot, entry.tokens))
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def drop(self, slot: str | None) -> None:
        """Forget every entry of ``slot`` (its adapter was loaded, replaced or unloaded)."""
        for key in [k for k in self._entries if k[0] == slot]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


@dataclass
class Scored:
    """One prompt's ``prompt_logprobs`` (None for the first token, then the actual token's
    ``(id, logprob, rank)`` followed by up to k alternatives) and the log-softmax row after it."""

    prompt_logprobs: list[list[tuple[int, float, int]] | None]
    row: Any


@dataclass
class ScoreInfo:
    """What one scoring call did, for the metrics."""

    forwards: int = 0
    forwarded_tokens: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    seconds: float = 0.0
    cache: list[str] = field(default_factory=list)  # per forward: "hit" (a whole entry), "partial", "miss"


@dataclass
class _Tree:
    """Uncached prompt tokens as a prefix tree, in insertion order (parents first): one packed row."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)  # -1: the cached prefix
    position: list[int] = field(default_factory=list)  # index of the token in its prompts
    _index: dict[tuple[int, int], int] = field(default_factory=dict)

    def missing(self, prompt: list[int], start: int) -> int:
        """How many nodes adding ``prompt[start:]`` would create."""
        node, pos = -1, start
        while pos < len(prompt) and (child := self._index.get((node, prompt[pos]))) is not None:
            node, pos = child, pos + 1
        return len(prompt) - pos

    def add(self, prompt: list[int], start: int) -> list[int]:
        """Insert ``prompt[start:]``; its node for each of those tokens."""
        path, node = [], -1
        for pos in range(start, len(prompt)):
            key = (node, prompt[pos])
            child = self._index.get(key)
            if child is None:
                child = self._index[key] = len(self.tokens)
                self.tokens.append(prompt[pos])
                self.parent.append(node)
                self.position.append(pos)
            path.append(child)
            node = child
        return path


def _pack(prompts: list[list[int]], start: int, row_tokens: int) -> tuple[list[_Tree], list[list[int]]]:
    """The prompts' tokens from ``start`` on as prefix trees packed into rows, and each prompt's path
    as flat node ids (row after row).

    Rows hold about ``row_tokens`` nodes, or the longest prompt's count if that is more (every row is
    padded to the widest). A prompt goes where the one before it went when it shares most of its
    tokens with that row (the candidates of one query stay together), else into the first row it
    fits in, else into a new row. Prompt 0 goes in first, so the tokens every prompt shares are the
    first flat ids.
    """
    row_tokens = max(row_tokens, max(len(p) - start for p in prompts))  # a long prompt sets the width
    rows, local, last = [_Tree()], [], 0
    for p in prompts:
        new = len(p) - start
        if 2 * rows[last].missing(p, start) > new:  # not mostly shared with the row before: first fit
            last = next((r for r, row in enumerate(rows) if len(row.tokens) + row.missing(p, start) <= row_tokens),
                        len(rows))
            if last == len(rows):
                rows.append(_Tree())
        local.append((last, rows[last].add(p, start)))
    offsets = [0]
    for row in rows[:-1]:
        offsets.append(offsets[-1] + len(row.tokens))
    return rows, [[offsets[r] + i for i in path] for r, path in local]


class Scorer:
    """Scores prompts with an :class:`~services.sampler.engine.Engine`'s model and a :class:`PrefixCache`."""

    def __init__(self, engine: Any, cache: PrefixCache, *, top_k_cached: int = 20,
                 max_forward_tokens: int = 4096, row_tokens: int = 192) -> None:
        self.engine, self.cache = engine, cache
        self.top_k_cached = top_k_cached  # alternatives kept per cached position (the server's max_logprobs)
        self.max_forward_tokens, self.row_tokens = max_forward_tokens, row_tokens
        self.softcap = getattr(engine.model.config, "final_logit_softcapping", None)
        params = inspect.signature(engine.model.get_decoder().forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def score(self, prompts: list[list[int]], ks: list[int | None],
              slot: str | None) -> tuple[list[Scored], ScoreInfo]:
        """Score ``prompts`` (``ks[i]`` alternatives per position for prompt i; None: lean, only the row
        after the prompt, no ``prompt_logprobs``) with ``slot``'s adapter active (None: the base model);
        one forward per group of about ``max_forward_tokens`` new tokens."""
        import torch

        t0 = time.perf_counter()
        info = ScoreInfo(prompt_tokens=sum(len(p) for p in prompts))
        out: list[Scored] = []
        with torch.inference_mode():
            model, key = self.engine.scoring_model(slot)  # the slot's merged copy, or peft with the slot active
            for lo, hi in _groups(prompts, self.max_forward_tokens):
                out += self._score_group(prompts[lo:hi], ks[lo:hi], model, key, info)
        info.seconds = time.perf_counter() - t0
        return out, info

    # ------------------------------------------------------------------ one forward
    def _score_group(self, prompts: list[list[int]], ks: list[int | None], model: Any, key: str | None,
                     info: ScoreInfo) -> list[Scored]:
        """One forward for ``prompts`` through ``model``; ``key`` names its prefix-cache entries."""
        common = prompts[0]
        c = n_min = min(len(p) for p in prompts)
        for p in prompts[1:]:
            c = shared_length(common[:c], p)
        need_stats = any(k is not None for k in ks)  # else every prompt is lean: only the last rows
        prefix, shared = self.cache.lookup(key, common[:c], stats=need_stats) if c else (None, 0)
        m = 0
        if prefix is not None:
            m = shared if shared == len(prefix.tokens) else shared - 1  # its last row, or recompute one
            m = max(0, min(m, n_min - 1))  # every prompt keeps at least its last token to forward
        if m == 0:
            prefix = None
        info.cache.append("miss" if prefix is None else "hit" if shared == len(prefix.tokens) else "partial")
        info.reused_tokens += m * len(prompts)
        head_stats = prefix.stats[:m] if prefix is not None and need_stats else []  # positions 0..min(m, T-1)-1
        after_prefix: dict[int, PositionStats] = {}  # position T-1, when all of the entry is used
        if need_stats and prefix is not None and m == len(prefix.tokens):
            k_last = max([*(k for k in ks if k is not None), self.top_k_cached])
            after_prefix = {t: _row_stats(prefix.last, t, k_last) for t in {p[m] for p in prompts}}

        rows, paths = _pack(prompts, m, self.row_tokens)
        n = sum(len(r.tokens) for r in rows)
        snapshots = sorted({ln for ln in (c, shared) if m < ln <= c and ln >= self.cache.min_tokens}) \
            if self.cache.capacity > 0 else []

        hidden, kv = self._forward(model.get_decoder(), rows, prefix, m)
        info.forwards += 1
        info.forwarded_tokens += n

        # what each node must report: the statistics of each following token, top-k, or its whole row
        wanted: list[list[int]] = [[] for _ in range(n)]
        k_need = [0] * n
        keep_row = [False] * n
        for p, k, path in zip(prompts, ks, paths):
            keep_row[path[-1]] = True
            if k is None:  # lean: nothing about its earlier tokens
                continue
            for j, node in enumerate(path[:-1]):
                if p[m + j + 1] not in wanted[node]:
                    wanted[node].append(p[m + j + 1])
                k_need[node] = max(k_need[node], k)
        if need_stats:  # the shared nodes the snapshots keep (a lean batch's snapshots keep no statistics)
            for node in range(max(snapshots, default=m + 1) - 1 - m):
                k_need[node] = max(k_need[node], self.top_k_cached)
        for ln in snapshots:
            keep_row[ln - 1 - m] = True
        node_stats, last_rows = self._head(model.get_output_embeddings(), hidden, wanted, k_need, keep_row)

        cached = head_stats + ([after_prefix[common[m]]] if after_prefix else [])  # positions 0..m-1
        for ln in snapshots:
            self.cache.put(key, Prefix(
                tokens=tuple(common[:ln]), keys=[k[:1, :, :ln].clone() for k in kv[0]],
                values=[v[:1, :, :ln].clone() for v in kv[1]],
                stats=cached + [node_stats[(i, common[m + i + 1])] for i in range(ln - 1 - m)] if need_stats else None,
                last=last_rows[ln - 1 - m]))

        results = []
        for p, k, path in zip(prompts, ks, paths):
            if k is None:
                results.append(Scored([], last_rows[path[-1]]))
                continue
            entries: list[list[tuple[int, float, int]] | None] = [None]
            for pos in range(1, len(p)):
                if pos - 1 < len(head_stats):
                    st = head_stats[pos - 1]
                elif pos - 1 < m:  # the cached entry's last row
                    st = after_prefix[p[pos]]
                else:
                    st = node_stats[(path[pos - 1 - m], p[pos])]
                entries.append(_entry(st, k))
            results.append(Scored(entries, last_rows[path[-1]]))
        return results

    def _forward(self, decoder: Any, rows: list[_Tree], prefix: Prefix | None,
                 m: int) -> tuple[Any, tuple[list[Any], list[Any]]]:
        """The decoder over the packed rows after ``m`` cached tokens: the last hidden state of every
        node ``[n, d]`` (flat, row after row) and the per-layer keys/values ``[rows, kv_heads, m + L, d]``."""
        import numpy as np
        import torch

        width = max(len(r.tokens) for r in rows)
        width += -(m + width) % KV_ALIGN  # nothing attends to the padding (its own rows are never read)
        dtype = decoder.dtype
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        seen_np = np.zeros((len(rows), width, width), dtype=bool)  # numpy: ~10x faster row by row than torch
        seen_np[:, np.arange(width), np.arange(width)] = True  # a token sees itself; padding no other
        for r, row in enumerate(rows):
            ids[r, :len(row.tokens)] = torch.tensor(row.tokens)
            positions[r, :len(row.tokens)] = torch.tensor(row.position)
            tree = seen_np[r]
            for i, parent in enumerate(row.parent):
                if parent >= 0:
                    tree[i] |= tree[parent]
        seen = torch.from_numpy(seen_np)
        mask = torch.zeros(len(rows), 1, width, m + width, dtype=dtype)
        mask[:, 0, :, m:].masked_fill_(~seen, torch.finfo(dtype).min)
        cache = self.engine._new_cache()
        if prefix is not None:
            for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):  # copied by the update
                cache.update(k[..., :m, :].expand(len(rows), -1, -1, -1),
                             v[..., :m, :].expand(len(rows), -1, -1, -1), layer)
        out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self._cache_kwarg: cache})
        hidden = torch.cat([out.last_hidden_state[r, :len(row.tokens)] for r, row in enumerate(rows)])
        return hidden, _cache_tensors(cache)

    def _head(self, head: Any, hidden: Any, wanted: list[list[int]], k_need: list[int],
              keep_row: list[bool]) -> tuple[dict[tuple[int, int], PositionStats], dict[int, Any]]:
        """Output layer + log-softmax over the nodes in chunks; keeps only the statistics asked for:
        per (node, following token) its logprob, rank and the node's top-k, and the rows asked for."""
        import torch

        stats: dict[tuple[int, int], PositionStats] = {}
        rows: dict[int, Any] = {}
        needed = [i for i in range(hidden.shape[0]) if wanted[i] or k_need[i] or keep_row[i]]
        if len(needed) < hidden.shape[0]:  # lean prompts' inner nodes: no output layer at all
            pick = torch.tensor(needed, dtype=torch.long)
            sub_stats, sub_rows = self._head(head, hidden.index_select(0, pick), [wanted[i] for i in needed],
                                             [k_need[i] for i in needed], [keep_row[i] for i in needed])
            stats = {(needed[i], t): st for (i, t), st in sub_stats.items()}
            return stats, {needed[i]: row for i, row in sub_rows.items()}
        for lo in range(0, hidden.shape[0], HEAD_CHUNK):
            hi = min(lo + HEAD_CHUNK, hidden.shape[0])
            logits = head(hidden[lo:hi]).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            lp = torch.log_softmax(logits, dim=-1)
            # each node's first following token on lp itself (rows without one compare to +inf) ...
            first = torch.full((hi - lo,), float("inf"))
            sel = [i - lo for i in range(lo, hi) if wanted[i]]
            toks = [wanted[i + lo][0] for i in sel]
            if sel:
                first[sel] = lp[sel, toks]
            ranks = (lp >= first[:, None]).sum(-1, dtype=torch.int32).tolist()
            values = first.tolist()
            found = {(i + lo, t): (values[i], ranks[i]) for i, t in zip(sel, toks)}
            # ... the other following tokens (a branch point: the candidates) on gathered rows
            extra = [(i, t) for i in range(lo, hi) for t in wanted[i][1:]]
            if extra:
                r = torch.tensor([i - lo for i, _ in extra])
                vals = lp[r, torch.tensor([t for _, t in extra])]
                ranks_e = (lp[r] >= vals[:, None]).sum(-1, dtype=torch.int32)
                found.update({pair: (v, rank) for pair, v, rank in zip(extra, vals.tolist(), ranks_e.tolist())})
            tops: dict[int, tuple[tuple[int, float], ...]] = {}
            need = [i - lo for i in range(lo, hi) if k_need[i]]
            if need:
                top_v, top_i = torch.topk(lp[need], min(max(k_need[lo:hi]), lp.shape[-1]), dim=-1)  # k ≤ vocabulary
                for j, i in enumerate(need):
                    k = k_need[i + lo]
                    tops[i + lo] = tuple(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
            for (i, t), (v, rank) in found.items():
                stats[(i, t)] = PositionStats(t, v, rank, tops.get(i, ()))
            for i in range(lo, hi):
                if keep_row[i]:
                    rows[i] = lp[i - lo].clone()
        return stats, rows


def _groups(prompts: list[list[int]], budget: int) -> list[tuple[int, int]]:
    """Consecutive ranges of prompts whose new tokens (each prompt's length less what it shares with
    the one before, an upper bound of its tree nodes) add up to about ``budget`` at most."""
    out, lo, total = [], 0, 0
    for i, p in enumerate(prompts):
        n = len(p) - (shared_length(p, prompts[i - 1]) if i > lo else 0)
        if i > lo and total + n > budget:
            out.append((lo, i))
            lo, total, n = i, 0, len(p)
        total += n
    out.append((lo, len(prompts)))
    return out


def _cache_tensors(cache: Any) -> tuple[list[Any], list[Any]]:
    """Per-layer key and value tensors of a DynamicCache (transformers 5 ``layers``, or 4.x lists)."""
    if hasattr(cache, "layers"):
        return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    return list(cache.key_cache), list(cache.value_cache)


def _row_stats(row: Any, token: int, k: int) -> PositionStats:
    import torch

    v = row[token]
    top = torch.topk(row, min(k, row.shape[-1])) if k else None  # k ≤ vocabulary
    return PositionStats(token, float(v), int((row >= v).sum()),
                         tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())


def _entry(st: PositionStats, k: int) -> list[tuple[int, float, int]]:
    """vLLM's order: the actual token (its own rank) first, then the top-k others with ranks 1..k."""
    out = [(st.token, st.logprob, st.rank)]
    out += [(tok, lp, r) for r, (tok, lp) in enumerate(st.top[:k], start=1) if tok != st.token]
    return out
