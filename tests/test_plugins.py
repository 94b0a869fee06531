"""The plugin framework: lookup by name, clear errors, and a real third-party package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inferx_core.hookspecs import hookimpl
from inferx_core.plugins import PluginError, Plugins, plugins

TOY = Path(__file__).parent / "plugins" / "inferx-toy"


class _Fake:
    def __init__(self, name: str, target: object) -> None:
        self.name, self.target = name, target

    @hookimpl
    def inferx_schedulers(self, register):
        register(self.name, self.target)


def test_builtins_are_registered_through_entry_points():
    reg = plugins()
    assert "continuous" in reg.names("scheduler")
    assert reg.entry("scheduler", "continuous").package == "inferx-core"
    assert "torch" in reg.names("attention_backend")


def test_unknown_name_lists_known_ones():
    reg = Plugins(load_entry_points=False)
    reg.register(_Fake("fifo", "collections:deque"), package="p")
    with pytest.raises(PluginError, match=r"unknown scheduler 'lifo'; known: fifo"):
        reg.get("scheduler", "lifo")
    import collections

    assert reg.get("scheduler", "fifo") is collections.deque


def test_conflicting_registrations_name_both_packages():
    reg = Plugins(load_entry_points=False)
    reg.register(_Fake("x", "collections:deque"), package="first")
    reg.register(_Fake("x", "collections:OrderedDict"), package="second")
    with pytest.raises(PluginError, match="first and second|second and first"):
        reg.names("scheduler")


def test_broken_target_reports_plugin_and_package():
    reg = Plugins(load_entry_points=False)
    reg.register(_Fake("bad", "no_such_module_xyz:Thing"), package="broken-pkg")
    with pytest.raises(PluginError, match="scheduler 'bad' from broken-pkg failed to load"):
        reg.get("scheduler", "bad")


def test_typo_in_hook_name_fails_loudly():
    class Typo:
        @hookimpl
        def inferx_schedulerz(self, register):
            pass

    reg = Plugins(load_entry_points=False)
    with pytest.raises(Exception, match="inferx_schedulerz"):
        reg.register(Typo(), package="typo")


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    """The toy plugin, really installed (pip, entry points) into a private directory."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(TOY),
        ],
        check=True,
    )
    return site


def _run(site: Path, code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_third_party_model_and_backend_are_picked_from_toml(toy_site, tmp_path):
    model_dir = tmp_path / "toy-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["ToyForCausalLM"],
                "hidden_size": 8,
                "vocab_size": 32,
                "max_position_embeddings": 64,
            }
        )
    )
    (tmp_path / "deploy.toml").write_text(
        textwrap.dedent(f"""
        [model]
        path = "{model_dir}"
        load_format = "dummy"
        [engine]
        device = "cpu"
        attention_backend = "toy"
        [kv_cache]
        num_blocks = 16
        block_size = 4
    """)
    )
    out = _run(
        toy_site,
        textwrap.dedent("""
        import json
        from inferx_core.engine import LLM
        from inferx_core.sequence import SamplingParams
        from inferx_toy.model import CountingAttention
        llm = LLM("deploy.toml")
        done = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5, temperature=0))
        ex = llm.engine.executor
        print(json.dumps({"model": type(ex.model).__name__,
                          "backend": type(ex.attention).__name__,
                          "calls": CountingAttention.calls,
                          "lengths": [len(d.token_ids) for d in done]}))
    """),
        cwd=tmp_path,
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got["model"] == "ToyForCausalLM"
    assert got["backend"] == "CountingAttention"
    assert got["calls"] >= 5  # one prefill step and at least four decode steps
    assert got["lengths"] == [5, 5]


def test_inferx_plugins_lists_third_party_package(toy_site, tmp_path):
    out = _run(toy_site, "from inferx_core.cli import main; main(['plugins', '--json'])", tmp_path)
    rows = json.loads(out)
    toy = {(r["kind"], r["name"]): r["package"] for r in rows}
    assert toy[("model_arch", "ToyForCausalLM")] == "inferx-toy"
    assert toy[("attention_backend", "toy")] == "inferx-toy"
    assert toy[("scheduler", "continuous")] == "inferx-core"


def test_core_imports_no_plugin_package():
    """inferx-core reaches every implementation through the registry: no module of it imports
    another InferX package (presets included: `inferx checkpoint` asks the preset hook)."""
    core = Path(__file__).parents[1] / "packages" / "inferx-core" / "src" / "inferx_core"
    others = ("inferx_models", "inferx_kernels_cuda", "inferx_server", "inferx_quant")
    offenders = [
        f"{path.relative_to(core)}: {line.strip()}"
        for path in core.rglob("*.py")
        for line in path.read_text().splitlines()
        if line.lstrip().startswith(("import ", "from "))
        and any(line.split()[1].startswith(o) for o in others)
    ]
    assert not offenders, offenders


def test_presets_are_registered_by_the_models_package():
    reg = plugins()
    assert "qwen2.5-3b-instruct" in reg.names("preset")
    assert reg.entry("preset", "tiny-qwen2").package == "inferx-models"
