"""An adapter trained on another base is refused before peft loads it (peft would load it without an error):
the shared check, the sampler's slots, the trainer's ``init_adapter`` and the merged export."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.models.adapters import AdapterMismatchError, check_adapter_fits, saved_modules
from tests.support.tiny_model import build_lora_adapter, build_tiny_model
from tests.support.trainer_runs import episode, make_settings, tiny  # noqa: F401  (fixtures by name)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny bases that differ only in depth (3 and 2 decoder layers), and an adapter for each."""
    root = tmp_path_factory.mktemp("adapters")
    deep, shallow = build_tiny_model(root / "deep", layers=3), build_tiny_model(root / "shallow", layers=2)
    return {"deep": deep, "shallow": shallow,
            "deep-lora": build_lora_adapter(deep, root / "deep-lora", seed=1),
            "shallow-lora": build_lora_adapter(shallow, root / "shallow-lora", seed=1)}


def load(path: Path):
    import torch

    from services.models.load import load_causal_lm

    return load_causal_lm(path, torch.float32)


def test_an_adapter_fits_its_own_base_and_not_one_of_another_depth(models: dict[str, Path]):
    assert "model.layers.2.self_attn.q_proj" in saved_modules(models["deep-lora"])
    check_adapter_fits(load(models["deep"]), models["deep-lora"])
    check_adapter_fits(load(models["shallow"]), models["shallow-lora"])
    with pytest.raises(AdapterMismatchError, match=r"3 weight\(s\) for modules this base lacks "
                                                   r"\(e.g. model.layers.2.self_attn.o_proj\)"):
        check_adapter_fits(load(models["shallow"]), models["deep-lora"])
    with pytest.raises(AdapterMismatchError, match=r"no weights for 3 of its 9 target modules "
                                                   r"\(e.g. model.layers.2.self_attn.o_proj\)"):
        check_adapter_fits(load(models["deep"]), models["shallow-lora"])


def test_a_base_that_already_holds_adapters_is_matched_by_the_same_names(models: dict[str, Path], tmp_path: Path):
    """The sampler checks its second adapter against a model peft has wrapped; a regex target list too."""
    import json

    from peft import PeftModel

    base = load(models["deep"])
    PeftModel.from_pretrained(base, str(models["deep-lora"]), adapter_name="a")
    check_adapter_fits(base, build_lora_adapter(models["deep"], tmp_path / "kv", seed=2, targets=("k_proj", "v_proj")))
    regex = tmp_path / "regex"
    build_lora_adapter(models["deep"], regex, seed=3, targets=("q_proj",))
    config = json.loads((regex / "adapter_config.json").read_text())
    (regex / "adapter_config.json").write_text(json.dumps(config | {"target_modules": r".*\.q_proj"}))
    check_adapter_fits(base, regex)
    with pytest.raises(AdapterMismatchError, match="no weights for 1 of its 3"):
        check_adapter_fits(base, _regex_copy(tmp_path, models))
    dotted = build_lora_adapter(models["deep"], tmp_path / "dotted", seed=5, targets=("self_attn.v_proj",))
    check_adapter_fits(base, dotted)  # peft's "ends with" rule, not only the last name


def _regex_copy(tmp_path: Path, models: dict[str, Path]) -> Path:
    """The shallow base's q_proj adapter with a regex target list."""
    import json

    out = build_lora_adapter(models["shallow"], tmp_path / "short-regex", seed=4, targets=("q_proj",))
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | {"target_modules": r".*\.q_proj"}))
    return out


def test_a_missing_or_unreadable_adapter_is_named(models: dict[str, Path], tmp_path: Path):
    with pytest.raises(AdapterMismatchError, match="unreadable adapter_config.json"):
        check_adapter_fits(load(models["deep"]), tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"target_modules": ["q_proj"]}')
    with pytest.raises(AdapterMismatchError, match="no adapter_model.safetensors or adapter_model.bin"):
        check_adapter_fits(load(models["deep"]), tmp_path)


def test_the_sampler_refuses_another_base_s_adapter_and_keeps_serving_what_it_had(models: dict[str, Path]):
    from services.sampler.engine import Engine
    from services.sampler.registry import AdapterError

    eng = Engine(models["deep"])
    eng.load_adapter("good", models["deep-lora"])
    with pytest.raises(AdapterError, match="does not fit this base model"):
        eng.load_adapter("wrong", models["shallow-lora"])
    assert eng.slots == ["good"]  # no half-loaded slot, and the loaded one stays


def test_the_trainer_refuses_an_init_adapter_of_another_base(models: dict[str, Path], make_settings):
    from services.common.errors import ConfigError
    from services.trainer.train import train

    eps = [episode(i, query="protein heart", answer="gamma > beta > alpha") for i in range(4)]
    with pytest.raises(ConfigError, match=r"init_adapter: .*does not fit this base model"):
        train(make_settings(eps, base_model=str(models["deep"]), init_adapter=models["shallow-lora"]))


def test_the_merged_export_refuses_another_base_s_adapter(models: dict[str, Path], tmp_path: Path):
    from services.publisher.export import export_merged

    with pytest.raises(AdapterMismatchError, match="does not fit this base model"):
        export_merged(models["shallow"], models["deep-lora"], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
