"""The arithmetic of the profiling benchmarks (benchmarks/profile_decode.py, step_breakdown.py),
on hand-made traces: the GPU-idle figures that issue 4 reports must be right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from conftest import interpreted  # noqa: E402
from profile_decode import (  # noqa: E402
    gpu_records,
    group_table,
    host_in_long_gaps,
    idle_by_gap,
    idle_fraction,
    kernel_group,
    kernel_table,
    long_gaps,
    trace_events,
)
from profile_prefill import gemm_tflops  # noqa: E402
from step_breakdown import StepTimer, slowest, summarize  # noqa: E402


def test_idle_counts_gaps_once_and_overlaps_as_busy(tmp_path: Path) -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
            {"ph": "X", "cat": "kernel", "name": "b", "ts": 11, "dur": 9},
            {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 30, "dur": 10},
            {"ph": "X", "cat": "kernel", "name": "a", "ts": 100, "dur": 10},
            {"ph": "X", "cat": "kernel", "name": "inside", "ts": 105, "dur": 3},
            {"ph": "X", "cat": "cpu_op", "name": "host work", "ts": 40, "dur": 60},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    recs = gpu_records(path)
    assert [r[2] for r in recs] == ["a", "b", "copy", "a", "inside"]  # host events left out
    idle, window = idle_fraction(recs)
    assert window == 110 and abs(idle - 71 / 110) < 1e-12  # gaps of 1, 10 and 60 µs
    assert idle_by_gap(recs, steps=2) == {"<5us": 0.5, "5-50us": 5.0, ">50us": 30.0}
    table = {row["name"]: row for row in kernel_table(recs, steps=2)}
    assert table["a"]["launches_per_step"] == 1 and table["a"]["us_per_step"] == 10
    # The one gap of 50 µs or more: after the copy (ended at 40), before "a" (at 100).
    assert long_gaps(recs, steps=2) == [
        {"before": "copy", "after": "a", "per_step": 0.5, "us_per_step": 30.0}
    ]
    # ... and the one of 5-50 µs: after "b" (ended at 20), before the copy (at 30).
    assert long_gaps(recs, steps=2, edges=(5.0, 50.0)) == [
        {"before": "b", "after": "copy", "per_step": 0.5, "us_per_step": 5.0}
    ]
    # The host event overlaps that gap by its whole 60 µs; one inside the short gaps counts not.
    trace["traceEvents"] += [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 90, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "short", "ts": 20, "dur": 5},
    ]
    path.write_text(json.dumps(trace))
    assert host_in_long_gaps(trace_events(path), recs, steps=2) == [
        {"host": "host work", "us_per_step": 30.0},
        {"host": "cudaEventSynchronize", "us_per_step": 5.0},
    ]


def test_step_breakdown_groups_decode_and_prompt_steps() -> None:
    rows = [
        {"tokens": 8, "seqs": 8, "step_ms": 2.0, "submit_ms": 1.0, "wait_ms": 0.5, "apply_ms": 0.5},
        {"tokens": 8, "seqs": 8, "step_ms": 4.0, "submit_ms": 1.0, "wait_ms": 2.5, "apply_ms": 0.5},
        {"tokens": 100, "seqs": 3, "step_ms": 30.0, "submit_ms": 20.0, "apply_ms": 1.0},
        {"step_ms": 1.0},  # a call that only submitted: nothing applied
    ]
    s = summarize(rows)
    assert s["decode"]["steps"] == 2 and s["decode"]["mean_step_ms"] == 3.0
    assert s["decode"]["mean_wait_ms"] == 1.5 and s["decode"]["total_s"] == 0.006
    assert s["with prompt tokens"]["steps"] == 1
    assert s["with prompt tokens"]["mean_wait_ms"] == 0.0
    assert s["decode"]["mean_gc_ms"] == 0.0 and s["decode"]["gc_full"] == 0
    rows[1].update(gc_ms=3.0, gc_full=1)
    s = summarize(rows)
    assert s["decode"]["mean_gc_ms"] == 1.5 and s["decode"]["gc_full"] == 1
    assert [r["index"] for r in slowest(rows, 2)] == [2, 1]


def test_step_timer_charges_a_collection_to_its_step() -> None:
    """StepTimer's collector hook: a full collection inside the second step's apply shows in
    that step's row (gc_ms, gc_full), not in the others'."""
    import gc

    class Chunk:
        num_tokens = 1

    class Out:
        chunks = [Chunk()]

    class Engine:
        calls = 0

        def _submit(self, idle_ok: bool):
            return (Out(), None)

        def _apply(self, out, result):
            self.calls += 1
            if self.calls == 2:
                gc.collect()

        def step(self):
            got = self._submit(True)
            self._apply(got[0], None)

    engine = Engine()
    timer = StepTimer(engine)
    try:
        for _ in range(3):
            engine.step()
    finally:
        timer.close()
    assert [r.get("gc_full", 0) for r in timer.rows] == [0, 1, 0]
    assert timer.rows[1]["gc_ms"] > 0
    assert gc.callbacks.count(timer._on_gc) == 0
    engine.step()  # closed: the engine's own step again, no row
    assert len(timer.rows) == 3 and engine.calls == 4


def test_server_startup_times_both_variants(tmp_path: Path) -> None:
    """benchmarks/server_startup.py on the demo model: every variant's server got ready (and
    answered a completion) in every round, and the JSON says how long each took."""
    import subprocess

    out = tmp_path / "startup.json"
    script = Path(__file__).parent.parent / "benchmarks" / "server_startup.py"
    cmd = [sys.executable, str(script), "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seconds = json.loads(out.read_text())["seconds"]
    assert set(seconds) == {"server.engine_process=true", "server.engine_process=false"}
    assert all(len(v) == 1 and 0 < v[0] < 240 for v in seconds.values())


def test_prefill_profile_groups_kernels_by_name() -> None:
    names = {
        "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_TNT": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "GEMM",
        "prefill_kernel": "attention",
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>": "attention",
        "rms_norm_kernel": "norm",
        "rotary_kv_write_kernel": "rotary + KV write",
        "silu_and_mul_kernel": "SiLU-and-mul",
        "Memcpy HtoD (Pinned -> Device)": "copies",
        "skinny_linear_kernel": "GEMM",
        "tma_gemv_kernel": "GEMM",
        "tma_norm_gemv_kernel": "GEMM",  # the norm and SiLU-and-mul inside
        "decode_reduce_kernel": "attention",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>": "sampling",
        "void at::native::unrolled_elementwise_kernel<direct_copy>": "other",
    }
    assert {n: kernel_group(n) for n in names} == names
    rows = [
        {"name": "rms_norm_kernel", "launches_per_step": 73.0, "us_per_step": 200.0},
        {"name": "nvjet_a", "launches_per_step": 36.0, "us_per_step": 900.0},
        {"name": "nvjet_b", "launches_per_step": 72.0, "us_per_step": 300.0},
    ]
    assert group_table(rows) == [
        {"group": "GEMM", "launches_per_step": 108.0, "us_per_step": 1200.0},
        {"group": "norm", "launches_per_step": 73.0, "us_per_step": 200.0},
    ]
    # 8B: 8.03e9 parameters, 8192 tokens in 0.24 s -> 2 * 8.03e9 * 8192 / 0.24 = 548 TFLOPS
    assert abs(gemm_tflops(8_030_000_000, 8192, 0.24) - 548.2) < 0.1


def test_engine_gc_pauses_runs_both_settings(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/engine_gc_pauses.py at a small size: one child per setting, the frozen one
    with the start-up heap frozen and nothing tracked, the other with nothing frozen."""
    import engine_gc_pauses

    out = tmp_path / "gc.json"
    argv = ["engine_gc_pauses.py", "--prompts", "4", "--input-len", "32", "--output-len", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rounds", "1", "--json", str(out)])
    engine_gc_pauses.main()
    off, on = json.loads(out.read_text())["results"]
    assert (off["freeze"], on["freeze"]) == (False, True)
    assert off["frozen"] == 0 and off["tracked_after_start"] > 10_000
    assert on["frozen"] > 10_000 and on["tracked_after_start"] < 1_000
    assert off["steps"] == on["steps"] >= 4


def test_programs_per_sm_from_registers() -> None:
    from kernel_registers import programs_per_sm

    assert programs_per_sm(255, 4) == 2  # 256 x 128 threads = 32,768 registers a program
    assert programs_per_sm(120, 4) == 4  # 120 rounds to 120: 15,360 a program
    assert programs_per_sm(129, 4) == 3  # 129 rounds up to 136: 17,408 a program
    assert programs_per_sm(16, 1) == 32  # capped by the programs an SM can hold
    assert programs_per_sm(64, 4, shared_bytes=56 * 1024) == 4  # 228 KB / 57 KB


def test_kernel_registers_compiles_the_decode_kernel_for_sm90(tmp_path: Path) -> None:
    """No GPU needed: Triton's ptxas builds the sm_90 cubin and cuobjdump reads it. In a child
    without TRITON_INTERPRET (under it, kernels are not compiled)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this triton build has no bundled cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent.parent / "benchmarks" / "kernel_registers.py"
    out = tmp_path / "regs.json"
    args = ["--head-dim", "64", "--warps", "4", "--block-n", "16", "--json", str(out)]
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert 16 <= row["registers"] <= 255 and row["stack_bytes"] >= 0
    assert row["programs_per_sm"] * row["warps"] == row["warps_per_sm"] >= 4


def test_sim_serving_charges_modeled_steps() -> None:
    from sim_serving import STEP_MODEL_3B, simulate, step_ms

    model = STEP_MODEL_3B
    assert step_ms(0, 1, model) == model["fixed_ms"]  # under the knee: the fixed cost only
    assert step_ms(640, 1, model) == model["fixed_ms"] + model["decode_ms_per_640"]
    knee = int(model["knee"])
    assert step_ms(0, knee + 100, model) == model["fixed_ms"] + 100 * model["token_ms"]
    budget = {"scheduler.max_batched_tokens": 8192, "scheduler.prefill_chunk": 8192}
    r = simulate(2, 4, budget, input_len=64, output_len=16)
    # Two rounds of 2 clients: each round one prompt step, then 15 decode steps.
    assert r["steps"] == 2 * 16
    assert r["output_tok_s"] <= 2 * 1000 / model["fixed_ms"]  # a token a client a step at best
    assert r["ttft_ms"] >= model["fixed_ms"]


def test_server_intake_times_text_and_id_prompts(tmp_path: Path) -> None:
    from conftest import FIXTURES

    qwen = FIXTURES / "tokenizers" / "qwen"
    if not (qwen / "tokenizer.json").is_file():
        pytest.skip(f"no Qwen tokenizer fixture at {qwen}")
    script = Path(__file__).parent.parent / "benchmarks" / "server_intake.py"
    out = tmp_path / "intake.json"
    args = ["--tokenizer", str(qwen), "--clients", "3", "--input-len", "64", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--step-ms", "1", "--json", str(out)],
        capture_output=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompts"] for r in rows] == ["text", "ids"]
    assert all(0 < r["ttft_mean_ms"] <= r["ttft_max_ms"] for r in rows)


def test_cold_start_variants_parse_into_config_overrides() -> None:
    from cold_start import parse_variant

    got = parse_variant("engine.compile_threads=8 engine.cuda_graphs=false model.dtype=bfloat16")
    assert got == {
        "engine.compile_threads": 8,
        "engine.cuda_graphs": False,
        "model.dtype": "bfloat16",
    }


def test_cold_start_prints_the_dry_runs_compiles() -> None:
    from cold_start import compiles_line

    compiles = {"variants": 42, "wall_s": 6.04, "summed_s": 30.5,
                "longest": [["decode_kernel", 4.25], ["tma_gemv_kernel", 3.1]]}  # fmt: skip
    assert compiles_line(compiles) == (
        "42 variants, 30.5 s of compiles in 6.0 s; "
        "longest: decode_kernel 4.25, tma_gemv_kernel 3.10"
    )


@interpreted
def test_tune_prefill_attention_sweeps_the_grid(tmp_path: Path) -> None:
    """Toy sizes under the interpreter: every combination of the grid runs, is checked against
    the default's output and lands in the JSON with its time."""
    from tune_prefill_attention import main

    out = tmp_path / "tune.json"
    rows = main(["--shapes", "2x40", "--heads", "4,2", "--head-dim", "16", "--layers", "2",
                 "--reps", "1", "--grid", "block_n=16,32", "--grid", "stages=1,2",
                 "--json", str(out)])  # fmt: skip
    assert len(rows) == 1 and rows[0]["tokens"] == 40
    configs = {(r["block_n"], r["stages"]) for r in rows[0]["all"]}
    assert configs == {(16, 1), (16, 2), (32, 1), (32, 2)}
    assert all(r["us"] > 0 and r["tflops"] > 0 for r in rows[0]["all"])
    assert json.loads(out.read_text())["rows"][0]["best"] in rows[0]["all"]


def test_cold_start_names_the_kernels_compiled_after_the_dry_run(tmp_path) -> None:
    """late_compiles: each kernel file Triton wrote (<hash>/<name>.json) goes to the last phase
    that had begun when it was written; those written before any phase, and group files, not."""
    import os

    from cold_start import late_compiles

    written = {"aa/early_kernel.json": 100.0, "bb/decode_kernel.json": 205.0,
               "cc/tma_gemv_kernel.json": 310.0, "cc/__grp__tma_gemv_kernel.json": 310.0,
               "dd/rms_norm_kernel.json": 201.0}  # fmt: skip
    for name, mtime in written.items():
        f = tmp_path / name
        f.parent.mkdir(exist_ok=True)
        f.write_text("{}")
        os.utime(f, (mtime, mtime))
    got = late_compiles(str(tmp_path), {"cuda_graphs": 300.0, "warm_up": 200.0})
    assert got == {
        "warm_up": ["decode_kernel", "rms_norm_kernel"],
        "cuda_graphs": ["tma_gemv_kernel"],
    }
    assert late_compiles(str(tmp_path), {}) == {}


@interpreted
@pytest.mark.parametrize("phases", [1, 3])
def test_grid_barrier_bench_kernels_chain_their_phases(phases: int) -> None:
    """bench_grid_barrier's phases, under the interpreter: a launch a phase over 4 programs,
    and the persistent form over one program (the interpreter runs programs one after another,
    so a barrier over more would wait forever): the last phase's slots hold the phase count."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from bench_grid_barrier import run_barrier, run_launches

    buf = torch.zeros(phases + 1, 4, dtype=torch.int32)
    run_launches(buf, 4, pdl=True)  # PDL is off on the CPU: plain launches
    assert buf.tolist() == [[i] * 4 for i in range(phases + 1)]
    one = torch.zeros(phases + 1, 1, dtype=torch.int32)
    counter = torch.full((1,), 7, dtype=torch.int32)
    run_barrier(one, counter, 1)
    assert one.flatten().tolist() == list(range(phases + 1))
    assert int(counter) == phases - 1  # reset, then one arrival per barrier


@interpreted
@pytest.mark.parametrize("last", [False, True])
def test_grid_barrier_bench_split_phases_finish_each_group(last: bool) -> None:
    """The split-GEMM phases over 3 groups of 4 programs, each finished by a launch of its own
    or by the group's last program to arrive: every phase's finished values are the phase
    count, the parts hold the phase before's + 1, and the last arrivals reset the counts."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from bench_grid_barrier import run_split

    phases, groups = 3, 3
    final = torch.full((phases + 1, groups), -1, dtype=torch.int32)
    final[0] = 0
    part = torch.zeros(phases + 1, 4 * groups, dtype=torch.int32)
    count = torch.zeros(groups, dtype=torch.int32)
    run_split(final, part, count, last)
    assert final.tolist() == [[i] * groups for i in range(phases + 1)]
    assert part[1:].tolist() == [[i] * 4 * groups for i in range(1, phases + 1)]
    assert count.tolist() == [0] * groups


def test_prefill_peers_checks_each_variant_against_the_first(tmp_path: Path) -> None:
    """Toy sizes under the interpreter: the Triton kernels (the dense one at two configs) and
    SDPA agree, the FlashInfer variants are reported as not runnable without a GPU, and
    unknown names are refused."""
    from bench_prefill_peers import main

    out = tmp_path / "peers.json"
    args = ["--shapes", "2x24", "--heads", "4,2", "--head-dim", "16", "--layers", "2"]
    args += ["--reps", "1", "--dense", "16x16x4x1,32x16x4x2"]
    rows = main([*args, "--variants", "triton,triton-dense,sdpa,fi-fa3", "--json", str(out)])
    assert [r["variant"] for r in rows] == [
        "triton",
        "triton-dense 16x16x4x1",
        "triton-dense 32x16x4x2",
        "sdpa",
    ]
    assert rows[0]["rel_err"] == 0 and all(r["rel_err"] < 1e-4 for r in rows[1:])
    assert json.loads(out.read_text())["rows"] == rows
    with pytest.raises(SystemExit, match="unknown"):
        main(["--variants", "triton,flash"])


def test_step_trace_finds_prompt_phases_and_their_adds(tmp_path: Path) -> None:
    """benchmarks/step_trace.py: runs of steps past 3 x the median are prompt phases; the adds
    of 50 ms before one to its end are its own, handed over at taken - the ms they carry."""
    from step_trace import describe, phases, read

    lines = ["0.990000 add 1 2.000", "0.995000 gc 0 0.100 0"]  # handed at 0.988
    t = 1.0
    for ms in (100.0, 120.0):  # phase 1
        lines.append(f"{t:.6f} step {ms:.3f} 2 4 0")
        t += ms / 1e3
    for _ in range(10):  # decode steps
        lines.append(f"{t:.6f} step 5.000 4 4 0")
        t += 0.005
    lines.append(f"{t + 0.010:.6f} add 1 1.000")  # taken inside phase 2
    lines.append(f"{t:.6f} step 90.000 4 4 1")  # phase 2: one step
    lines.append(f"{t + 0.090:.6f} step 5.000 4 4 0")
    path = tmp_path / "trace.txt"
    path.write_text("\n".join(lines) + "\n")
    found = phases(*read(path))
    assert [len(p.steps) for p in found] == [2, 1]
    assert found[0].ms == pytest.approx(220.0)
    assert found[0].adds == 1 and found[0].handed_ms == pytest.approx((-12.0, -12.0))
    assert found[0].decodes_after == 10 and found[0].decode_ms_after == pytest.approx(5.0)
    assert found[1].adds == 1 and found[1].handed_ms == pytest.approx((9.0, 9.0))
    assert found[1].decodes_after == 1
    assert "phase 2" in describe(found) and "2 steps of 100.0 120.0 ms" in describe(found)


def _smi_line(wall: float, sm: int, power: float, reasons: int, util: int) -> str:
    """One nvidia-smi --query-gpu=gpu_clocks.QUERY --format=csv,noheader line."""
    from datetime import datetime

    stamp = datetime.fromtimestamp(wall).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {sm} MHz, 3201 MHz, {power:.2f} W, 50, 0x{reasons:016x}, {util} %"


def test_gpu_clocks_summarizes_busy_samples_on_the_monotonic_clock() -> None:
    """benchmarks/gpu_clocks.py: samples land on time.monotonic() through the file's offset;
    the clock and power figures count busy samples only, the energy every sample's span."""
    from gpu_clocks import describe, parse, summarize

    offset = 1_700_000_000.0  # wall minus monotonic
    rows = [  # (monotonic s, SM MHz, W, reasons, utilization %)
        (10.0, 1980, 120.0, 0x0, 0),
        (10.1, 1500, 690.0, 0x4, 100),
        (10.2, 1600, 700.0, 0x4, 100),
        (10.3, 1900, 650.0, 0x0, 100),
        (10.4, 1980, 100.0, 0x1, 0),
    ]
    text = "\n".join(
        [f"offset {offset:.6f}", *(_smi_line(offset + t, *r) for t, *r in rows), "2026/12/0"]
    )
    samples = parse(text)
    assert len(samples) == 5  # the cut-off last line is skipped
    assert [s.monotonic for s in samples] == pytest.approx([r[0] for r in rows], abs=2e-3)
    got = summarize(samples)
    assert got["busy_samples"] == 3 and got["sm_mhz_median"] == 1600
    assert got["power_w_mean"] == pytest.approx(680.0)
    assert got["power_capped"] == pytest.approx(2 / 3)
    assert got["energy_j"] == pytest.approx(452.0 * 0.4, rel=1e-2)  # mean of all 5 x 0.4 s
    window = summarize(samples, 10.15, 10.35)
    assert window["busy_samples"] == 2 and window["power_capped"] == 0.5
    assert "1750 MHz" in describe(window) and "capped 50%" in describe(window)
    assert summarize(samples, 20.0, 21.0)["busy_samples"] == 0


def test_gpu_clocks_samples_beside_a_block_and_survives_no_nvidia_smi(tmp_path: Path) -> None:
    """GpuClocks runs its command while the block runs and summarizes what it wrote; a missing
    command gives an error summary, not an exception."""
    from gpu_clocks import GpuClocks

    fake = (  # three busy samples of 1700-1702 MHz at the time it prints them, then waits
        "import time\n"
        "from datetime import datetime\n"
        "for i in range(3):\n"
        "    stamp = datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{stamp}, {1700 + i} MHz, 3201 MHz, 695.00 W, 50, 0x4, 100 %', flush=True)\n"
        "    time.sleep(0.05)\n"
        "time.sleep(30)\n"
    )
    clocks = GpuClocks(tmp_path / "c.csv", command=[sys.executable, "-c", fake])
    with clocks:
        deadline = time.monotonic() + 20
        while (tmp_path / "c.csv").read_text().count("MHz") < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert clocks.proc is not None and clocks.proc.poll() is not None  # stopped
    assert clocks.summary["busy_samples"] == 3 and clocks.summary["sm_mhz_median"] == 1701
    assert clocks.summary["power_capped"] == 1.0
    missing = GpuClocks(tmp_path / "m.csv", command=["no-such-nvidia-smi"])
    with missing:
        pass
    assert "not found" in missing.summary["unavailable"] and not (tmp_path / "m.csv").exists()


def test_step_trace_gives_each_phase_its_clocks(tmp_path: Path) -> None:
    """step_trace.add_clocks: the samples inside a prompt phase are its clocks, those from its
    end to the next phase its decode steps'."""
    from gpu_clocks import Sample
    from step_trace import add_clocks, describe, phases, read

    lines, t = [], 1.0
    for ms in [200.0] + [5.0] * 40 + [200.0, 5.0]:
        lines.append(f"{t:.6f} step {ms:.3f} 4 4 0")
        t += ms / 1e3
    path = tmp_path / "trace.txt"
    path.write_text("\n".join(lines) + "\n")
    steps, adds = read(path)
    found = phases(steps, adds)
    assert len(found) == 2
    samples = [  # phase 1 (1.0-1.2 s) at 1500 MHz, its decode steps (1.2-1.4) at 1900
        Sample(t, 1500.0 if t < 1.2 else 1900.0, 3201.0, 690.0, 50.0, 4, 100.0)
        for t in (1.05, 1.1, 1.15, 1.25, 1.3, 1.35)
    ]
    add_clocks(found, samples, steps)
    assert found[0].clocks["sm_mhz_median"] == 1500 and found[0].clocks["busy_samples"] == 3
    assert found[0].decode_clocks["sm_mhz_median"] == 1900
    assert found[1].clocks["busy_samples"] == 0
    assert "[GPU 1500 MHz, 690 W, capped 100%, 3 samples]" in describe(found)


def test_power_floor_windows_rates_and_estimate() -> None:
    """benchmarks/power_floor.py: a window takes the samples inside it, busy or not; the rates
    are each workload's power beyond idle over its rate; the estimate adds up their parts."""
    from gpu_clocks import Sample
    from power_floor import energy_estimate, floor_seconds, rates_from, window_stats

    samples = [Sample(t, mhz, 0.0, w, 50.0, r, u) for t, mhz, w, r, u in [
        (1.0, 1980, 100.0, 0x0, 0), (1.1, 1980, 110.0, 0x0, 0),  # idle
        (2.0, 1700, 690.0, 0x4, 100), (2.1, 1500, 700.0, 0x4, 100), (2.2, 1600, 650.0, 0x0, 90),
    ]]  # fmt: skip
    idle = window_stats(samples, [(0.9, 1.15)])
    assert idle == {"samples": 2, "sm_mhz_median": 1980, "power_w_mean": 105.0, "power_capped": 0}
    busy = window_stats(samples, [(1.95, 2.05), (2.15, 2.25)])  # two windows, 2.1 outside both
    assert busy["samples"] == 2 and busy["sm_mhz_median"] == 1650
    assert busy["power_w_mean"] == pytest.approx(670.0) and busy["power_capped"] == 0.5
    assert window_stats(samples, [(5.0, 6.0)]) == {"samples": 0}
    rows = {
        "idle": {"power_w_mean": 100.0},
        "read": {"power_w_mean": 500.0, "tb_s": 4.0},
        "gemm": {"power_w_mean": 700.0, "tflops": 600.0},
    }
    rates = rates_from(rows)
    assert rates == pytest.approx(
        {"idle_w": 100.0, "j_per_byte": 1e-10, "j_per_flop": 1e-12, "read_bytes_s": 4e12}
    )
    assert rates_from({k: v for k, v in rows.items() if k != "gemm"}) is None
    est = energy_estimate(0.006, 2e10, 1e12, rates)
    assert est["idle_j"] == pytest.approx(0.6) and est["dram_j"] == pytest.approx(2.0)
    assert est["flop_j"] == pytest.approx(1.0) and est["total_j"] == pytest.approx(3.6)
    floor = floor_seconds(2e10, 1e12, rates, limit_w=700.0)  # 3 J of work over 600 W beyond idle
    assert floor == pytest.approx({"bandwidth_s": 0.005, "power_s": 0.005})


def test_offline_gc_records_collections_by_generation() -> None:
    """benchmarks/offline_gc.py: the callback times real collections; the summary counts them
    by generation and lists generation 2's from the span's start."""
    import gc

    from offline_gc import Collections, summarize

    record = Collections()
    gc.callbacks.append(record)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(record)
    assert [e[0] for e in record.events] == [0, 2] and all(e[2] >= 0 for e in record.events)
    got = summarize([(0, 10.0, 0.1, 0), (2, 11.5, 5.0, 3), (1, 10.2, 1.0, 0)], t0=10.0)
    assert got["collections"] == {0: 1, 1: 1, 2: 1}
    assert got["ms_total"] == {0: 0.1, 1: 1.0, 2: 5.0} and got["gen2"] == [(1.5, 5.0, 3)]


def test_power_floor_run_ceilings_add_up_each_runs_steps() -> None:
    """A run's ceiling is its steps' work J over the power beyond idle; a run with a step not
    measured is left out."""
    from power_floor import run_ceilings

    rows = {
        "decode-64": {"work_j_estimate": 3.0, "work_j_measured": 3.3},
        "prompt": {"work_j_estimate": 100.0, "work_j_measured": 102.0},
    }
    got = run_ceilings(rows, idle_w=100.0, limit_w=700.0)
    assert list(got) == ["c=64, 2 waves"]  # no decode-256: no offline ceiling
    c = got["c=64, 2 waves"]
    assert c["estimate_s"] == pytest.approx((510 * 3.0 + 8 * 100.0) / 600.0)
    assert c["measured_s"] == pytest.approx((510 * 3.3 + 8 * 102.0) / 600.0)
    assert c["estimate_tok_s"] == pytest.approx(128 * 256 / c["estimate_s"])
    rows["decode-256"] = {"work_j_estimate": 7.0, "work_j_measured": 7.7}
    off = run_ceilings(rows, idle_w=100.0, limit_w=700.0)["offline 256"]
    assert off["measured_tok_s"] == pytest.approx(256 * 256 * 600.0 / (255 * 7.7 + 16 * 102.0))


@interpreted
def test_power_floor_read_kernel_sums_each_tile() -> None:
    """The read sweep's Triton kernel, under the interpreter: one fp32 sum a 16-element tile,
    nothing read past n; read_all sweeps tensors of any size."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from power_floor import read_kernel

    x = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = torch.empty(4, dtype=torch.float32)
    read_kernel()[(4,)](x, out, 60, BLOCK=16)  # the last tile masked past 60
    want = torch.cat([x[:60], torch.zeros(4, dtype=x.dtype)]).double().view(4, 16).sum(dim=1)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    from power_floor import READ_BLOCK, read_all

    odd = torch.ones(READ_BLOCK + 3, dtype=torch.bfloat16)
    sums = read_all([odd, x.view(4, 16)])()  # a partial last tile; any shape
    assert sums[0].tolist() == [READ_BLOCK, 3.0]
    assert sums[1].item() == pytest.approx(x.double().sum().item(), abs=1e-4)
