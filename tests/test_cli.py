"""The `inferx` command end to end: checkpoint writes a loadable model; generate runs it."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from inferx_core.cli import main


def test_checkpoint_then_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    qwen = FIXTURES / "tokenizers" / "qwen"
    assert (
        main(
            [
                "checkpoint",
                "--preset",
                "tiny-qwen2",
                "--tokenizer",
                str(qwen),
                "--dtype",
                "float32",
                str(out),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()
    assert list(out.glob("*.safetensors"))
    args = [
        "generate",
        "--model",
        str(out),
        "--prompt",
        "Hello there",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--json",
    ]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["token_ids"]) == 5 and isinstance(first["text"], str)
    assert main(args) == 0  # greedy on the same weights: the same tokens
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]


def test_checkpoint_unknown_preset_is_one_line(tmp_path, capsys):
    assert main(["checkpoint", "--preset", "gpt-7", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpt-7" in err[0]


@pytest.mark.parametrize("flag", ["--preset", "--tokenizer"])
def test_preset_needs_a_tokenizer_for_text(flag, capsys):
    args = ["generate", "--preset", "tiny-qwen2", "--prompt", "hi", "--device", "cpu"]
    if flag == "--tokenizer":
        args += ["--tokenizer", str(FIXTURES / "tokenizers" / "qwen"), "--max-tokens", "2"]
        assert main(args) == 0
    else:
        assert main(args) == 2
        assert "tokenizer" in capsys.readouterr().err


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, capsys):
    from inferx_core.config import load_config
    from inferx_core.engine import LLM

    llm = LLM(load_config(None, {"model.preset": "tiny-llama", "engine.device": "cpu"}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]])


def test_bad_sampling_flags_are_one_line_each_by_name(capsys):
    args = ["generate", "--preset", "tiny-qwen2", "--prompt", "hi", "--device", "cpu"]
    args += ["--tokenizer", str(FIXTURES / "tokenizers" / "qwen")]
    assert main([*args, "--max-tokens", "-3", "--temperature", "-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: max_tokens: Input should be greater than or equal to 1",
        "error: temperature: Input should be greater than or equal to 0",
    ]


def test_server_flags_show_type_default_and_choices(capsys):
    from inferx_server.cli import build_parser

    text = build_parser().format_help()
    assert "VALUE" not in text
    assert "--model-dtype {auto,float32,float16,bfloat16}" in text
    assert "--server-port INT" in text and "server.port; default: 8000" in text
    assert "--engine-overlap {true,false,auto}" in text


def test_bench_hides_its_internal_subcommand():
    from inferx_server.bench import build_parser

    assert "_stub-server" not in build_parser().format_help()


def test_a_taken_port_is_reported_before_the_model_loads(monkeypatch, capsys):
    import inferx_server.cli as server_cli
    from inferx_server.listen import bind

    taken = bind("127.0.0.1", 0)
    port = taken.getsockname()[1]
    monkeypatch.setattr(server_cli, "engine_in_process", lambda c: pytest.fail("model loaded"))
    try:
        assert server_cli.main(["--port", str(port)]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port} (server.host, server.port)" in err
