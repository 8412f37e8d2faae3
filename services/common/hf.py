"""One process-wide lock around every Hugging Face model load, and a check that tying still works.

Why: transformers 5 builds a model inside ``initialization.no_tie_weights()``, which swaps the
*class attribute* ``PreTrainedModel.tie_weights`` for a no-op and puts back whatever it saved on
exit. Two loads in two threads interleave as enter A, enter B (B saves A's no-op), exit A, exit B
(B restores the no-op): from then on no model in the process ties its output layer. That is how a
fresh ``make demo`` died: the gateway started two dense providers at once (two concurrent
sentence-transformers loads), and the trainer's GGUF load later found ``lm_head.weight`` MISSING,
left on the meta device ("Cannot copy out of meta tensor"). Standalone runs had no second load,
so they worked. Serialising the loads removes the race; :func:`restore_tie_weights` repairs a
process poisoned by a load that did not take the lock (someone else's code) and says so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Held for the whole of every model/adapter load this project does (re-entrant: a load may nest one).
LOAD_LOCK = threading.RLock()
_ORIGINAL: dict[str, Any] = {}


def _pretrained_class() -> Any:
    from transformers import PreTrainedModel

    return PreTrainedModel


def _remember_original() -> None:
    """Keep the real ``tie_weights`` the first time we see it (before any load of ours)."""
    if "tie_weights" not in _ORIGINAL:
        fn = _pretrained_class().__dict__["tie_weights"]
        if getattr(fn, "__name__", "") == "tie_weights":
            _ORIGINAL["tie_weights"] = fn


def restore_tie_weights() -> bool:
    """Put the real ``PreTrainedModel.tie_weights`` back if a racing load left a no-op there; True if it had to."""
    cls = _pretrained_class()
    original = _ORIGINAL.get("tie_weights")
    current = cls.__dict__.get("tie_weights")
    if original is None or current is original:
        return False
    log.warning("PreTrainedModel.tie_weights was left replaced by %r (a concurrent model load outside "
                "services.common.hf.model_loading); restoring it", current)
    cls.tie_weights = original
    return True


@contextlib.contextmanager
def model_loading() -> Iterator[None]:
    """Hold :data:`LOAD_LOCK` for a model load and check the tie machinery before and after."""
    with LOAD_LOCK:
        _remember_original()
        restore_tie_weights()
        try:
            yield
        finally:
            restore_tie_weights()
