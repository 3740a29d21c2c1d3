"""Model ids from the Hugging Face Hub (`assets.resolve_model`), never over the network: every test runs with
HF_HUB_OFFLINE=1 and a Hub cache laid out here (tiny-qwen3's files as the snapshot of `fake-org/tiny-qwen3`).
A Hub id generates what the asset's folder does (LLM, a draft model, `nanoengine serve`); an id not in the
cache, a snapshot without config.json and an id the Hub refuses are errors naming the id and the ways out;
a local folder comes before the Hub; strings that are not `org/name` never reach huggingface_hub."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from nanoengine import LLM, SamplingParams, assets, hub
from nanoengine.errors import ModelNotFoundError

HUB_ID = "fake-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENGINE = dict(dtype="float32", num_kvcache_blocks=64, max_model_len=256)


def lay_out_hub_cache(root: Path, repo_id: str, files: Path, commit: str = COMMIT) -> Path:
    """The Hub cache's layout for one snapshot (huggingface_hub's own): models--org--name/snapshots/<commit>/
    holding the files (links here), refs/main naming the commit."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_qwen3_path) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE/HF_HOME in tmp_path, for this process (huggingface_hub read its
    constants at import) and its children; the snapshot of HUB_ID in it."""
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(root))
    lay_out_hub_cache(root, HUB_ID, tiny_qwen3_path)
    return root


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_hub_id_in_the_cache_generates_what_the_assets_folder_does(hub_cache, tiny_qwen3_path):
    folder = assets.resolve_model(HUB_ID)
    assert folder == hub_cache / f"models--fake-org--tiny-qwen3/snapshots/{COMMIT}"
    prompts = ["The capital of France is", "1, 2, 3,"]
    want = greedy_tokens(LLM(str(tiny_qwen3_path), **ENGINE), prompts)
    llm = LLM(HUB_ID, **ENGINE)
    assert llm.plan.model == HUB_ID and llm.plan.model_path == folder
    assert greedy_tokens(llm, prompts) == want


@pytest.mark.slow
def test_a_draft_model_may_be_a_hub_id(hub_cache):
    """speculative_config's model resolves in the same place: the target's own weights as the draft."""
    prompts = ["The paged KV cache stores keys and values in blocks"]
    want = greedy_tokens(LLM("tiny-qwen3", **ENGINE), prompts, max_tokens=8)
    spec = LLM("tiny-qwen3", speculative_config={"method": "draft_model", "model": HUB_ID,
                                                 "num_speculative_tokens": 3}, **ENGINE)
    assert greedy_tokens(spec, prompts, max_tokens=8) == want
    assert spec.engine.drafts.proposer.engine.plan.model_path == assets.resolve_model(HUB_ID)
    counts = spec.engine.spec_counts
    assert counts.proposed > 0 and counts.accepted == counts.proposed  # the same weights agree on every token


def test_an_id_not_in_the_cache_names_the_id_the_cache_and_both_ways_out(hub_cache):
    with pytest.raises(ModelNotFoundError) as e:
        LLM("fake-org/not-downloaded", **ENGINE)
    message = str(e.value)
    for words in ("'fake-org/not-downloaded'", "no local folder", "HF_HUB_OFFLINE=1", str(hub_cache),
                  "hf download fake-org/not-downloaded", "unset HF_HUB_OFFLINE", "local checkpoint folder"):
        assert words in message, (words, message)


def test_the_command_line_names_the_missing_id(hub_cache, capsys):
    from nanoengine.cli import main

    assert main(["generate", "hi", "--model", "fake-org/not-downloaded"]) == 2
    err = capsys.readouterr().err
    assert "fake-org/not-downloaded" in err and "hf download" in err and "Traceback" not in err


def test_a_local_folder_comes_before_the_hub(hub_cache, tiny_qwen3_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "fake-org" / "tiny-qwen3"
    local.mkdir(parents=True)
    (local / "config.json").write_text((tiny_qwen3_path / "config.json").read_text())
    assert assets.resolve_model(HUB_ID) == Path(HUB_ID)  # the folder, not the cached snapshot
    (local / "config.json").unlink()  # a folder of that name without a checkpoint: its own error, no Hub
    with pytest.raises(ModelNotFoundError, match=r"model folder 'fake-org/tiny-qwen3' has no config\.json"):
        assets.resolve_model(HUB_ID)


def test_only_org_slash_name_reaches_the_hub(hub_cache, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError(f"snapshot_download({args}, {kwargs}) was called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    for name in ("/no/such/model", "a/b/c", "./fake-org/x", "no-such-asset", "org/../name", "org--x/name"):
        with pytest.raises(ModelNotFoundError, match="not a local Hugging Face model folder"):
            assets.resolve_model(name)


def test_online_the_hub_is_asked_for_the_checkpoints_files_and_its_refusal_is_named(hub_cache, monkeypatch):
    """Online (HF_HUB_OFFLINE unset), with huggingface_hub's download stubbed: what is asked for, and the
    error when the Hub says no."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    calls = []

    def refuse(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        raise OSError("401 Client Error: Repository Not Found for url: https://huggingface.co/api/models/x")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelNotFoundError) as e:
        assets.resolve_model("fake-org/private")
    assert calls == [("fake-org/private", {"allow_patterns": hub.HUB_PATTERNS, "local_files_only": False})]
    wanted = {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
              "chat_template.jinja"}
    others = {"pytorch_model.bin", "model.gguf", "README.md", "onnx/model.onnx"}  # other copies, docs
    fetched = {f for f in wanted | others if any(fnmatch.fnmatch(f, p) for p in hub.HUB_PATTERNS)}
    assert fetched == wanted
    message = str(e.value)
    assert "'fake-org/private'" in message and "Repository Not Found" in message and "HF_TOKEN" in message


def test_a_snapshot_without_config_json_is_refused(hub_cache, tmp_path):
    only_tokenizer = tmp_path / "tok"
    only_tokenizer.mkdir()
    (only_tokenizer / "tokenizer.json").write_text("{}")
    lay_out_hub_cache(hub_cache, "fake-org/just-a-tokenizer", only_tokenizer)
    with pytest.raises(ModelNotFoundError, match="'fake-org/just-a-tokenizer': its Hugging Face Hub snap"):
        assets.resolve_model("fake-org/just-a-tokenizer")


@pytest.mark.slow
def test_nanoengine_serve_takes_a_hub_id(hub_cache):
    """`nanoengine serve fake-org/tiny-qwen3` in a subprocess (offline, this test's cache): it serves the id
    under that name and answers as the asset does."""
    from serve_proc import Server

    want = greedy_tokens(LLM("tiny-qwen3", dtype="float32", num_kvcache_blocks=512, max_model_len=1024),
                         ["Hello"], max_tokens=4)
    s = Server(model=HUB_ID, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)})
    try:
        assert [m.id for m in s.client.models.list().data] == [HUB_ID]
        r = s.client.completions.create(model=HUB_ID, prompt="Hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        from nanoengine.tokenizer import load_tokenizer

        assert r.choices[0].text == load_tokenizer(assets.resolve_model(HUB_ID)).decode(want[0])
    finally:
        s.stop()
