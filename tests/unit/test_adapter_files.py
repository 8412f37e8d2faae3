"""An adapter's content digest: what the sampler names in its answers, equal for a manifest and the
directory it was materialised into, blind to files that change nothing served."""

from __future__ import annotations

import hashlib

from services.common.adapter_files import content_digest, dir_digest


def _write(d, files: dict[str, bytes]) -> dict[str, str]:
    d.mkdir()
    for name, body in files.items():
        (d / name).write_bytes(body)
    return {name: hashlib.sha256(body).hexdigest() for name, body in files.items()}


def test_a_manifest_and_its_directory_have_one_digest(tmp_path):
    files = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"w1", "README.md": b"card"}
    manifest = _write(tmp_path / "a", files)
    assert content_digest(manifest) == dir_digest(tmp_path / "a")
    assert content_digest(dict(reversed(list(manifest.items())))) == content_digest(manifest)  # order-free
    without_card = {k: v for k, v in manifest.items() if k != "README.md"}
    assert content_digest(without_card) == content_digest(manifest)  # the card serves nothing


def test_other_weights_or_config_are_another_digest(tmp_path):
    one = _write(tmp_path / "a", {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"w1"})
    weights = _write(tmp_path / "b", {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"w2"})
    config = _write(tmp_path / "c", {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w1"})
    digests = {content_digest(m) for m in (one, weights, config)}
    assert len(digests) == 3 and all(len(d) == 64 for d in digests)
