"""The model-load race that broke a fresh ``make demo``, and the lock that removes it.

transformers 5 swaps the class attribute ``PreTrainedModel.tie_weights`` for a no-op while it
builds a model; two interleaved loads leave the no-op in place for good, and every later load in
the process has an untied, uninitialised output layer. ``services.common.hf`` serialises our loads
and repairs a poisoned class.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.common import hf
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def poison() -> None:
    """The interleaving two unlocked loads go through: enter A, enter B, exit A, exit B."""
    from transformers import initialization

    with hf.model_loading():  # the loader learns the real tie_weights before anything breaks it
        pass
    a, b = initialization.no_tie_weights(), initialization.no_tie_weights()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)


def test_interleaved_unlocked_loads_disable_tying_and_the_loader_repairs_it(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from services.models.load import load_causal_lm

    real = PreTrainedModel.__dict__["tie_weights"]
    try:
        poison()
        assert PreTrainedModel.__dict__["tie_weights"] is not real  # the bug, reproduced
        plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)  # no lock: broken load
        assert plain.lm_head.weight.data_ptr() != plain.model.embed_tokens.weight.data_ptr()
        model = load_causal_lm(tiny, torch.float32)  # ours: repaired before loading
        assert PreTrainedModel.__dict__["tie_weights"] is real
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    finally:
        PreTrainedModel.tie_weights = real


def test_loads_are_serialised() -> None:
    inside, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with hf.model_loading():
            inside.set()
            release.wait(10)

    def second() -> None:
        with hf.model_loading():
            second_in.set()

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(10)
    t2 = threading.Thread(target=second)
    t2.start()
    assert not second_in.wait(0.3)  # blocked while the first load holds the lock
    release.set()
    assert second_in.wait(10)
    t1.join(10)
    t2.join(10)


def test_concurrent_dense_model_loads_leave_tying_intact(tmp_path: Path) -> None:
    """Two providers starting at once (the demo's gateway) load MiniLM once, in turn."""
    from transformers import PreTrainedModel

    from services.providers import index as idx

    with hf.model_loading():
        pass
    real = PreTrainedModel.__dict__["tie_weights"]
    path = idx.default_model_path().resolve()
    idx._load_model.cache_clear()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(idx.load_model(path, 64))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 3 and all(m is got[0] for m in got)
    assert PreTrainedModel.__dict__["tie_weights"] is real


def test_check_weights_refuses_an_untied_or_empty_output_layer(tiny: Path) -> None:
    import torch

    from services.models.load import load_causal_lm
    from services.models.prepare import PrepareError, check_weights

    model = load_causal_lm(tiny, torch.float32)
    check_weights(model)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    with pytest.raises(PrepareError, match="separate matrix"):
        check_weights(model)
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    with pytest.raises(PrepareError, match="no data"):
        check_weights(model)


def test_a_missing_model_directory_says_what_to_run(tmp_path, monkeypatch) -> None:
    """The newcomer's crash: the sampler's default directory not prepared yet -> an actionable ConfigError."""
    from services.common import paths
    from services.common.errors import ConfigError
    from services.models.load import require_local

    monkeypatch.setenv(paths.MODELS_DIR_ENV, str(tmp_path / "models"))
    with pytest.raises(ConfigError, match="fanroute models prepare"):
        require_local(paths.default_base_dir())
    with pytest.raises(ConfigError, match="set FANROUTE_TOKENIZER"):
        require_local(tmp_path / "elsewhere", "FANROUTE_TOKENIZER")
    assert require_local("org/some-model") == "org/some-model"  # a hub id is transformers' to resolve
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert require_local(tmp_path / "m") == str(tmp_path / "m")
