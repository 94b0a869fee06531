"""The built-in demo model (SmolLM2-135M-Instruct GGUF) against transformers on the same file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from inferx_core.config import Config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_models.gguf import find_demo_gguf  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(Config())


@pytest.fixture(scope="module")
def hf():
    path = find_demo_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tok, model


@pytest.mark.slow
def test_greedy_32_tokens_equal_transformers(llm, hf):
    tok, model = hf
    prompt = llm.chat_prompt(QUESTION)
    ref_prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_prompt, dict) or hasattr(ref_prompt, "input_ids"):
        ref_prompt = ref_prompt["input_ids"]
    assert prompt == list(ref_prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    ours = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert ours[0].token_ids == ref[0, len(prompt) :].tolist()


def test_chat_answer_is_sensible(llm):
    out = llm.generate(llm.chat_prompt(QUESTION), SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>, not at max_tokens


def test_generate_text_is_the_streamed_text(llm, monkeypatch):
    """LLM.generate decodes a request's text once at the end (FinalDetokenizer), the stream
    delta by delta: the same text, the decode of the same tokens. With a stop string generate
    streams internally (the stop is found in the text) and cuts there."""
    prompt = llm.chat_prompt(QUESTION)
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=24, temperature=0, skip_special_tokens=skip)
        done = llm.generate(prompt, params)[0]
        streamed = "".join(o.text for o in llm.stream(prompt, params))
        assert done.text == streamed == llm.tokenizer.decode(done.token_ids, skip)
        texts[skip] = done.text
    assert "Paris" in texts[True]
    stop = SamplingParams(max_tokens=24, temperature=0, stop=["Paris"])
    cut = llm.generate(prompt, stop)[0]
    assert cut.finish_reason == "stop" and texts[True].startswith(cut.text + "Paris")
    # Which detokenizer each request gets.
    engine = llm.engine
    kinds = {}
    for name, params, stream_text in (
        ("final", SamplingParams(max_tokens=4), False),
        ("stop", stop, False),
        ("stream", SamplingParams(max_tokens=4), True),
    ):
        rid = engine.add_request(prompt, params, stream_text=stream_text)
        kinds[name] = type(engine.requests[rid].detok).__name__
        engine.abort(rid)
    assert kinds == {
        "final": "FinalDetokenizer",
        "stop": "IncrementalDetokenizer",
        "stream": "IncrementalDetokenizer",
    }
    # ... and generate asks for the final text only.
    asked = []
    real = engine.add_request

    def spy(*args, **kwargs):
        asked.append(kwargs.get("stream_text", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    llm.generate([prompt, prompt], SamplingParams(max_tokens=2))
    assert asked == [False, False]


def test_cli_generate_json_answers():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferx_core.cli",
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "32",
            "--temperature",
            "0",
            "--dtype",
            "float32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "Paris" in out["text"] and out["token_ids"]
