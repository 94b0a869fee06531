"""Weight prefetch into L2: while one linear layer runs, the next one's weights start arriving.

At the batch sizes where a decode step is bound by reading weights, the small GEMMs do not
reach memory bandwidth: a 3B model's o_proj (8 MB) takes ~5.6 µs on an H200 where its bytes
alone need 2, the rest is the latency of a cold start. So when each linear layer's forward
begins, a side stream asks the kernel ops (KernelOps.prefetch_l2) to pull the next layer's
weight into L2, when that weight is at most `max_bytes`; that GEMM then starts on warm cache
lines. Large weights are never prefetched: their GEMMs already stream at near bandwidth, and
pulling them early only competes with the GEMM running (measured: every GEMM got slower).

Only while `active()` (the executor wraps the CUDA graph captures in it): inside a graph the
side stream is a branch that costs the main chain nothing, while eagerly it would cost launch
time. "Next" is the order the linear layers are registered in, which is the order they run in
for models that build their layers as they run them (all of ours); a wrong order costs time,
never results, since a prefetch is only a hint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from inferx_core.interfaces.ops import KernelOps
from inferx_core.interfaces.quant import QuantLinear


class WeightPrefetch:
    def __init__(
        self,
        model: torch.nn.Module,
        ops: KernelOps,
        max_bytes: int,
    ) -> None:
        self.ops = ops
        self.max_bytes = max_bytes
        linears = [
            m
            for m in model.modules()
            if isinstance(m, QuantLinear) and isinstance(getattr(m, "weight", None), torch.Tensor)
        ]
        self.next: dict[torch.nn.Module, torch.Tensor] = {
            m: n.weight
            for m, n in zip(linears, linears[1:], strict=False)
            if n.weight.numel() * n.weight.element_size() <= max_bytes
        }
        self.issued = 0  # prefetches launched (for tests and logs)
        self._enabled = False
        self._side: torch.cuda.Stream | None = None
        self._forked = False
        for m in linears:
            m.register_forward_pre_hook(self._before)
        model.register_forward_hook(lambda *_: self.join())

    @contextlib.contextmanager
    def active(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(device)  # made here: not while a graph captures
        self._enabled = True
        try:
            yield
        finally:
            self.join()
            self._enabled = False

    def join(self) -> None:
        """The main stream waits for the side stream's prefetches (a graph capture must end
        with every stream it forked joined)."""
        if self._forked and self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)
            self._forked = False

    def _before(self, module: torch.nn.Module, args: object) -> None:
        if not self._enabled:
            return
        weight = self.next.get(module)
        if weight is None or self._side is None:
            return
        self.join()
        main = torch.cuda.current_stream()
        self._side.wait_stream(main)  # fork: after what the main stream has queued so far
        with torch.cuda.stream(self._side):
            if self.ops.prefetch_l2(weight, self.max_bytes):
                self.issued += 1
        self._forked = True
