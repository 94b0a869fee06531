"""KV cache sizing by a profiling pass: the budget arithmetic as a pure function, the profiling
step's plumbing on the CPU (torch.cuda's memory counters faked), and on a GPU a real profile."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import inferx_core.executor as executor_mod
import inferx_kernels_cuda.runtime as runtime_mod
from inferx_core.attention_torch import TorchAttention
from inferx_core.config import load_config
from inferx_core.executor import GiB, LoadError
from inferx_kernels_cuda.jit_compile import Compile
from inferx_kernels_cuda.runtime import CudaModelRunner, MemoryProfile, kv_cache_blocks

MiB = 1 << 20
# A 100 GiB card: 1 GiB outside torch, 10 GiB of weights, 4 GiB of activations, 1 GiB of graphs.
PROFILE = MemoryProfile(
    total=100 * GiB, other=1 * GiB, weights=10 * GiB, activations=4 * GiB, cuda_graphs=1 * GiB
)
BLOCK = 2 * MiB


def test_fraction_is_of_the_whole_card_less_what_is_used() -> None:
    assert PROFILE.used == 16 * GiB
    assert kv_cache_blocks(0.9, BLOCK, PROFILE) == (90 * GiB - 16 * GiB) // BLOCK
    assert kv_cache_blocks(1.0, BLOCK, PROFILE) == 84 * GiB // BLOCK


def test_fraction_smaller_than_what_is_used_is_refused_by_key() -> None:
    with pytest.raises(LoadError) as err:
        kv_cache_blocks(0.1, BLOCK, PROFILE)
    msg = str(err.value)
    assert msg.startswith("kv_cache.memory = 0.1 ")
    assert "10.00 GiB" in msg and "16.00 GiB in use" in msg and "weights 10.00" in msg


def test_absolute_size_must_fit_in_what_is_free_after_the_peak() -> None:
    assert kv_cache_blocks(40 * GiB, BLOCK, PROFILE) == 40 * GiB // BLOCK
    assert kv_cache_blocks(84 * GiB, BLOCK, PROFILE) == 84 * GiB // BLOCK
    with pytest.raises(LoadError) as err:
        kv_cache_blocks(85 * GiB, BLOCK, PROFILE)
    msg = str(err.value)
    assert msg.startswith("kv_cache.memory = 85.00 GiB does not fit")
    assert "at most 84.00 GiB" in msg and "activation peak 4.00" in msg


def test_fewer_than_two_blocks_is_refused_by_key() -> None:
    with pytest.raises(LoadError, match=r"^kv_cache\.memory leaves room for 1 KV blocks"):
        kv_cache_blocks(BLOCK + 1, BLOCK, PROFILE)


def tiny_runner(**overrides: object) -> CudaModelRunner:
    base = {
        "model.preset": "tiny-llama",
        "model.dtype": "float32",
        "engine.device": "cpu",
        "kv_cache.memory": "16MiB",
        "scheduler.max_batched_tokens": 100,
        "scheduler.prefill_chunk": 48,
        "scheduler.max_running": 8,
    }
    return CudaModelRunner(load_config(None, {**base, **overrides}))


def test_cpu_keeps_the_configured_size() -> None:
    runner = tiny_runner()
    assert runner.num_kv_blocks == 16 * MiB // runner.attention.bytes_per_block()
    assert runner.report.memory == {} and "profile" not in runner.report.seconds


def test_cpu_size_past_the_machines_memory_is_refused_by_key(monkeypatch) -> None:
    """A CPU cache larger than the machine's memory used to die in torch's allocator with a
    traceback (or the OOM killer); it is a LoadError naming kv_cache.memory."""
    monkeypatch.setattr(executor_mod, "physical_memory", lambda: 8 * MiB)
    with pytest.raises(LoadError, match=r"^kv_cache\.memory = 0\.02 GiB is more than .* 0\.01 GiB"):
        tiny_runner()
    monkeypatch.setattr(executor_mod, "physical_memory", lambda: 0)  # the OS does not say
    assert tiny_runner().num_kv_blocks > 0


def test_a_cache_that_cannot_be_allocated_is_refused_by_key(monkeypatch) -> None:
    """Whatever sized it, an allocation that fails (out of memory) names the key."""

    def out_of_memory(self, num_blocks: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore detail")

    monkeypatch.setattr(TorchAttention, "allocate", out_of_memory)
    with pytest.raises(LoadError, match=r"^kv_cache\.num_blocks: the KV cache of 64 blocks"):
        tiny_runner(**{"kv_cache.num_blocks": 64})
    with pytest.raises(LoadError, match=r"^kv_cache\.memory: .* can't allocate memory\)$"):
        tiny_runner()


def test_num_blocks_below_two_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="kv_cache.num_blocks"):
        load_config(None, {"kv_cache.num_blocks": 1})


def test_profile_layout_is_the_largest_step(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tiny_runner()
    lens, tables, graph_batch, blocks = runner._profile_layout()
    assert lens == [48, 48, 4] and graph_batch == 0  # the CPU decodes eagerly
    assert [len(t) for t in tables] == [3, 3, 1] and tables[0][0] == 1  # block 0: padding
    assert blocks == 8
    few = tiny_runner(**{"scheduler.max_running": 2, "scheduler.prefill_chunk": 16})
    assert few._profile_layout()[0] == [16, 16]  # no more chunks than running sequences
    monkeypatch.setattr(runtime_mod, "eager_reason", lambda *a: None)
    assert runner._profile_layout()[2:] == (8, 9)  # one block for each graph row


class FakeCudaMemory:
    """torch.cuda's memory counters, scripted, so the profiling pass runs on the CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated = 100
        self.peak = 150
        self.calls: list[str] = []
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: self.calls.append(_n))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 120)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1000, 2000))


def test_profiling_pass_runs_both_steps_and_drops_its_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = tiny_runner()
    steps: list[tuple[list[int], int, bool, tuple[int, ...]]] = []
    real_step = runner._profile_step

    def step(query_lens: list[int], tables: list[list[int]], rows: int, sample: bool):
        logits = real_step(query_lens, tables, rows, sample)
        steps.append((query_lens, rows, sample, tuple(logits.shape)))
        return logits

    monkeypatch.setattr(runner, "_profile_step", step)
    monkeypatch.setattr(runtime_mod, "eager_reason", lambda *a: None)
    fake = FakeCudaMemory(monkeypatch)
    profile = runner._profile_memory()
    vocab = runner.vocab_size
    assert steps == [([48, 48, 4], 8, True, (8, vocab)), ([1] * 8, 8, False, (8, vocab))]
    assert runner.attention.caches[0].shape[1] == 1  # the temporary cache is gone
    logits_bytes = 8 * vocab * 4
    assert profile == MemoryProfile(2000, 1000 - 120, 100, 50, 50 + logits_bytes)
    assert fake.calls.count("reset_peak_memory_stats") == 2


def test_profiling_compiles_in_a_dry_run_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """With engine.compile_threads > 1 the profiling steps first run dry (Triton kernels
    compile on threads, nothing samples) inside compiles_in_background, with the warm-up's
    steps and every graph size beside them (one wait for all of start-up's compiles), then
    for real; the measured profile is the same as without."""
    runner = tiny_runner()
    runner.compile_threads = 2
    steps: list[tuple[list[int], bool, bool]] = []
    dry: list[bool] = []
    real_step = runner._profile_step

    def step(
        query_lens: list[int],
        tables: list[list[int]],
        rows: int,
        sample: bool,
        context_lens: list[int] | None = None,
    ):
        steps.append((query_lens, sample, bool(dry)))
        return real_step(query_lens, tables, rows, sample, context_lens)

    @contextlib.contextmanager
    def background(threads: int):
        assert threads == 2
        dry.append(True)
        yield [Compile("decode_kernel", 0.0, 1.5), Compile("rms_norm_kernel", 0.1, 0.5)]
        dry.clear()

    class Ladder:  # a graph runner: what its dry run saw
        def __init__(self) -> None:
            self.dry_runs: list[bool] = []

        def dry_run(self) -> None:
            self.dry_runs.append(bool(dry))

    runner.graphs, runner.mixed = Ladder(), Ladder()  # type: ignore[assignment]
    monkeypatch.setattr(runner, "_profile_step", step)
    monkeypatch.setattr(runtime_mod, "compiles_in_background", background)
    monkeypatch.setattr(runtime_mod, "eager_reason", lambda *a: None)
    fake = FakeCudaMemory(monkeypatch)
    profile = runner._profile_memory()
    assert steps[:2] == [([48, 48, 4], False, True), ([1] * 8, False, True)]
    assert steps[-2:] == [([48, 48, 4], True, False), ([1] * 8, False, False)]
    warm_up = steps[2:-2]  # the warm-up's eager decodes that fit the temporary cache, dry
    assert ([1, 1], False, True) in warm_up and ([1, 16], False, True) in warm_up
    assert all(d and q in ([1], [1, 1], [1, 17], [1, 16]) for q, _, d in warm_up)
    assert runner.graphs.dry_runs == [True] and runner.mixed.dry_runs == [True]
    assert runner._compiled_ahead
    assert runner.report.compiles["variants"] == 2 and runner.report.compiles["summed_s"] == 2.0
    assert runner.report.compiles["longest"][0] == ["decode_kernel", 1.5]
    logits_bytes = 8 * runner.vocab_size * 4
    assert profile == MemoryProfile(2000, 1000 - 120, 100, 50, 50 + logits_bytes)
    assert fake.calls.count("reset_peak_memory_stats") == 2


@pytest.mark.parametrize("compile_threads", [0, 2])  # 2: the dry run is where it runs out
def test_profiling_out_of_memory_names_the_key(
    monkeypatch: pytest.MonkeyPatch, compile_threads: int
) -> None:
    runner = tiny_runner()
    runner.compile_threads = compile_threads
    FakeCudaMemory(monkeypatch)

    def step(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(runner, "_profile_step", step)
    with pytest.raises(LoadError, match=r"scheduler\.max_batched_tokens\) ran out of device"):
        runner._profile_memory()
    assert runner.attention.caches[0].shape[1] == 1  # the temporary cache is gone all the same


@pytest.mark.gpu
def test_profiled_cache_fits_and_too_large_a_budget_is_refused() -> None:
    gpu = {
        "model.preset": "tiny-qwen2",
        "model.dtype": "bfloat16",
        "engine.device": "cuda",
        "engine.attention_backend": "triton",
        "scheduler.max_batched_tokens": 1024,
        "scheduler.prefill_chunk": 512,
        "scheduler.max_running": 32,
    }
    fraction = 0.2
    runner = CudaModelRunner(load_config(None, {**gpu, "kv_cache.memory": fraction}))
    try:
        mem = runner.report.memory
        total = mem["total"]  # what the driver reports; the card's properties may differ
        assert total > 0 and mem["weights"] > 0 and mem["activations"] > 0
        assert mem["cuda_graphs"] > 0 and runner.graphs is not None
        used = mem["other"] + mem["weights"] + mem["activations"] + mem["cuda_graphs"]
        per_block = runner.attention.bytes_per_block()
        assert mem["kv_cache"] == runner.num_kv_blocks * per_block
        assert fraction * total - used - per_block < mem["kv_cache"] <= fraction * total - used
        # Everything InferX holds once started (graphs captured) stays within the fraction.
        torch.cuda.synchronize()
        held = torch.cuda.memory_reserved() + mem["other"]
        assert held <= fraction * total + 256 * MiB, (held / GiB, mem)
        assert runner.report.seconds["profile"] > 0
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    card = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(LoadError, match=r"^kv_cache\.memory = .* GiB does not fit"):
        CudaModelRunner(load_config(None, {**gpu, "kv_cache.memory": card}))
    gc.collect()
    torch.cuda.empty_cache()
