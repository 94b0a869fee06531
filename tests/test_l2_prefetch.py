"""The L2 prefetch of the MLP's weights (inferx_kernels_cuda.l2_prefetch, TritonOps.prefetch_mlp):
its settings are checked, it does nothing on the CPU, and on the GPU it changes no result: a
model generates the same tokens and bit-identical logits with it on (on a side stream inside
the CUDA graphs) and off."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")
pytest.importorskip("transformers")

from test_cuda_graphs import LogitsRecorder, checkpoint  # noqa: E402

from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.quant_none import DenseLinear  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_kernels_cuda.l2_prefetch import l2_prefetch  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("INFERX_L2_PREFETCH", "1.5"),
        ("INFERX_L2_PREFETCH", "quarter"),
        ("INFERX_L2_PREFETCH_DOWN", "-0.1"),
        ("INFERX_L2_PREFETCH_AT", "mlp"),
        ("INFERX_L2_PREFETCH_ROWS", "x"),
    ],
)
def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        TritonOps()


def test_off_by_default_and_nothing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TritonOps().l2_gate_up == 0.0 and TritonOps().l2_down == 0.0
    monkeypatch.setenv("INFERX_L2_PREFETCH", "0.25")
    monkeypatch.setenv("INFERX_L2_PREFETCH_AT", "layer")
    ops = TritonOps()
    assert (ops.l2_gate_up, ops.l2_at) == (0.25, "layer")
    cpu = torch.device("cpu")
    gate_up = DenseLinear(8, [16, 16], False, torch.float32, cpu)
    down = DenseLinear(16, [8], False, torch.float32, cpu)
    x = torch.randn(4, 2, 8)
    for at in ("layer", "qkv"):
        ops.prefetch_mlp(gate_up, down, x, at)
    ops.join_side_work(x)
    assert not ops._side_streams and not ops._side_pending


@pytest.mark.parametrize(
    "weight",
    [torch.zeros(4, 8)[:, ::2], torch.zeros(4, 9, dtype=torch.bfloat16)],
    ids=["strided", "unaligned rows"],
)
def test_prefetch_checks_the_weight(weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="l2_prefetch"):
        l2_prefetch(weight, 0.25)


def test_prefetch_checks_the_fraction() -> None:
    with pytest.raises(ValueError, match="fraction"):
        l2_prefetch(torch.zeros(4, 64), 0.0)


@pytest.mark.gpu
def test_gpu_prefetch_changes_nothing(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation of a tiny Qwen2 in bf16 with CUDA graphs, prefetch off, then on at both
    fork points (gate_up and down_proj, each K-slice's first half): the same tokens, the same
    logits bit for bit, at batches 1, 3 and 8."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper or newer GPU")
    path = checkpoint("qwen2", tmp_path_factory)
    base = {
        "model.path": str(path),
        "model.dtype": "bfloat16",
        "engine.device": "cuda",
        "engine.attention_backend": "triton",
        "kv_cache.memory": "512MiB",
        "scheduler.prefix_cache": False,
    }
    prompts = [[3 + i, 17, 29 + 2 * i, 5] * (2 + i) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run() -> tuple[list[list[int]], list[torch.Tensor], TritonOps]:
        llm = LLM(load_config(None, base))
        ex = llm.engine.executor
        assert ex.graphs is not None, ex.eager_reason
        rec = ex.sampler = LogitsRecorder(ex.sampler)
        tokens = [c.token_ids for n in (1, 3, 8) for c in llm.generate(prompts[:n], params)]
        logits = [s.logits for s in rec.take()]
        ops = ex.model.model.ops
        del llm, ex
        gc.collect()
        torch.cuda.empty_cache()
        return tokens, logits, ops

    off_tokens, off_logits, _ = run()
    for at in ("qkv", "layer"):
        monkeypatch.setenv("INFERX_L2_PREFETCH", "0.5")
        monkeypatch.setenv("INFERX_L2_PREFETCH_DOWN", "0.5")
        monkeypatch.setenv("INFERX_L2_PREFETCH_AT", at)
        tokens, logits, ops = run()
        assert isinstance(ops, TritonOps) and ops._side_streams, f"{at}: no prefetch issued"
        assert tokens == off_tokens, at
        assert len(logits) == len(off_logits), at
        for step, (a, b) in enumerate(zip(logits, off_logits, strict=True)):
            assert torch.equal(a, b), f"{at}: step {step} logits differ"
