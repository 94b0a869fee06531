"""A decode step's whole MLP (gate_up, SiLU-and-mul, down_proj) in one persistent launch.

At one to four rows the MLP is three launches: cuBLAS's gate_up, silu_and_mul_kernel, and
down_proj's GEMM. Each boundary costs a launch gap, the small kernel itself and the next GEMM's
ramp (its first DRAM round trips, while its thread blocks start). `fused_mlp` runs them as two
phases of one kernel whose programs all stay resident (a persistent grid, at most what fits
on the GPU at once):

1. each program takes a contiguous range of intermediate columns, reads their gate and up
   rows once and writes silu(gate) * up into a small [M, I] scratch;
2. a grid barrier (an arrival counter in global memory) waits for every program's range;
3. each program takes a contiguous range of down_proj rows and reads them once against the
   whole intermediate. The first K block of those rows is loaded before the barrier, so
   phase 2's first DRAM round trip overlaps the wait.

Ranges are split at row granularity (program p gets rows [p * R // P, (p + 1) * R // P)), so
the programs' shares differ by at most one row. Rounding matches the unfused path's:
gate and up rounded to the dtype as cuBLAS writes them, silu_and_mul_kernel's arithmetic, and
one rounding of down_proj's fp32 sum.

The barrier's counter only grows (int64): launch number g waits for (g + 1) * P arrivals. So
the kernel needs no reset between launches or CUDA graph replays, as long as every launch on
a counter has the same P (one counter per grid size, `_counter`). A program spins at most
MAX_SPIN times; a grid that could not all be resident would give wrong numbers, never a hang,
and `fused_mlp` sizes the grid from the compiled kernel's registers and shared memory so that
it is resident.

Under TRITON_INTERPRET=1 programs run one after another, so a barrier cannot work: there the
two phases run as two launches of the same kernel (PHASE 1, then PHASE 2), which tests the
arithmetic; the fused form (PHASE 3) runs on GPUs only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inferx_kernels_cuda.fused_kernels import _rounded, silu_times

MAX_ROWS = 4
_MAX_SPIN = 1 << 24


@dataclass(frozen=True)
class MlpConfig:
    """Tiles of the two phases (weight rows x K columns per loop step), warps, and programs per
    SM (capped by what the compiled kernel leaves room for)."""

    rows_up: int = 16  # gate rows (and as many up rows) a phase-1 tile holds
    rows_down: int = 8  # down_proj rows a phase-2 tile holds
    block_k: int = 256
    num_warps: int = 4
    programs_per_sm: int = 2

    def __str__(self) -> str:
        return (
            f"up{self.rows_up} down{self.rows_down} k{self.block_k} w{self.num_warps} "
            f"p{self.programs_per_sm}"
        )


@triton.jit
def _grid_barrier(counter_ptr, num_programs, MAX_SPIN: tl.constexpr):
    """Wait until all num_programs programs of this launch have arrived; see the module doc."""
    tl.debug_barrier()  # every thread's phase-1 stores are issued before the arrival
    ticket = tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    target = (ticket // num_programs + 1) * num_programs
    seen = ticket + 1
    spins = tl.full([], 0, tl.int32)
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()


@triton.jit(do_not_specialize=["m"])
def fused_mlp_kernel(
    x_ptr,
    w_up_ptr,
    w_down_ptr,
    act_ptr,
    out_ptr,
    counter_ptr,
    m,
    hidden,
    inter,
    stride_xm,
    stride_up,
    stride_down,
    stride_act,
    stride_om,
    BLOCK_M: tl.constexpr,
    ROWS_UP: tl.constexpr,
    ROWS_DOWN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PHASE: tl.constexpr,
    MAX_SPIN: tl.constexpr,
):
    """x [m, hidden] -> out [m, hidden] = down(silu(gate(x)) * up(x)). w_up is [2 * inter,
    hidden] (gate rows, then up rows), w_down [hidden, inter]; act is an [m, inter] scratch.
    PHASE 1: gate_up into act; 2: down_proj from act; 3: both, with the grid barrier."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = act_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    rows_x = offs_m % m  # rows past m repeat a real row; their results are not stored
    offs_k = tl.arange(0, BLOCK_K)

    if PHASE != 2:
        # Phase 1: intermediate columns [i0, i1), ROWS_UP at a time.
        i0 = pid * inter // num_programs
        i1 = (pid + 1) * inter // num_programs
        for r0 in range(i0, i1, ROWS_UP):
            rows = r0 + tl.arange(0, ROWS_UP)
            valid = rows < i1
            gate_rows = tl.where(valid, rows, i0).to(tl.int64)  # masked rows reread row i0
            g_ptrs = w_up_ptr + gate_rows[:, None] * stride_up + offs_k[None, :]
            u_ptrs = g_ptrs + inter * stride_up
            x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
            acc_g = tl.zeros([BLOCK_M, ROWS_UP, BLOCK_K], tl.float32)
            acc_u = tl.zeros([BLOCK_M, ROWS_UP, BLOCK_K], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                kmask = (k0 + offs_k) < hidden
                x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
                g = tl.load(g_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
                u = tl.load(u_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
                acc_g += x[:, None, :] * g[None, :, :]
                acc_u += x[:, None, :] * u[None, :, :]
                x_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            gate = _rounded(tl.sum(acc_g, axis=2), dtype)
            up = _rounded(tl.sum(acc_u, axis=2), dtype)
            a = silu_times(gate, up, dtype).to(dtype)
            a_ptrs = act_ptr + offs_m[:, None] * stride_act + rows[None, :]
            tl.store(a_ptrs, a, mask=(offs_m[:, None] < m) & valid[None, :])

    if PHASE != 1:
        # Phase 2: down_proj rows [n0, n1), ROWS_DOWN at a time, each over all of inter.
        n0 = pid * hidden // num_programs
        n1 = (pid + 1) * hidden // num_programs
        k_in = (offs_k < inter)[None, :]
        d_rows = tl.where(n0 + tl.arange(0, ROWS_DOWN) < n1, n0 + tl.arange(0, ROWS_DOWN), n0)
        first_ptrs = w_down_ptr + d_rows.to(tl.int64)[:, None] * stride_down + offs_k[None, :]
        # The first tile's first K block is loaded before the barrier (the weights do not
        # depend on phase 1); each tile loads the next tile's first block after its loop.
        w = tl.load(first_ptrs, mask=k_in, other=0.0)
        if PHASE == 3:
            _grid_barrier(counter_ptr, num_programs, MAX_SPIN)
        for r0 in range(n0, n1, ROWS_DOWN):
            rows = r0 + tl.arange(0, ROWS_DOWN)
            valid = rows < n1
            d_idx = tl.where(valid, rows, n0).to(tl.int64)  # masked rows reread row n0
            w_ptrs = w_down_ptr + d_idx[:, None] * stride_down + offs_k[None, :]
            a_ptrs = act_ptr + rows_x[:, None] * stride_act + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, ROWS_DOWN, BLOCK_K], tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                # The next block's weights are loaded before this block's products.
                nmask = (k0 + BLOCK_K + offs_k) < inter
                w_next = tl.load(w_ptrs + BLOCK_K, mask=nmask[None, :], other=0.0)
                kmask = (k0 + offs_k) < inter
                # .cg: act was written by other programs; read it from L2, not a stale L1.
                a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0, cache_modifier=".cg")
                acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
                w = w_next
                w_ptrs += BLOCK_K
                a_ptrs += BLOCK_K
            out = tl.sum(acc, axis=2)
            o_ptrs = out_ptr + offs_m[:, None] * stride_om + rows[None, :]
            tl.store(o_ptrs, out.to(dtype), mask=(offs_m[:, None] < m) & valid[None, :])
            nxt = r0 + ROWS_DOWN + tl.arange(0, ROWS_DOWN)
            n_idx = tl.where(nxt < n1, nxt, n0).to(tl.int64)
            # (a tensor mask: a scalar comparison is a plain bool under the interpreter)
            more = (offs_k < inter) & (offs_k * 0 + r0 + ROWS_DOWN < n1)
            n_ptrs = w_down_ptr + n_idx[:, None] * stride_down + offs_k[None, :]
            w = tl.load(n_ptrs, mask=more[None, :], other=0.0)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counter(device: torch.device, programs: int) -> torch.Tensor:
    """The barrier's arrival counter for grids of `programs` on `device` (see the module doc):
    one per grid size, allocated once and zeroed then (so before any graph captures it)."""
    key = (device, programs)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return _COUNTERS[key]


@functools.lru_cache
def _resident_programs(device: torch.device, regs: int, shared: int, num_warps: int) -> int:
    """How many programs of a kernel with these needs an SM holds at once."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    by_threads = min(32, props.max_threads_per_multi_processor // threads)
    by_regs = props.regs_per_multiprocessor // max(1, -(-regs // 8) * 8 * threads)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // (shared + 1024)  # each program also reserves 1 KB
    return max(0, min(by_threads, by_regs, by_smem)) * props.multi_processor_count


def fused_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    config: MlpConfig | None = None,
) -> torch.Tensor:
    """down(silu(x @ gate.T) * (x @ up.T)) for x [M <= MAX_ROWS, hidden], w_up [2 * inter,
    hidden] (gate rows then up rows), w_down [hidden, inter]; one launch on a GPU."""
    cfg = config or MlpConfig()
    m, hidden = x.shape
    inter = w_up.shape[0] // 2
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fused_mlp: x has {m} rows; it takes 1 to {MAX_ROWS}")
    if w_up.shape != (2 * inter, hidden) or w_down.shape != (hidden, inter):
        raise ValueError(
            f"fused_mlp: x {tuple(x.shape)}, w_up {tuple(w_up.shape)} and w_down "
            f"{tuple(w_down.shape)} do not make an MLP (w_up [2I, H], w_down [H, I])"
        )
    if not (x.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"fused_mlp: dtypes differ: {x.dtype}, {w_up.dtype}, {w_down.dtype}")
    if x.stride(1) != 1 or w_up.stride(1) != 1 or w_down.stride(1) != 1:
        raise ValueError("fused_mlp: x and the weights need a contiguous last dim")
    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    args = dict(BLOCK_M=triton.next_power_of_2(m), ROWS_UP=cfg.rows_up, ROWS_DOWN=cfg.rows_down,
                BLOCK_K=cfg.block_k, MAX_SPIN=_MAX_SPIN, num_warps=cfg.num_warps)  # fmt: skip

    def launch(programs: int, phase: int, counter: torch.Tensor) -> None:
        fused_mlp_kernel[(programs,)](
            x, w_up, w_down, act, out, counter, m, hidden, inter, x.stride(0),
            w_up.stride(0), w_down.stride(0), act.stride(0), out.stride(0), PHASE=phase, **args,
        )  # fmt: skip

    if interpret or x.device.type != "cuda":
        programs = min(hidden, 8)  # a few programs, several rows each: ranges and tails
        counter = torch.zeros(1, dtype=torch.int64, device=x.device)
        launch(programs, 1, counter)
        launch(programs, 2, counter)
        return out
    programs = _fused_programs(x, w_up, w_down, act, out, m, hidden, inter, cfg, args)
    launch(programs, 3, _counter(x.device, programs))
    return out


_PROGRAMS: dict[tuple, int] = {}


def _fused_programs(x, w_up, w_down, act, out, m, hidden, inter, cfg, args) -> int:
    """The fused launch's grid: programs_per_sm an SM, capped by what the compiled kernel
    leaves resident, and by the rows (every program owns at least one of each phase)."""
    key = (x.device, x.dtype, args["BLOCK_M"], hidden, inter, cfg)
    if key not in _PROGRAMS:
        kernel = fused_mlp_kernel.warmup(
            x, w_up, w_down, act, out, _counter(x.device, 1), m, hidden, inter, x.stride(0),
            w_up.stride(0), w_down.stride(0), act.stride(0), out.stride(0), PHASE=3,
            grid=(1,), **args,
        )  # fmt: skip
        kernel._init_handles()  # loads the binary: n_regs is known from here on
        resident = _resident_programs(x.device, kernel.n_regs, kernel.metadata.shared,
                                      cfg.num_warps)  # fmt: skip
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = min(cfg.programs_per_sm * sms, resident, hidden, inter)
        if programs < 1:
            raise RuntimeError(f"fused_mlp: {cfg} leaves no program resident on an SM")
        _PROGRAMS[key] = programs
    return _PROGRAMS[key]
