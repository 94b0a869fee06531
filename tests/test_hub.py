"""model.path as a hub id: read from huggingface_hub's cache; offline, a clear error."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.executor import LoadError
from inferx_core.hub import is_hub_id
from inferx_core.sequence import SamplingParams

REPO = "inferx-tests/tiny-qwen2"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of our own, offline (this machine has no hub)."""
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_are_told_from_paths(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-3B-Instruct")
    assert is_hub_id("meta-llama/Llama-3.1-8B")
    assert not is_hub_id("/abs/model")
    assert not is_hub_id("./model")
    assert not is_hub_id("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_missing_model_offline_names_it_and_the_switch(hub_cache):
    config = load_config(None, {"model.path": REPO, "engine.device": "cpu"})
    with pytest.raises(LoadError) as err:
        LLM(config)
    assert REPO in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)


def test_a_missing_local_path_is_still_said_plainly():
    config = load_config(None, {"model.path": "./no/such/dir", "engine.device": "cpu"})
    with pytest.raises(LoadError, match="does not exist"):
        LLM(config)


def test_cached_model_loads_by_its_hub_id(hub_cache, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    local = tmp_path / "local"
    model.save_pretrained(local)
    # huggingface_hub's cache layout: refs/main names the snapshot that holds the files.
    repo_dir = hub_cache / ("models--" + REPO.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    shutil.copytree(local, repo_dir / "snapshots" / REVISION)

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[3, 5, 7, 9]]
    by_id = LLM(load_config(None, {"model.path": REPO, "engine.device": "cpu"}))
    by_path = LLM(load_config(None, {"model.path": str(local), "engine.device": "cpu"}))
    got = by_id.generate(prompt, params)[0].token_ids
    assert got == by_path.generate(prompt, params)[0].token_ids
    assert len(got) == 8

    from inferx_server.transport import served_model_name

    assert served_model_name(by_id.engine.config, by_id.engine) == REPO
