"""The publisher on the in-memory bus and stamp store: blobs, versions, retention, client, export."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas import AdapterPublished, topic
from services.common.adapter_files import HashMismatch
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.publisher_client import PublisherClient, PublisherClientError
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import MemoryStampStore
from services.publisher.app import Publisher, create_app
from services.publisher.export import export_merged, export_peft
from services.publisher.settings import PublisherSettings
from services.publisher.store import BlobStore, ManifestStore, retention_victims

BASE = "http://testserver"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FlakyBus(Bus):
    """Refuses the first ``failures`` publishes, like a broker that is briefly away."""

    failures = 0

    async def publish(self, spec, message) -> None:
        if self.failures:
            self.failures -= 1
            raise BusError("publish to adapters failed: KafkaTimeoutError")
        await super().publish(spec, message)


class Harness:
    """A running publisher app, its HTTP client, our PublisherClient and the messages it sent."""

    def __init__(self, tmp_path: Path, **overrides) -> None:
        self.settings = PublisherSettings(
            kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
            storage_dir=tmp_path / "store", public_url=BASE, **overrides)
        self.clock = [0.0]
        self.stamps = MemoryStampStore(clock=lambda: self.clock[0])
        self.bus = FlakyBus(self.settings.kafka)
        self.publisher = Publisher(self.settings, self.bus, self.stamps)
        self.messages: list[AdapterPublished] = []

        async def on_message(m: AdapterPublished) -> None:
            self.messages.append(m)

        self.bus.subscribe(topic("adapters"), on_message, group_id="test")
        self.http = TestClient(create_app(self.settings, publisher=self.publisher), base_url=BASE)
        self.client = PublisherClient(BASE, http=self.http)
        self.tmp = tmp_path

    def adapter_dir(self, tag: str, **extra: bytes) -> Path:
        """A PEFT-shaped directory whose weights differ per ``tag`` (the config is shared)."""
        d = self.tmp / f"adapter-{tag}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (d / "adapter_model.safetensors").write_bytes(f"weights {tag}".encode() * 100)
        for name, data in extra.items():
            (d / name).write_bytes(data)
        return d

    def upload(self, *blobs: bytes) -> dict[str, str]:
        for data in blobs:
            assert self.http.put(f"/v1/blobs/{sha(data)}", content=data).status_code in (200, 201)
        return {f"f{i}": sha(b) for i, b in enumerate(blobs)}


@pytest.fixture
def harness(tmp_path, request):
    h = Harness(tmp_path, **getattr(request, "param", {}))
    with h.http:
        yield h


def _refused(r, status: int, error: str, *in_reason: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == error and body["reason"], body
    for part in in_reason:
        assert part in body["reason"], body["reason"]
    return body["reason"]


# --------------------------------------------------------------------------- blobs


def test_blob_put_is_verified_idempotent_and_readable(harness):
    data = b"some adapter bytes"
    r = harness.http.put(f"/v1/blobs/{sha(data)}", content=data)
    assert r.status_code == 201 and r.json() == {"sha256": sha(data), "created": True}
    assert harness.http.put(f"/v1/blobs/{sha(data)}", content=data).status_code == 200
    got = harness.http.get(f"/v1/blobs/{sha(data)}")
    assert got.status_code == 200 and got.content == data
    _refused(harness.http.put(f"/v1/blobs/{sha(b'other')}", content=data), 400, "hash_mismatch",
             sha(data), sha(b"other"))
    assert not harness.publisher.blobs.has(sha(b"other"))
    _refused(harness.http.put("/v1/blobs/not-a-hash", content=data), 422, "invalid_request", "sha256")
    _refused(harness.http.get(f"/v1/blobs/{sha(b'never')}"), 404, "not_found")
    assert not list(harness.publisher.blobs.root.glob(".upload-*")), "temporary upload left behind"


@pytest.mark.parametrize("harness", [{"max_blob_bytes": 1024, "max_json_bytes": 1024}], indirect=True)
def test_bodies_over_their_limit_are_413(harness):
    big = b"x" * 2000
    _refused(harness.http.put(f"/v1/blobs/{sha(big)}", content=big), 413, "body_too_large", "1024")
    # Streamed without a content-length: refused while reading, nothing kept.
    _refused(harness.http.put(f"/v1/blobs/{sha(big)}", content=iter([big[:1000], big[1000:]])),
             413, "body_too_large")
    assert not list(harness.publisher.blobs.shas())
    body = {"base_model": "m", "files": {}, "metrics": {"x": 1.0}, "run_id": "r" * 2000}
    _refused(harness.http.post("/v1/adapters/router/versions", json=body), 413, "body_too_large")


# --------------------------------------------------------------------------- versions


def test_publish_stamps_stores_and_announces(harness):
    assert harness.client.stamp("router") == 0
    msg = harness.client.publish("router", harness.adapter_dir("a", **{"README.md": b"# card"}),
                                 "smollm2-135m", {"ndcg": 0.61}, run_id="run-1")
    assert msg["version"] == 1 and msg["promoted"] is False and msg["metrics"] == {"ndcg": 0.61}
    assert msg["url"] == f"{BASE}/v1/adapters/router/versions/1"
    assert set(msg["files_sha256"]) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert [m.model_dump(mode="json") for m in harness.messages] == [msg]
    assert harness.client.stamp("router") == 1
    manifest = harness.client.manifest("router", 1)
    assert manifest["files_sha256"] == msg["files_sha256"] and manifest["run_id"] == "run-1"
    assert manifest["file_urls"]["README.md"] == f"{msg['url']}/files/README.md"
    assert harness.http.get(manifest["file_urls"]["README.md"]).content == b"# card"
    assert harness.http.get(f"{msg['url']}/README.md").content == b"# card"  # <message url>/<name>
    assert [v["version"] for v in harness.client.versions("router")] == [1]
    _refused(harness.http.get(f"{msg['url']}/files/nope.json"), 404, "not_found", "nope.json")
    _refused(harness.http.get("/v1/adapters/router/versions/9"), 404, "not_found")


def test_version_with_missing_blobs_is_409_naming_them(harness):
    have = b"config"
    harness.upload(have)
    files = {"adapter_config.json": sha(have), "adapter_model.safetensors": sha(b"never uploaded")}
    r = harness.http.post("/v1/adapters/router/versions", json={"base_model": "m", "files": files})
    _refused(r, 409, "missing_blobs", f"adapter_model.safetensors={sha(b'never uploaded')}")
    assert "adapter_config.json" not in r.json()["reason"]
    assert harness.client.stamp("router") == 0 and not harness.messages


@pytest.mark.parametrize("files, why", [
    ({"../adapter_config.json": "0" * 64}, "path separators"),
    ({"sub/adapter_model.safetensors": "0" * 64}, "path separators"),
    ({"adapter_config.json": "0" * 64, "adapter_model.safetensors": "0" * 64,
      "training_args.bin": "0" * 64}, "training_args.bin"),
    ({"adapter_config.json": "0" * 64}, "adapter_model.safetensors"),
    ({"adapter_config.json": "0" * 64, "adapter_model.safetensors": "ABC"}, "not a sha256"),
])
def test_files_that_are_not_a_plain_peft_adapter_are_400(harness, files, why):
    r = harness.http.post("/v1/adapters/router/versions", json={"base_model": "m", "files": files})
    _refused(r, 400, "bad_files", why)
    assert harness.client.stamp("router") == 0


def test_same_content_again_returns_the_existing_version(harness):
    d = harness.adapter_dir("a")
    first = harness.client.publish("router", d, "base", {"ndcg": 0.5})
    again = harness.http.post("/v1/adapters/router/versions", json={
        "base_model": "base", "files": first["files_sha256"], "metrics": {"ndcg": 0.9}})
    assert again.status_code == 200 and again.json() == first
    assert harness.client.publish("router", d, "base", {})["version"] == 1
    assert harness.client.stamp("router") == 1 and len(harness.messages) == 1
    # Another base model or model id is another version.
    assert harness.client.publish("router", d, "other-base", {})["version"] == 2
    assert harness.client.publish("router-b", d, "base", {})["version"] == 1


@pytest.mark.parametrize("body, status, error, where", [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b'{"base_model": "m", "files": {"a": 1}}', 422, "invalid_request", "files"),
    (b'{"base_model": "m", "files": {"adapter_config.json": "x"}, "extra": 1}', 422, "invalid_request", "extra"),
    (b'{"files": {"adapter_config.json": "x"}}', 422, "invalid_request", "base_model"),
])
def test_malformed_version_requests_are_4xx_with_reason(harness, body, status, error, where):
    r = harness.http.post("/v1/adapters/router/versions", content=body,
                          headers={"content-type": "application/json"})
    _refused(r, status, error, where)


def test_bad_model_id_is_422_and_unknown_routes_404(harness):
    _refused(harness.http.get("/v1/adapters/..etc/versions"), 422, "invalid_request", "model_id")
    _refused(harness.http.get("/v1/adapters/..%2Fetc/versions"), 404, "not_found")


def test_unacked_announcement_is_503_and_a_retry_announces_it(harness):
    harness.bus.failures = 1
    d = harness.adapter_dir("a")
    with pytest.raises(PublisherClientError) as err:
        harness.client.publish("router", d, "base", {})
    assert err.value.status == 503 and "retry" in str(err.value)
    assert not harness.messages
    msg = harness.client.publish("router", d, "base", {})
    assert msg["version"] == 1 and [m.version for m in harness.messages] == [1]
    assert harness.client.publish("router", d, "base", {})["version"] == 1
    assert len(harness.messages) == 1 and harness.client.stamp("router") == 1


# --------------------------------------------------------------------------- promotion, serving, retention


@pytest.mark.parametrize("harness", [{"keep_versions": 2, "orphan_grace_s": 0}], indirect=True)
def test_retention_keeps_newest_promoted_and_served_versions(harness):
    c = harness.client
    published = {}
    for i in range(1, 6):
        published[i] = c.publish("router", harness.adapter_dir(str(i)), "base", {})
        assert published[i]["version"] == i
        if i == 1:
            promoted = c.promote("router", 1)
            assert promoted["promoted"] is True and promoted["version"] == 1
        if i == 2:
            c.report_serving("sampler-0", "router", 2)
    assert [v["version"] for v in c.versions("router")] == [1, 2, 4, 5]
    assert [v["promoted"] for v in c.versions("router")] == [True, False, False, False]
    assert c.http.get("/v1/adapters/router/serving").json() == {"sampler-0": 2}
    blobs = harness.publisher.blobs
    weights = lambda i: published[i]["files_sha256"]["adapter_model.safetensors"]  # noqa: E731
    assert not blobs.has(weights(3)), "the dropped version's own blob was not deleted"
    assert all(blobs.has(weights(i)) for i in (1, 2, 4, 5))
    assert blobs.has(published[3]["files_sha256"]["adapter_config.json"]), "a shared blob was deleted"
    _refused(c.http.get("/v1/adapters/router/versions/3"), 404, "not_found")
    assert [(m.version, m.promoted) for m in harness.messages] == [
        (1, False), (1, True), (2, False), (3, False), (4, False), (5, False)]

    # The serving report expires: the next publish may then drop version 2 (1 stays promoted).
    harness.clock[0] += harness.settings.serving_ttl_s + 1
    c.publish("router", harness.adapter_dir("6"), "base", {})
    assert [v["version"] for v in c.versions("router")] == [1, 5, 6]


def test_promote_and_serving_need_an_existing_version(harness):
    _refused(harness.http.post("/v1/adapters/router/promote", json={"version": 3}), 404, "not_found")
    r = harness.http.post("/v1/serving", json={"sampler_id": "s", "model_id": "router", "version": 3})
    _refused(r, 404, "not_found")
    _refused(harness.http.post("/v1/serving", json={"sampler_id": "s", "model_id": "router"}),
             422, "invalid_request", "version")


def test_promotion_stores_evidence_fallback_and_redis_record(harness):
    c = harness.client
    assert c.promoted("router") is None
    c.publish("router", harness.adapter_dir("1"), "base", {})
    c.publish("router", harness.adapter_dir("2"), "base", {})
    evidence = {"candidate": {"human": 0.6, "judge": 2.1}, "best_single": {"human": 0.5, "judge": 1.9}}
    msg = c.promote("router", 2, fallback_provider="bm25-all", evidence=evidence)
    assert msg["promoted"] is True and msg["fallback_provider"] == "bm25-all"
    record = c.promoted("router")
    assert (record["version"], record["fallback_provider"], record["evidence"]) == (2, "bm25-all", evidence)
    assert harness.messages[-1].fallback_provider == "bm25-all"
    assert asyncio.run(harness.stamps.promoted("router")) == (2, "bm25-all")
    c.promote("router", 1)  # a rollback is a promotion of an older version
    assert c.promoted("router")["version"] == 1 and asyncio.run(harness.stamps.promoted("router")) == (1, None)
    assert [v["version"] for v in c.versions("router")] == [1, 2], "the promotion file is not a version"
    _refused(harness.http.post("/v1/adapters/router/promote", json={"version": 1, "evidence": "x"}),
             422, "invalid_request", "evidence")


def test_retention_victims():
    assert retention_victims([1, 2, 3, 4, 5], keep=2, pinned={1, 3}) == [2]
    assert retention_victims([3, 1, 2], keep=5, pinned=set()) == []


# --------------------------------------------------------------------------- client fetch and export


def test_fetch_version_verifies_every_hash(harness, tmp_path):
    msg = harness.client.publish("router", harness.adapter_dir("a"), "base", {})
    dest = tmp_path / "pulled" / "router-v1"
    assert harness.client.fetch_version("router", 1, dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == sorted(msg["files_sha256"])
    assert harness.client.fetch_version("router", 1, dest) == dest  # already there: untouched
    empty = tmp_path / "pulled" / "empty"
    empty.mkdir()
    assert sorted(p.name for p in harness.client.fetch_version("router", 1, empty).iterdir()) == sorted(
        msg["files_sha256"]), "an empty destination (the sampler's partial dir) is filled"
    again = harness.client.fetch_url(msg["url"], tmp_path / "pulled" / "by-url",
                                     expect_sha256=msg["files_sha256"])
    assert (again / "adapter_model.safetensors").read_bytes() == (dest / "adapter_model.safetensors").read_bytes()

    # The publisher now serves tampered bytes for the weights.
    blob = harness.publisher.blobs.path(msg["files_sha256"]["adapter_model.safetensors"])
    blob.write_bytes(b"tampered" + blob.read_bytes()[8:])
    fresh = tmp_path / "pulled" / "router-v1-again"
    with pytest.raises(HashMismatch, match="adapter_model.safetensors"):
        harness.client.fetch_version("router", 1, fresh)
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["by-url", "empty", "router-v1"], "half-written"
    (dest / "adapter_config.json").write_text("{}")
    with pytest.raises(FileExistsError):  # an existing directory with other content is not overwritten
        harness.client.fetch_version("router", 1, dest)


def test_export_peft_writes_the_directory_as_published(harness, tmp_path):
    src = harness.adapter_dir("a", **{"README.md": b"# card"})
    harness.client.publish("router", src, "base", {})
    root = harness.settings.storage_dir
    out = export_peft(ManifestStore(root).get("router", 1), BlobStore(root), tmp_path / "export")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}


def test_export_merged_matches_base_plus_adapter(harness, tmp_path):
    """A real peft-saved adapter goes through publish and fetch, then merges into its base."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      init_lora_weights=False, task_type="CAUSAL_LM")  # random B: the adapter does something
    get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora).save_pretrained(
        tmp_path / "adapter")

    harness.client.publish("tiny", tmp_path / "adapter", "tiny-llama", {})
    pulled = harness.client.fetch_version("tiny", 1, tmp_path / "pulled")
    out = export_merged(tmp_path / "base", pulled, tmp_path / "merged")
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        plain = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert (with_adapter - plain).abs().max() > 1e-3, "the adapter should change the logits"
    assert torch.allclose(merged, with_adapter, atol=1e-4), (merged - with_adapter).abs().max()
    with pytest.raises(FileExistsError):
        export_merged(tmp_path / "base", tmp_path / "adapter", out)


def test_a_stamp_redis_lost_never_renames_stored_content(harness):
    """Redis forgets (a restart without persistence, FLUSHALL): the next version is the stored newest + 1,
    never a second ``router@1``; the lost stamp and promotion are put back from the manifests."""
    c = harness.client
    c.publish("router", harness.adapter_dir("1"), "base", {})
    c.publish("router", harness.adapter_dir("2"), "base", {})
    c.promote("router", 2, fallback_provider="bm25-all")
    harness.stamps.stamps.clear()
    harness.stamps.promotions.clear()  # what FLUSHALL does to both keys
    assert asyncio.run(harness.publisher.reconcile()) == 2
    assert harness.client.stamp("router") == 2 and asyncio.run(harness.stamps.promoted("router")) == (2, "bm25-all")
    harness.stamps.stamps.clear()  # lost again, before a publish this time
    msg = c.publish("router", harness.adapter_dir("3"), "base", {})
    assert msg["version"] == 3 and harness.client.stamp("router") == 3
    assert [harness.client.manifest("router", v)["files_sha256"] != msg["files_sha256"] for v in (1, 2)] == [True] * 2
    metrics = harness.http.get("/metrics").text
    assert "fanroute_publisher_stamps_restored_total 3.0" in metrics


def test_a_version_number_that_names_other_content_is_refused(harness):
    from services.publisher.store import VersionTaken

    harness.client.publish("router", harness.adapter_dir("1"), "base", {})

    async def stamp_behind(model_id: str, *_: int) -> int:  # a stamp store that keeps answering 1
        return 1

    harness.stamps.incr = stamp_behind
    harness.stamps.raise_to = stamp_behind
    with pytest.raises(VersionTaken, match="v1 already names other content"):
        asyncio.run(harness.publisher._next_version("router"))
