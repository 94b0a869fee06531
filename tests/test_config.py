"""Config parsing: errors name the key; flags override the file; shipped examples are valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferx_core.cli import main
from inferx_core.config import Config, ConfigError, load_config, parse_memory

EXAMPLES = Path(__file__).parent.parent / "examples"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "deploy.toml"
    p.write_text(text)
    return p


def test_defaults_are_valid():
    cfg = Config()
    assert cfg.scheduler.prefill_chunk <= cfg.scheduler.max_batched_tokens
    assert cfg.kv_cache.block_size == 16


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_cache\.blok_size: unknown key"):
        load_config(write(tmp_path, "[kv_cache]\nblok_size = 16\n"))


def test_unknown_section_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"modle: unknown key"):
        load_config(write(tmp_path, "[modle]\npath = 'x'\n"))


def test_bad_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"scheduler\.max_running: .*integer"):
        load_config(write(tmp_path, "[scheduler]\nmax_running = 'lots'\n"))


def test_bad_toml_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[scheduler]\nprefill_chunk = 4096\nmax_batched_tokens = 1024\n", "prefill_chunk"),
        ("[model]\npath = 'a'\npreset = 'b'\n", "model.path or model.preset"),
        ("[kv_cache]\nblock_size = 12\n", "kv_cache.block_size"),
        ("[kv_cache]\nmemory = 'lots'\n", "kv_cache.memory"),
        ("[engine]\ndevice = 'tpu'\n", "engine.device"),
    ],
)
def test_impossible_combinations(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path, text))


def test_parallel_tensor_is_accepted_and_checked():
    cfg = load_config(None, {"kv_cache.dtype": "fp8_e4m3", "parallel.tensor": "4"})
    assert cfg.kv_cache.dtype == "fp8_e4m3" and cfg.parallel.tensor == 4
    with pytest.raises(ConfigError, match=r"kv_cache\.dtype"):
        load_config(None, {"kv_cache.dtype": "fp8_e5m2"})
    with pytest.raises(ConfigError, match=r"parallel\.tensor"):
        load_config(None, {"parallel.tensor": 0})


def test_overrides_beat_the_file(tmp_path):
    path = write(tmp_path, "[kv_cache]\nblock_size = 32\nmemory = '2GiB'\n")
    cfg = load_config(path, {"kv_cache.block_size": "16"})
    assert cfg.kv_cache.block_size == 16
    assert cfg.kv_cache.memory == 2 * 2**30


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), (0.5, 0.5), ("0.9", 0.9), (1000, 1000)],
)
def test_memory_sizes(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("bad", ["-1", "1.5", "4 parsecs", 0, 0.0])
def test_bad_memory_sizes(bad):
    with pytest.raises(ValueError):
        parse_memory(bad)


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_examples_parse(example):
    load_config(example)


def test_examples_exist():
    assert len(list(EXAMPLES.glob("*.toml"))) >= 2


def test_cli_bad_flag_is_one_line(capsys):
    assert main(["generate", "--prompt", "x", "--no-such-flag", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --no-such-flag" in err[0]


def test_cli_bad_config_value_is_one_line(capsys):
    assert main(["generate", "--prompt", "x", "--block-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: kv_cache.block_size: must be a power of two from 1 to 256, not 3"]


def test_cli_missing_model_path_is_one_line(capsys, tmp_path):
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_every_key_has_a_description() -> None:
    """--help shows each flag's description beside its default (config.flag_help)."""
    from inferx_core.config import Config

    missing = [
        f"{section}.{key}"
        for section, info in Config.model_fields.items()
        for key, field in info.annotation.model_fields.items()
        if not field.description
    ]
    assert not missing, missing


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[1] / "examples").glob("*.toml")), ids=lambda p: p.name
)
def test_every_example_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.path or cfg.model.preset or path.name == "cpu-demo.toml"
