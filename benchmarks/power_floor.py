"""What the H200 spends per unit of work at its 700 W limit, and whether the model's steps cost
more energy than their bytes and FLOPs do.

    python benchmarks/power_floor.py --tokenizer DIR [--preset llama-3.1-8b-instruct]
        [--only idle,copy,read,read-zero,gemm,gemm-1e-3,gemm-zero,gemm-64,gemm-256,tma-64,prompt,
                read-weights,decode-64,decode-1,decode-256]
        [--seconds 4] [--json OUT.json]

Sessions 35-36 found 8B's 64-client run and both offline runs power-capped: their figures follow
energy per token, not kernel time. Each workload here runs back to back while nvidia-smi samples
clocks and power (gpu_clocks.GpuClocks, every 100 ms); its figures come from the samples inside
its measured windows (after a warm-up, so the clock has settled):

- idle: the GPU with a context and nothing queued (all samples, busy or not);
- copy / read: a 2 GiB device copy (bytes read plus written) and a read-only sweep of 4 GiB
  (a Triton kernel that sums each 32 KB tile) of N(0, 1) bf16: energy per byte of DRAM traffic;
  read-zero sweeps zeros and read-weights the model's own weights (does the data matter?);
- gemm: the 8B prompt step's four GEMMs of a layer at 8,192 rows through torch.mm (cuBLAS),
  weights uniform in +-0.02 (DummyFormat's range), activations N(0, 1): energy per FLOP;
  gemm-1e-3 with weights in +-1e-3 (vLLM's dummy range) and gemm-zero with zero activations
  show how much of it is the data; gemm-64 / gemm-256 run the same four GEMMs at decode's 64 and
  256 rows over 32 layers' weights (14 GB, read from DRAM as a decode step reads them), and
  their FLOPs' energy is what is left after idle and their bytes at the read sweep's rate;
  tma-64 runs them as the model's decode steps do at 64 rows (our TMA GEMMs, in a CUDA graph),
  tma-64-n128 with 128-row weight tiles;
- prompt: the model's 8,192-token prompt steps (16 prompts of 512, max_tokens 1, repeated);
  its DRAM figure counts the weights only, not the activations' ~2 GB a layer (a lower bound);
- decode-B (decode-64, decode-1, any batch B): the model's decode steps (CUDA graphs) at batch
  B from 512-token prompts, 256 steps a round, the rounds' prefills outside the windows.

For the model's steps it prints the energy a step took (mean power x step time) beside what its
work would cost at the rates measured above: idle power x time + DRAM bytes (weights, and KV
read by attention) x J per byte (read) + FLOPs x the GEMM's J per FLOP beyond idle. A step near
that estimate spends its energy on the work itself; the gap is what a kernel could still save.
Beside it, the step's two floors: its bytes at the read sweep's bandwidth, and the time the power
limit allows for its work's energy (t = work J / (limit - idle)). With prompt and decode-64 (and
decode-256) measured, it adds what 8B's 64-client run (and the offline run) could reach at the
limit as those steps alone (RUNS), at the estimate's energy and at the measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commit_id import commit_id
from gpu_clocks import POWER_CAP, GpuClocks, Sample

WORKLOADS = (
    "idle",
    "copy",
    "read",
    "read-zero",
    "gemm",
    "gemm-1e-3",
    "gemm-zero",
    "gemm-64",
    "gemm-256",
    "tma-64",
    "tma-64-n128",
    "prompt",
    "decode-64",
    "decode-1",
)


def is_decode(name: str) -> bool:
    """decode-B: the model's decode steps at batch B."""
    return name.startswith("decode-") and name.removeprefix("decode-").isdigit()


def is_model(name: str) -> bool:
    return name in ("prompt", "read-weights") or is_decode(name)


def window_stats(samples: list[Sample], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Clocks and power over the samples inside any of the (start, end) monotonic windows, busy
    or not (the windows are known to be running the workload, or known idle)."""
    inside = [s for s in samples if any(a <= s.monotonic <= b for a, b in windows)]
    if not inside:
        return {"samples": 0}
    return {
        "samples": len(inside),
        "sm_mhz_median": statistics.median(s.sm_mhz for s in inside),
        "power_w_mean": statistics.fmean(s.power_w for s in inside),
        "power_capped": sum(bool(s.reasons & POWER_CAP) for s in inside) / len(inside),
    }


def energy_estimate(
    seconds: float, dram_bytes: float, flops: float, rates: dict[str, float]
) -> dict[str, float]:
    """Joules a span of `seconds` moving `dram_bytes` and doing `flops` costs at the measured
    rates: idle_w (the floor of any busy second), j_per_byte and j_per_flop (each beyond idle)."""
    parts = {
        "idle_j": rates["idle_w"] * seconds,
        "dram_j": rates["j_per_byte"] * dram_bytes,
        "flop_j": rates["j_per_flop"] * flops,
    }
    return {**parts, "total_j": sum(parts.values())}


def floor_seconds(
    dram_bytes: float, flops: float, rates: dict[str, float], limit_w: float
) -> dict[str, float]:
    """The least time a span of that work can take: its bytes at the read sweep's bandwidth,
    or, at the power limit, the time whose energy (idle power for it, plus the work's own)
    the limit allows: t = work J / (limit - idle)."""
    work_j = rates["j_per_byte"] * dram_bytes + rates["j_per_flop"] * flops
    return {
        "bandwidth_s": dram_bytes / rates["read_bytes_s"],
        "power_s": work_j / (limit_w - rates["idle_w"]),
    }


# Issue 4's power-capped runs as steps of the rows above (512-token prompts, 256 out, prompt
# steps of 8,192 tokens): 8B's 64-client run (two waves of 64) and the offline run (256 at once).
RUNS = {
    "c=64, 2 waves": {"steps": {"decode-64": 510, "prompt": 8}, "output_tokens": 128 * 256},
    "offline 256": {"steps": {"decode-256": 255, "prompt": 16}, "output_tokens": 256 * 256},
}


def run_ceilings(
    rows: dict[str, dict[str, Any]], idle_w: float, limit_w: float
) -> dict[str, dict[str, float]]:
    """Output tok/s each RUNS entry could reach with the power held at limit_w and nothing but
    its steps: t = sum of the steps' work J (beyond idle) / (limit - idle), once with the work at
    the rates' estimate ("floor") and once at the energy the steps measured. Runs whose steps
    were not all measured are left out."""
    out = {}
    for name, run in RUNS.items():
        if not all("work_j_estimate" in rows.get(w, {}) for w in run["steps"]):
            continue
        res = {}
        for kind in ("estimate", "measured"):
            joules = sum(n * rows[w][f"work_j_{kind}"] for w, n in run["steps"].items())
            res[f"{kind}_s"] = joules / (limit_w - idle_w)
            res[f"{kind}_tok_s"] = run["output_tokens"] / res[f"{kind}_s"]
        out[name] = res
    return out


def rates_from(rows: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """idle_w, j_per_byte (the read sweep's power beyond idle over its bandwidth) and j_per_flop
    (the GEMMs' beyond idle over their FLOP rate), from the rows measured; None without them."""
    need = ("idle", "read", "gemm")
    if not all(k in rows and rows[k].get("power_w_mean") for k in need):
        return None
    idle = rows["idle"]["power_w_mean"]
    return {
        "idle_w": idle,
        "j_per_byte": (rows["read"]["power_w_mean"] - idle) / (rows["read"]["tb_s"] * 1e12),
        "j_per_flop": (rows["gemm"]["power_w_mean"] - idle) / (rows["gemm"]["tflops"] * 1e12),
        "read_bytes_s": rows["read"]["tb_s"] * 1e12,
    }


# -- the GPU workloads (imported lazily: the arithmetic above runs on the CPU VM too) -----------


def timed_loop(fn: Callable[[], Any], seconds: float, warm_s: float = 1.0) -> tuple[float, int]:
    """Run fn back to back for warm_s, then for `seconds`; (measured seconds, iterations)."""
    import torch

    end = time.monotonic() + warm_s
    while time.monotonic() < end:
        fn()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(4):
            fn()
        n += 4
        torch.cuda.synchronize()
    return time.monotonic() - t0, n


def read_kernel():  # the Triton kernel, built on first use
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))

    return _read


READ_BLOCK = 16384  # elements a program: 32 KB of bf16


def read_all(tensors: list[Any]) -> Callable[[], list[Any]]:
    """One sweep of the read kernel over each tensor (flattened, any size): reads every byte."""
    import torch

    kernel = read_kernel()
    flat = [t.reshape(-1) for t in tensors]
    outs = [
        torch.empty(-(-t.numel() // READ_BLOCK), dtype=torch.float32, device=t.device) for t in flat
    ]

    def sweep() -> list[Any]:
        for t, o in zip(flat, outs, strict=True):
            kernel[(o.numel(),)](t, o, t.numel(), BLOCK=READ_BLOCK)
        return outs  # each tensor's sums a tile

    return sweep


def kernel_row(name: str, seconds: float, clocks_path: Path) -> dict[str, Any]:
    """One of idle / copy / read / gemm*: its rate and the clocks inside its window."""
    import torch

    dev = torch.device("cuda")
    row: dict[str, Any] = {"workload": name}
    with GpuClocks(clocks_path) as clocks:
        if name == "idle":
            torch.cuda.synchronize()
            time.sleep(0.5)
            t0 = time.monotonic()
            time.sleep(seconds)
            windows = [(t0, time.monotonic())]
        elif name == "copy":
            src = torch.randint(0, 256, (1 << 31,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t0 = time.monotonic() + 1.0
            secs, n = timed_loop(lambda: dst.copy_(src), seconds)
            windows = [(t0, t0 + secs)]
            row["tb_s"] = 2 * src.numel() * n / secs / 1e12
        elif name in ("read", "read-zero"):
            x = torch.randn(1 << 31, dtype=torch.bfloat16, device=dev)  # 4 GiB
            if name == "read-zero":
                x.zero_()
            sweep = read_all([x])
            t0 = time.monotonic() + 1.0
            secs, n = timed_loop(sweep, seconds)
            windows = [(t0, t0 + secs)]
            row["tb_s"] = 2 * x.numel() * n / secs / 1e12
            del x
        else:  # gemm*, tma-64*: the 8B layer's four GEMMs
            skinny = {"gemm-64": 64, "gemm-256": 256, "tma-64": 64, "tma-64-n128": 64}
            m = skinny.get(name, 8192)
            hidden, inter = 4096, 14336
            shapes = [(hidden, 6144), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
            bound = 1e-3 if name == "gemm-1e-3" else 0.02
            g = torch.Generator(device=dev).manual_seed(0)
            copies = 32 if m < 8192 else 1  # skinny: every layer's weights, as decode reads them
            ws = [
                torch.empty(n_, k, dtype=torch.bfloat16, device=dev).uniform_(
                    -bound, bound, generator=g
                )
                for _ in range(copies)
                for k, n_ in shapes
            ]
            shapes = shapes * copies
            xs = [
                torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=g) for k, _ in shapes
            ]
            if name == "gemm-zero":
                xs = [torch.zeros_like(x) for x in xs]
            outs = [torch.empty(m, w.shape[0], dtype=torch.bfloat16, device=dev) for w in ws]

            def layer() -> None:
                for x, w, o in zip(xs, ws, outs, strict=True):
                    torch.mm(x, w.t(), out=o)

            if name.startswith("tma-"):
                layer = tma_pass(xs, ws, 128 if name.endswith("-n128") else None)

            t0 = time.monotonic() + 1.0
            secs, n = timed_loop(layer, seconds)
            windows = [(t0, t0 + secs)]
            flops = sum(2 * m * k * n_ for k, n_ in shapes)
            row["tflops"] = flops * n / secs / 1e12
            if copies > 1:
                row["tb_s"] = sum(2 * k * n_ for k, n_ in shapes) * n / secs / 1e12
    row |= window_stats(clocks.samples, windows)
    return row


def tma_pass(xs: list[Any], ws: list[Any], block_n: int | None) -> Callable[[], None]:
    """tma-64 / tma-64-n128: the decode step's TMA GEMMs (inferx_kernels_cuda.tma_gemv) over
    gemm-64's weights, as the model runs them at 64 rows (QKV in 2 K-slices, o_proj and down in
    4, gate_up with SiLU-and-mul), in one CUDA graph; block_n: weight rows a tile instead of the
    model's 64 (fewer programs, each x tile read from L2 by fewer of them), 8 warps."""
    import torch
    import triton

    from inferx_kernels_cuda.tma_gemv import (
        SM_SHARED_BYTES,
        TmaGemvConfig,
        plain_config,
        tma_linear_parts,
        tma_linear_silu_and_mul,
    )

    sms = torch.cuda.get_device_properties(xs[0].device).multi_processor_count
    rows = xs[0].shape[0]

    def config(n: int, parts: int, gated: bool) -> TmaGemvConfig:
        cfg = plain_config(n, parts, sms, rows, gated)
        if block_n is None:
            return cfg
        tile_rows = (2 if gated else 1) * block_n + max(16, rows)
        per_sm = triton.cdiv(triton.cdiv(n, block_n) * parts, sms)
        stages = (SM_SHARED_BYTES // per_sm - 1024) // (tile_rows * 128 * 2)
        return TmaGemvConfig(block_n, 128, 8, min(4, stages))

    calls = []
    for x, w in zip(xs, ws, strict=True):
        n = w.shape[0]
        if n == 2 * 14336:  # gate_up
            cfg = config(n // 2, 1, True)
            calls.append(lambda x=x, w=w, cfg=cfg: tma_linear_silu_and_mul(x, w, cfg))
        else:
            parts = 2 if n == 6144 else 4  # QKV; o_proj, down_proj
            cfg = config(n, parts, False)
            calls.append(lambda x=x, w=w, p=parts, cfg=cfg: tma_linear_parts(x, w, p, cfg))

    def run() -> None:
        for call in calls:
            call()

    run()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def weights_row(model: Any, seconds: float, clocks_path: Path) -> dict[str, Any]:
    """read-weights: the model's own weights (each parameter once), swept like `read`."""
    from inferx_core.bench_offline import weight_bytes

    params = list({t.data_ptr(): t for t in model.parameters()}.values())  # a tied head once
    nbytes = weight_bytes(model)
    sweep = read_all(params)
    with GpuClocks(clocks_path) as clocks:
        t0 = time.monotonic() + 1.0
        secs, n = timed_loop(sweep, seconds)
    row = {"workload": "read-weights", "tb_s": nbytes * n / secs / 1e12}
    return row | window_stats(clocks.samples, [(t0, t0 + secs)])


def model_rows(args: argparse.Namespace, names: list[str], clocks_dir: Path) -> list[dict]:
    """prompt / decode-B on one engine of --preset (dummy weights, CUDA graphs)."""
    import torch
    from profile_decode import not_started

    from inferx_core.bench_offline import random_prompt, weight_bytes
    from inferx_core.config import load_config
    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    llm = LLM(
        load_config(
            None,
            {
                "model.preset": args.preset,
                "model.tokenizer": args.tokenizer,
                "model.dtype": "bfloat16",
                "kv_cache.memory": "40GiB",
                "engine.attention_backend": args.backend,
                "scheduler.prefix_cache": False,
            },
        )
    )
    ex = llm.engine.executor
    hf = ex.hf_config
    vocab, hidden, layers = int(hf["vocab_size"]), int(hf["hidden_size"]), hf["num_hidden_layers"]
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads", heads))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    wbytes = weight_bytes(ex.model)
    head_params = vocab * hidden
    tied = bool(hf.get("tie_word_embeddings", False))
    layer_params = wbytes // 2 - (1 if tied else 2) * head_params  # the layers' GEMMs (+ norms)
    kv_token = 2 * layers * kv_heads * head_dim * 2  # bf16 K and V, every layer
    rng = random.Random(0)
    rows = []
    for name in names:
        if name == "read-weights":
            rows.append(weights_row(ex.model, args.seconds, clocks_dir / f"{name}.csv"))
            print_row(rows[-1])
            continue
        windows: list[tuple[float, float]] = []
        steps = 0
        dram = flops = 0.0
        with GpuClocks(clocks_dir / f"{name}.csv") as clocks:
            t_end = time.monotonic() + args.seconds + 1.0
            warm = True
            while warm or not windows or time.monotonic() < t_end:  # at least one round
                if name == "prompt":
                    prompts = [random_prompt(vocab, 512, rng) for _ in range(16)]
                    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                    torch.cuda.synchronize()
                    t0 = time.monotonic()
                    llm.generate(prompts, one)
                    torch.cuda.synchronize()
                    t1 = time.monotonic()
                    tokens = 16 * 512
                    if not warm:
                        windows.append((t0, t1))
                        steps += 1
                        dram += wbytes
                        flops += 2 * tokens * layer_params + 2 * 16 * head_params
                        # causal attention: each token's q against its keys so far, QK and PV
                        flops += 16 * 4 * layers * heads * head_dim * 512 * 513 / 2
                else:
                    batch = int(name.removeprefix("decode-"))
                    n_steps = 256
                    prompts = [random_prompt(vocab, 512, rng) for _ in range(batch)]
                    params = SamplingParams(max_tokens=n_steps + 8, temperature=0, ignore_eos=True)
                    engine = llm.engine
                    ids = [engine.add_request(p, params) for p in prompts]
                    while not_started(engine, ids):  # prefill, first tokens
                        engine.step()
                    engine.step()
                    torch.cuda.synchronize()
                    t0 = time.monotonic()
                    for _ in range(n_steps):
                        engine.step()
                    torch.cuda.synchronize()
                    t1 = time.monotonic()
                    for i in ids:
                        engine.abort(i)
                    if not warm:
                        windows.append((t0, t1))
                        steps += n_steps
                        ctx = 512 + 2 + (n_steps - 1) / 2  # mean context over the window
                        dram += n_steps * (wbytes + batch * ctx * kv_token)
                        flops += (
                            n_steps
                            * batch
                            * (
                                2 * (layer_params + head_params)
                                + 4 * layers * heads * head_dim * ctx
                            )
                        )
                warm = False
        secs = sum(b - a for a, b in windows)
        row = {
            "workload": name,
            "steps": steps,
            "step_ms": secs / max(steps, 1) * 1e3,
            "dram_gb_per_step": dram / max(steps, 1) / 1e9,
            "tflop_per_step": flops / max(steps, 1) / 1e12,
            "seconds": secs,
            "dram_bytes": dram,
            "flops": flops,
        }
        row |= window_stats(clocks.samples, windows)
        rows.append(row)
        print_row(row)
    return rows


def print_row(r: dict[str, Any]) -> None:
    parts = [f"{r['tflops']:.0f} TFLOPS"] if "tflops" in r else []
    parts += [f"{r['tb_s']:.2f} TB/s"] if "tb_s" in r else []
    parts += [f"{r['step_ms']:.3f} ms a step"] if "step_ms" in r else []
    rate = ", ".join(parts)
    print(
        f"{r['workload']:<12} {rate:>24}  SM {r.get('sm_mhz_median', float('nan')):>6.0f} MHz  "
        f"{r.get('power_w_mean', float('nan')):>5.0f} W  capped "
        f"{100 * r.get('power_capped', 0):>3.0f}%  ({r.get('samples', 0)} samples)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="needed for prompt / decode-*")
    ap.add_argument("--preset", default="llama-3.1-8b-instruct")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--power-limit", type=float, default=700.0, help="W (nvidia-smi power.limit)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(n for n in names if n not in WORKLOADS and not is_model(n))
    if unknown:
        raise SystemExit(f"--only: unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if is_model(name):
                continue
            rows[name] = kernel_row(name, args.seconds, Path(tmp) / f"{name}.csv")
            print_row(rows[name])
        model = [n for n in names if is_model(n)]
        if model:
            import torch

            torch.cuda.empty_cache()  # the kernel rows' buffers, before the engine sizes its cache
            if not args.tokenizer:
                raise SystemExit("--tokenizer is needed for prompt / decode-*")
            for r in model_rows(args, model, Path(tmp)):
                rows[r["workload"]] = r
    rates = rates_from(rows)
    if rates:
        print(
            f"\nrates: idle {rates['idle_w']:.0f} W; DRAM {rates['j_per_byte'] * 1e12:.1f} pJ "
            f"a byte beyond idle; GEMM {rates['j_per_flop'] * 1e12:.3f} pJ a FLOP beyond idle"
        )
        for r in rows.values():
            if "tflops" in r and "tb_s" in r and r.get("power_w_mean"):
                beyond = (
                    r["power_w_mean"] - rates["idle_w"] - rates["j_per_byte"] * r["tb_s"] * 1e12
                )
                r["j_per_flop_after_bytes"] = beyond / (r["tflops"] * 1e12)
                print(
                    f"{r['workload']}: {r['j_per_flop_after_bytes'] * 1e12:.3f} pJ a FLOP beyond "
                    "idle and its weight bytes at the read rate"
                )
        print(
            f"{'step':<10} {'measured J':>10} {'idle J':>8} {'DRAM J':>8} {'FLOP J':>8} "
            f"{'estimate':>9} {'gap':>6} {'step ms':>8} {'floor ms: bytes':>15} "
            f"{f'at {args.power_limit:.0f} W':>9}"
        )
        for r in rows.values():
            if "steps" not in r or not r.get("power_w_mean") or not r["steps"]:
                continue
            step_s = r["seconds"] / r["steps"]
            est = energy_estimate(
                step_s, r["dram_bytes"] / r["steps"], r["flops"] / r["steps"], rates
            )
            measured = r["power_w_mean"] * step_s
            r["energy_j_per_step"] = measured
            r["estimate"] = est
            floor = floor_seconds(
                r["dram_bytes"] / r["steps"], r["flops"] / r["steps"], rates, args.power_limit
            )
            r["floor"] = floor
            r["work_j_estimate"] = est["total_j"] - est["idle_j"]
            r["work_j_measured"] = measured - est["idle_j"]
            print(
                f"{r['workload']:<10} {measured:>10.3f} {est['idle_j']:>8.3f} "
                f"{est['dram_j']:>8.3f} {est['flop_j']:>8.3f} {est['total_j']:>9.3f} "
                f"{100 * (measured / est['total_j'] - 1):>5.0f}% {step_s * 1e3:>8.3f} "
                f"{floor['bandwidth_s'] * 1e3:>15.3f} {floor['power_s'] * 1e3:>9.3f}"
            )
        ceilings = run_ceilings(rows, rates["idle_w"], args.power_limit)
        for name, c in ceilings.items():
            print(
                f"{name} at {args.power_limit:.0f} W, its steps alone: at the estimate's energy "
                f"{c['estimate_s']:.2f} s, {c['estimate_tok_s']:,.0f} tok/s; at the measured "
                f"{c['measured_s']:.2f} s, {c['measured_tok_s']:,.0f} tok/s"
            )
    else:
        ceilings = {}
    if args.json:
        doc = {"commit": commit_id(), "args": vars(args), "rates": rates, "rows": rows}
        Path(args.json).write_text(json.dumps(doc | {"ceilings": ceilings}, indent=1))


if __name__ == "__main__":
    main()
