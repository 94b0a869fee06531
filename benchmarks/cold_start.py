"""Engine start-up on a cold (or warm) Triton cache, per config variant, in fresh processes.

    python benchmarks/cold_start.py --tokenizer DIR [--preset qwen2.5-3b-instruct]
        [--variants "engine.compile_threads=0;engine.compile_threads=8"] [--rounds 2]
        [--warm] [--profile-phase warm_up] [--json OUT.json]

Each round starts one child per variant (alternating), each with an empty TRITON_CACHE_DIR of
its own unless --warm (then one shared directory, filled by a first unmeasured start), builds
the offline engine (bf16, CUDA graphs, the default config otherwise) and reports spawn to ready,
the engine's own parts (open, weights, profile, kv_cache, warm_up, cuda_graphs) and the dry
run's compiles: how many variants, their summed seconds against the wall time (how many ran
side by side) and the longest. On a fresh machine every Triton kernel variant compiles during
start-up: this is issue 4's "start to ready" on a machine that has not run InferX before. On a
cold cache it also names the kernels that compiled once the warm-up or the graph capture had
begun: variants the start-up's one dry run missed, each a compile the phase waited for alone.
--profile-phase runs that phase (warm_up, cuda_graphs or profile) under cProfile and prints
where its host time went.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from commit_id import commit_id

CHILD = """
import json, sys, time
t0 = time.time()
from inferx_core import cuda_graphs, executor
from inferx_core.config import load_config
from inferx_core.engine import LLM
imported = time.time()
marks = {}  # when the phases after the dry run began (epoch seconds)
def mark(cls, name, label):
    orig = getattr(cls, name)
    def wrapped(*a, **k):
        marks.setdefault(label, time.time())
        return orig(*a, **k)
    setattr(cls, name, wrapped)
mark(executor.ModelRunner, "_warm_up", "warm_up")
PHASES = {"warm_up": (executor.ModelRunner, "_warm_up"),
          "profile": (executor.ModelRunner, "_profile_memory"),
          "cuda_graphs": (cuda_graphs.DecodeGraphRunner, "capture")}
if sys.argv[2]:  # run this phase under cProfile; its top functions go to stdout
    import cProfile, io, pstats
    cls, name = PHASES[sys.argv[2]]
    orig_phase = getattr(cls, name)
    def profiled(*a, **k):
        prof = cProfile.Profile()
        try:
            return prof.runcall(orig_phase, *a, **k)
        finally:
            for key in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(18)
                for line in text.getvalue().splitlines():
                    print("PSTATS " + line, flush=True)
    setattr(cls, name, profiled)
mark(cuda_graphs.MixedGraphRunner, "capture", "cuda_graphs")
mark(cuda_graphs.DecodeGraphRunner, "capture", "cuda_graphs")
llm = LLM(load_config(None, json.loads(sys.argv[1])))
ex = llm.engine.executor
print("RESULT " + json.dumps({"imports_s": imported - t0, "engine_s": time.time() - imported,
                              "parts_s": dict(ex.report.seconds), "began": marks,
                              "compiles": ex.report.compiles}), flush=True)
"""


def start(overrides: dict[str, object], cache_dir: str, phase: str = "") -> dict[str, object]:
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(overrides), phase],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.time() - t0
    for ln in proc.stdout.splitlines():
        if ln.startswith("PSTATS "):
            print(ln.removeprefix("PSTATS ")[:150])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"start-up failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"spawn_to_ready_s": wall, **json.loads(lines[-1].removeprefix("RESULT "))}


def late_compiles(cache_dir: str, began: dict[str, float]) -> dict[str, list[str]]:
    """The kernels Triton wrote to cache_dir (<hash>/<name>.json, written when a compile ends)
    once the warm-up or the graph capture had begun: variants the start-up's dry run missed,
    which compiled one at a time in the real passes. By phase, names sorted."""
    out: dict[str, list[str]] = {}
    starts = sorted(began.items(), key=lambda kv: kv[1])
    for f in Path(cache_dir).glob("*/*.json"):
        if f.name.startswith("__grp__"):
            continue
        mtime = f.stat().st_mtime
        phase = None
        for name, at in starts:
            if mtime >= at:
                phase = name
        if phase is not None:
            out.setdefault(phase, []).append(f.stem)
    return {k: sorted(v) for k, v in out.items()}


def compiles_line(compiles: dict[str, object]) -> str:
    """The start-up dry run's compiles (LoadReport.compiles) in one line."""
    pairs: list[tuple[str, float]] = compiles["longest"]  # type: ignore[assignment]
    longest = ", ".join(f"{name} {s:.2f}" for name, s in pairs)
    return (
        f"{compiles['variants']} variants, {compiles['summed_s']:.1f} s of compiles in "
        f"{compiles['wall_s']:.1f} s; longest: {longest}"
    )


def parse_variant(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in text.split():
        key, _, value = item.partition("=")
        out[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--variants", default="engine.compile_threads=0;engine.compile_threads=8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="a shared, pre-filled Triton cache")
    phases = ["", "warm_up", "profile", "cuda_graphs"]
    ap.add_argument("--profile-phase", default="", choices=phases)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "model.dtype": "bfloat16",
        "engine.attention_backend": "triton",
    }
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    shared = tempfile.mkdtemp(prefix="triton-warm-") if args.warm else None
    if shared:
        start(base, shared)
    rows = []
    cols = ("profile", "warm_up", "cuda_graphs")
    print(f"{'round':>5}  {'variant':40} {'ready s':>8} " + " ".join(f"{c:>11}" for c in cols))
    for r in range(args.rounds):
        for v in variants:
            cache = shared or tempfile.mkdtemp(prefix="triton-cold-")
            res = start({**base, **parse_variant(v)}, cache, args.profile_phase)
            parts = res["parts_s"]
            assert isinstance(parts, dict)
            cells = " ".join(f"{parts.get(c, 0):11.2f}" for c in cols)
            print(f"{r:>5}  {v:40} {res['spawn_to_ready_s']:8.2f} {cells}", flush=True)
            if res.get("compiles"):
                print(f"       dry-run compiles: {compiles_line(res['compiles'])}", flush=True)
            if not shared:
                began = res.get("began") or {}
                assert isinstance(began, dict)
                res["compiled_late"] = late_compiles(cache, began)
                for phase, names in res["compiled_late"].items():
                    print(f"       compiled in {phase}, after the dry run: {', '.join(names)}")
            rows.append({"round": r, "variant": v, **res})
    if args.json:
        meta = {"commit": commit_id(), "preset": args.preset, "warm": args.warm}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
