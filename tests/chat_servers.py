"""What the chat tests share: a scripted "model" behind the real HTTP server, the demo model's
`inferx-server` in a subprocess, and Llama 3.1's tokenizer made from the Llama 3 fixture."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

TOKENIZERS = FIXTURES / "tokenizers"
# Meta's chat template of Llama-3.1-8B-Instruct (its tokenizer_config.json), unchanged.
LLAMA31_TEMPLATE = (Path(__file__).parent / "fixtures" / "llama3.1_chat_template.jinja").read_text(
    encoding="utf-8"
)
# Llama 3.1's special tokens that Llama 3 has as reserved ones; the rest stay reserved,
# renumbered around them as 3.1 numbers them.
LLAMA31_SPECIAL = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}


def llama31_tokenizer(out: Path) -> Path:
    """Llama-3.1-8B-Instruct's tokenizer in `out`: Llama 3's vocabulary (the same BPE) with 3.1's
    special tokens at their ids, eos `<|eot_id|>` and Meta's chat template. No
    generation_config.json, so nothing but the tokenizer says which ids end a reply."""
    source = TOKENIZERS / "llama3"
    doc = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    reserved = (f"<|reserved_special_token_{i}|>" for i in itertools.count())
    names = {
        t["id"]: LLAMA31_SPECIAL.get(t["id"]) or next(reserved)
        for t in sorted(doc["added_tokens"], key=lambda t: t["id"])
    }
    for t in doc["added_tokens"]:
        t["content"] = names[t["id"]]
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, t in config["added_tokens_decoder"].items():
        t["content"] = names[int(key)]
    config |= {"eos_token": "<|eot_id|>", "chat_template": LLAMA31_TEMPLATE}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


# -- a scripted model behind the server ----------------------------------------------------------


class ScriptedExecutor:
    """A "model" that replies with `script` (token ids), then `filler` forever; it records the
    last prompt it saw."""

    def __init__(self, script: list[int], filler: int, max_model_len: int = 2048) -> None:
        self.num_kv_blocks, self.block_size, self.max_model_len = 256, 16, max_model_len
        self.script = script
        self.filler = filler
        self.prompt: list[int] = []

    def execute(self, out: Any) -> Any:
        from inferx_core.interfaces import StepResult

        sampled = []
        for c in out.chunks:
            if c.sample:
                seq = c.seq
                self.prompt = seq.token_ids[: seq.num_prompt]
                n = c.start + c.num_tokens - seq.num_prompt  # outputs before this one
                sampled.append(self.script[n] if n < len(self.script) else self.filler)
        return StepResult(sampled, [])


def serve_scripted(
    tok: Any, name: str, script: Sequence[int] = (), max_model_len: int = 2048
) -> Iterator[Any]:
    """The server over an Engine whose executor is a ScriptedExecutor (filler: "."), for a
    module fixture to yield from; the transport also has .tok."""
    from test_server_api import serve_engine

    from inferx_core.config import load_config
    from inferx_core.engine import Engine

    config = load_config(None, {"model.served_name": name})
    filler = tok.encode(".", add_special_tokens=False)[0]
    executor = ScriptedExecutor(list(script), filler, max_model_len)
    engine = Engine(config, executor=executor, tokenizer=tok)
    with serve_engine(engine, config) as transport:
        transport.tok = tok
        yield transport


def openai_client(url: str, timeout: float | None = None) -> Any:
    import openai

    kw = {} if timeout is None else {"timeout": timeout}
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, **kw)


@contextmanager
def tiny_gpt_oss_server(path: Path, max_len: int) -> Iterator[Any]:
    """tiny-gpt-oss's shapes with o200k_harmony's full vocabulary (the preset's 320 ids would
    not cover it), random weights (a dummy checkpoint: its config.json in `path`), served as
    "tiny"."""
    from test_server_api import serve_engine

    from inferx_core.config import load_config
    from inferx_core.engine import Engine
    from inferx_models.presets import preset

    config = preset("tiny-gpt-oss") | {
        "vocab_size": 201088,
        "bos_token_id": 199998,
        "eos_token_id": 200002,  # <|return|>
        "pad_token_id": 199999,
        "max_position_embeddings": max_len,
    }
    (path / "config.json").write_text(json.dumps(config))
    cfg = load_config(
        None,
        {
            "model.path": str(path),
            "model.load_format": "dummy",
            "model.tokenizer": str(TOKENIZERS / "gpt-oss"),
            "model.served_name": "tiny",
        },
    )
    with serve_engine(Engine(cfg), cfg) as server:
        yield server


# -- the demo model --------------------------------------------------------------------------------


def require_demo_model() -> None:
    """Skip the calling test module, at its import, where the demo model is not installed."""
    try:
        from inferx_models.gguf import find_demo_gguf

        find_demo_gguf()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"the demo model is not installed ({exc})", allow_module_level=True)


@contextmanager
def demo_server(max_model_len: int, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`inferx-server` serving the demo model in a subprocess (flags added to its command
    line): (the process, its URL) once it listens; killed at the end if still running."""
    cmd = [sys.executable, "-m", "inferx_server.cli", "--port", "0"]
    cmd += ["--max-model-len", str(max_model_len), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the model is loaded, or the server died
        assert "loaded in" in line and "listening on http://127.0.0.1:" in line, (
            line + proc.stderr.read()
        )
        yield proc, line.rsplit(" ", 1)[1].strip()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
