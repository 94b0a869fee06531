"""compiles_in_background: Triton launches inside it compile on worker threads and launch
nothing; each distinct variant is submitted once; errors surface on exit; outside, launches
are launches again. Triton's JITFunction.run is replaced by a recorder (no GPU here)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from inferx_kernels_cuda.jit_compile import Compile, compiles_in_background, summarize

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402


def kernel(x_ptr, n, BLOCK):  # noqa: N803  (a Triton kernel's signature; never compiled here)
    pass


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    recorded: list[dict[str, Any]] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> str:
        if kwargs.get("BLOCK") == 13:
            raise ValueError("no such tile")
        recorded.append(
            {"thread": threading.current_thread().name, "warmup": warmup, "args": args, **kwargs}
        )
        return "launched"

    monkeypatch.setattr(JITFunction, "run", run)
    return recorded


def test_launches_inside_only_compile_each_variant_once(calls: list[dict[str, Any]]) -> None:
    k = JITFunction(kernel)
    x, y = torch.zeros(8), torch.zeros(16)
    with compiles_in_background(4):
        assert k[(1,)](x, 3, BLOCK=4) is None  # nothing launched, nothing returned
        k[(2,)](y, 3, BLOCK=4)  # same dtype and alignment, same int class: the same variant
        k[(1,)](x, 16, BLOCK=4)  # an int that is a multiple of 16: another variant
        k[(1,)](x, 3, BLOCK=8)  # another constexpr
        k[(1,)](x.half(), 3, BLOCK=4)  # another dtype
    assert len(calls) == 4
    assert all(c["warmup"] and c["thread"].startswith("triton-compile") for c in calls)
    assert sorted((c["args"][1], c["BLOCK"], str(c["args"][0].dtype)) for c in calls) == [
        (3, 4, "torch.float16"),
        (3, 4, "torch.float32"),
        (3, 8, "torch.float32"),
        (16, 4, "torch.float32"),
    ]
    assert k[(1,)](x, 3, BLOCK=4) == "launched"  # outside: a launch again
    assert calls[-1]["warmup"] is False and calls[-1]["thread"] == threading.current_thread().name


class Descriptor:
    """A host tensor descriptor's fields (triton.tools.tensor_descriptor.TensorDescriptor);
    its repr would print the tensor, so the key must not take it."""

    def __init__(self, base: torch.Tensor, block_shape: list[int]) -> None:
        self.base, self.block_shape = base, block_shape
        self.shape, self.strides = list(base.shape), list(base.stride())

    def __repr__(self) -> str:
        raise AssertionError("the variant key took the descriptor's repr")


def test_workers_ready_each_compiled_variant_for_its_first_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each variant's handles (its binary loaded, its C launcher built) are readied on the worker
    that compiled it, once, inside the dry run; a result without the hook is left as it is."""
    readied: list[str] = []

    class Compiled:
        def _init_handles(self) -> None:
            readied.append(threading.current_thread().name)

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> object:
        assert warmup
        return Compiled() if kwargs["BLOCK"] < 8 else "no hook"

    monkeypatch.setattr(JITFunction, "run", run)
    k = JITFunction(kernel)
    with compiles_in_background(3):
        for block in (2, 4, 2, 8):
            k[(1,)](torch.zeros(4), 3, BLOCK=block)
    assert len(readied) == 2
    assert all(name.startswith("triton-compile") for name in readied)


def test_each_compile_is_recorded_and_summarized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The list the block yields holds one record a variant, once the block is left: the
    kernel's name, when its compile began and how long it took; summarize ranks them."""

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> str:
        time.sleep(0.05 * kwargs["BLOCK"])
        return "compiled"

    monkeypatch.setattr(JITFunction, "run", run)
    k = JITFunction(kernel)
    with compiles_in_background(2) as compiles:
        for block in (1, 4, 1):
            k[(1,)](torch.zeros(4), 3, BLOCK=block)
    short, long = sorted(compiles, key=lambda c: c.seconds)
    assert short.seconds >= 0.05 and long.seconds >= 0.2
    assert [c.kernel for c in compiles] == ["kernel", "kernel"]
    assert all(c.began_s >= 0 for c in compiles)
    summary = summarize(compiles, wall_s=0.3, longest=1)
    assert summary["variants"] == 2 and summary["wall_s"] == 0.3
    assert summary["summed_s"] >= 0.25 and summary["longest"][0][1] >= 0.2
    fixed = [Compile("a", 0.0, 1.0), Compile("b", 0.5, 3.0), Compile("c", 1.0, 2.0)]
    assert summarize(fixed, 3.5, longest=2) == {
        "variants": 3,
        "wall_s": 3.5,
        "summed_s": 6.0,
        "longest": [["b", 3.0], ["c", 2.0]],
    }


def test_descriptors_and_unspecialised_ints_share_a_variant(calls: list[dict[str, Any]]) -> None:
    """Every layer's weight of one shape is one variant (not one per tensor); an int the
    kernel does not specialise on (do_not_specialize) is one variant at any value."""
    k = JITFunction(kernel, do_not_specialize=["n"])
    layers = [torch.zeros(64, 32) for _ in range(3)]
    with compiles_in_background(2):
        for w in layers:
            for n in (1, 3, 16):
                k[(1,)](Descriptor(w, [16, 32]), n, BLOCK=4)
        k[(1,)](Descriptor(layers[0], [32, 32]), 3, BLOCK=4)  # another block: another variant
        k[(1,)](Descriptor(torch.zeros(48, 32), [16, 32]), 3, BLOCK=4)  # another shape
    assert len(calls) == 3


def test_a_failed_compile_raises_on_exit(calls: list[dict[str, Any]]) -> None:
    k = JITFunction(kernel)
    with pytest.raises(ValueError, match="no such tile"), compiles_in_background(2):
        k[(1,)](torch.zeros(4), 3, BLOCK=13)
        k[(1,)](torch.zeros(4), 3, BLOCK=4)
    assert k[(1,)](torch.zeros(4), 3, BLOCK=4) == "launched"  # restored after the error


def test_one_thread_or_none_changes_nothing(calls: list[dict[str, Any]]) -> None:
    k = JITFunction(kernel)
    for threads in (0, 1):
        with compiles_in_background(threads):
            assert k[(1,)](torch.zeros(4), 3, BLOCK=4) == "launched"
    assert [c["warmup"] for c in calls] == [False, False]


def test_compile_threads_is_validated() -> None:
    from inferx_core.config import ConfigError, load_config

    assert load_config(None, {"engine.compile_threads": 0}).engine.compile_threads == 0
    with pytest.raises(ConfigError, match="engine.compile_threads"):
        load_config(None, {"engine.compile_threads": -1})
