"""Weight prefetch into L2 (engine.l2_prefetch_mib): which weight each linear layer asks for,
that nothing happens off the GPU or outside captures, and on the GPU that the kernel carries the
bulk-prefetch instruction and that graphs with prefetches generate exactly what graphs without do.
"""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import on_gpu  # noqa: E402
from test_cuda_graphs import checkpoint  # noqa: E402

from inferx_core.config import ConfigError, load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.interfaces.quant import QuantLinear  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_core.weight_prefetch import WeightPrefetch  # noqa: E402


class RecordingOps(TorchOps):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[torch.Tensor, int]] = []

    def prefetch_l2(self, weight: torch.Tensor, max_bytes: int) -> bool:
        self.asked.append((weight, max_bytes))
        return True


def cpu_llm(path) -> LLM:
    return LLM(
        load_config(
            None,
            {
                "model.path": str(path),
                "model.dtype": "float32",
                "model.max_model_len": 64,
                "engine.device": "cpu",
                "scheduler.max_running": 2,
            },
        )
    )


def test_each_linear_names_the_next_one_in_running_order(tmp_path_factory) -> None:
    llm = cpu_llm(checkpoint("qwen2", tmp_path_factory))
    model = llm.engine.executor.model
    prefetch = WeightPrefetch(model, RecordingOps(), 1 << 30)
    layers = model.model.layers
    expected = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        expected += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    assert all(isinstance(m, QuantLinear) for m in expected)
    for m, n in zip(expected, expected[1:], strict=False):
        assert prefetch.next[m] is n.weight
    assert expected[-1] not in prefetch.next  # the last one has nothing after it


def test_weights_over_max_bytes_are_never_prefetched(tmp_path_factory) -> None:
    llm = cpu_llm(checkpoint("llama", tmp_path_factory))
    model = llm.engine.executor.model
    sizes = {
        m: m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, QuantLinear)
    }
    cut = sorted(sizes.values())[len(sizes) // 2]
    prefetch = WeightPrefetch(model, RecordingOps(), cut)
    assert prefetch.next, "some layers are at most the median size"
    small = {id(m.weight) for m, size in sizes.items() if size <= cut}
    assert {id(w) for w in prefetch.next.values()} == small - {id(next(iter(sizes)).weight)}


def test_nothing_is_issued_on_the_cpu_or_outside_active(tmp_path_factory) -> None:
    """Hooks are inert unless active(), and active() on the CPU has no stream to issue on:
    generation is unchanged and the ops are never asked."""
    llm = cpu_llm(checkpoint("qwen2", tmp_path_factory))
    ex = llm.engine.executor
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = llm.generate([[3, 5, 7, 9]], params)[0].token_ids
    ops = RecordingOps()
    prefetch = WeightPrefetch(ex.model, ops, 1 << 30)
    assert llm.generate([[3, 5, 7, 9]], params)[0].token_ids == before
    with prefetch.active(ex.device):
        assert llm.generate([[3, 5, 7, 9]], params)[0].token_ids == before
    assert ops.asked == [] and prefetch.issued == 0


def test_config_key_is_checked() -> None:
    with pytest.raises(ConfigError, match="l2_prefetch_mib"):
        load_config(None, {"engine.l2_prefetch_mib": -1})


@pytest.mark.gpu
@on_gpu
def test_gpu_prefetch_kernel_carries_the_bulk_prefetch() -> None:
    from inferx_kernels_cuda import l2_prefetch

    if not l2_prefetch.supported(torch.device("cuda")):
        pytest.skip("needs sm_90 or later")
    w = torch.randn(3000, 1000, device="cuda", dtype=torch.bfloat16)
    copy = w.clone()
    assert l2_prefetch.prefetch_l2(w, 5 << 20)
    assert not l2_prefetch.prefetch_l2(w.view(-1)[1:], 1 << 20)  # 2-byte aligned: refused
    torch.cuda.synchronize()
    assert torch.equal(w, copy)
    kernel = l2_prefetch.l2_prefetch_kernel[(1,)](
        w.data_ptr(), 4096, CHUNK=l2_prefetch.CHUNK, LANES=l2_prefetch.LANES, num_warps=1
    )
    assert "cp.async.bulk.prefetch.L2.global" in kernel.asm["ptx"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_graphs_with_prefetch_generate_the_same(arch: str, tmp_path_factory) -> None:
    """Prefetches are extra graph nodes on a side stream that change no value: the same tokens
    and bit-identical logprobs with and without, decode and mixed graphs alike."""
    path = checkpoint(arch, tmp_path_factory)
    base = {
        "model.path": str(path),
        "model.dtype": "bfloat16",
        "engine.device": "cuda",
        "engine.attention_backend": "triton",
        "kv_cache.memory": "512MiB",
        "scheduler.prefix_cache": False,
    }
    on = LLM(load_config(None, {**base, "engine.l2_prefetch_mib": 4}))
    ex = on.engine.executor
    assert ex.graphs is not None and ex.prefetch is not None
    assert ex.prefetch.issued > 0, "no prefetch was captured"
    print(f"{arch}: {ex.prefetch.issued} prefetches issued while capturing")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    got_on = on.generate(prompts, params)
    del on, ex
    gc.collect()
    off = LLM(load_config(None, base))
    assert off.engine.executor.prefetch is None
    got_off = off.generate(prompts, params)
    for a, b in zip(got_on, got_off, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
