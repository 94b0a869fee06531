"""A decode step's whole MLP (gate_up, SiLU-and-mul, down_proj) in one persistent launch.

At a few rows the MLP is three launches: cuBLAS's gate_up, silu_and_mul_kernel, and
down_proj's GEMM. Each boundary costs a launch gap, the small kernel itself and the next GEMM's
ramp (its first DRAM round trips, while its thread blocks start). `fused_mlp` runs them as two
phases of one kernel whose programs all stay resident (a persistent grid, at most what fits
on the GPU at once):

1. each program takes a contiguous range of intermediate columns, reads their gate and up
   rows once and writes silu(gate) * up into a small [M, I] scratch;
2. a grid barrier (an arrival counter in global memory) waits for every program's range;
3. each program takes a contiguous range of down_proj rows and reads them once against the
   whole intermediate.

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

MAX_ROWS = 16  # x is padded to 16 columns of the tensor-core tiles anyway
_MAX_SPIN = 1 << 24


@dataclass(frozen=True)
class MlpConfig:
    """Tiles of the two phases (weight rows x K columns per loop step), warps, Triton's
    pipeline depth, and programs per SM (capped by what the compiled kernel leaves room for)."""

    rows_up: int = 64  # gate rows (and as many up rows) a phase-1 tile holds
    rows_down: int = 16  # down_proj rows a phase-2 tile holds
    block_k: int = 128  # phase 1's K step (over hidden)
    block_k_down: int = 256  # phase 2's K step (over the intermediate)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2

    def __str__(self) -> str:
        return (
            f"up{self.rows_up} down{self.rows_down} k{self.block_k}/{self.block_k_down} "
            f"w{self.num_warps} st{self.num_stages} p{self.programs_per_sm}"
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


@triton.jit
def _dot(w, xt, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + w [R, K] @ xt [K, M] in fp32 (upcast first under the interpreter, whose bf16 dot
    would round its inputs' products to bf16)."""
    if UPCAST:
        w = w.to(tl.float32)
        xt = xt.to(tl.float32)
    return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)


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
    BLOCK_K_DOWN: tl.constexpr,
    PHASE: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """x [m, hidden] -> out [m, hidden] = down(silu(gate(x)) * up(x)). w_up is [2 * inter,
    hidden] (gate rows, then up rows), w_down [hidden, inter]; act is an [m, inter] scratch.
    PHASE 1: gate_up into act; 2: down_proj from act; 3: both, with the grid barrier.

    Both phases multiply weight tiles by the transposed activations on tensor cores (x padded
    to BLOCK_M >= 16 columns, masked loads, so the padding reads nothing), so that Triton
    pipelines the weight loads num_stages deep: the FMA form of this kernel, one round trip
    per K step, ran at half the bandwidth (BENCHMARKS.md, session 12)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = act_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m

    if PHASE != 2:
        # Phase 1: intermediate columns [i0, i1), ROWS_UP at a time.
        i0 = pid * inter // num_programs
        i1 = (pid + 1) * inter // num_programs
        offs_k = tl.arange(0, BLOCK_K)
        for r0 in range(i0, i1, ROWS_UP):
            rows = r0 + tl.arange(0, ROWS_UP)
            valid = rows < i1
            g_ptrs = w_up_ptr + rows.to(tl.int64)[:, None] * stride_up + offs_k[None, :]
            u_ptrs = g_ptrs + inter * stride_up
            xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, M]
            acc_g = tl.zeros([ROWS_UP, BLOCK_M], tl.float32)
            acc_u = tl.zeros([ROWS_UP, BLOCK_M], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_ok = (k0 + offs_k) < hidden
                w_mask = valid[:, None] & k_ok[None, :]
                xt = tl.load(xt_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=w_mask, other=0.0)
                u = tl.load(u_ptrs, mask=w_mask, other=0.0)
                acc_g = _dot(g, xt, acc_g, UPCAST, DOT_PRECISION)
                acc_u = _dot(u, xt, acc_u, UPCAST, DOT_PRECISION)
                xt_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            a = silu_times(_rounded(acc_g, dtype), _rounded(acc_u, dtype), dtype).to(dtype)
            a_ptrs = act_ptr + offs_m[None, :] * stride_act + rows[:, None]  # [ROWS_UP, M]
            tl.store(a_ptrs, a, mask=valid[:, None] & m_ok[None, :])

    if PHASE == 3:
        _grid_barrier(counter_ptr, num_programs, MAX_SPIN)

    if PHASE != 1:
        # Phase 2: down_proj rows [n0, n1), ROWS_DOWN at a time, each over all of inter.
        n0 = pid * hidden // num_programs
        n1 = (pid + 1) * hidden // num_programs
        offs_k = tl.arange(0, BLOCK_K_DOWN)
        for r0 in range(n0, n1, ROWS_DOWN):
            rows = r0 + tl.arange(0, ROWS_DOWN)
            valid = rows < n1
            w_ptrs = w_down_ptr + rows.to(tl.int64)[:, None] * stride_down + offs_k[None, :]
            at_ptrs = act_ptr + offs_m[None, :] * stride_act + offs_k[:, None]  # [K, M]
            acc = tl.zeros([ROWS_DOWN, BLOCK_M], tl.float32)
            for k0 in range(0, inter, BLOCK_K_DOWN):
                k_ok = (k0 + offs_k) < inter
                w = tl.load(w_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                # .cg: act was written by other programs; read it from L2, not a stale L1.
                at = tl.load(
                    at_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0, cache_modifier=".cg"
                )
                acc = _dot(w, at, acc, UPCAST, DOT_PRECISION)
                w_ptrs += BLOCK_K_DOWN
                at_ptrs += BLOCK_K_DOWN
            o_ptrs = out_ptr + offs_m[None, :] * stride_om + rows[:, None]  # [ROWS_DOWN, M]
            tl.store(o_ptrs, acc.to(dtype), mask=valid[:, None] & m_ok[None, :])


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
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    args = dict(
        BLOCK_M=max(16, triton.next_power_of_2(m)), ROWS_UP=cfg.rows_up,
        ROWS_DOWN=cfg.rows_down, BLOCK_K=cfg.block_k, BLOCK_K_DOWN=cfg.block_k_down,
        MAX_SPIN=_MAX_SPIN, UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip

    def launch(programs: int, phase: int, counter: torch.Tensor) -> None:
        fused_mlp_kernel[(programs,)](
            x, w_up, w_down, act, out, counter, m, hidden, inter, x.stride(0),
            w_up.stride(0), w_down.stride(0), act.stride(0), out.stride(0), PHASE=phase, **args,
        )  # fmt: skip

    if interpret or x.device.type != "cuda":
        programs = 3  # a few programs, several tiles each: ranges, partial tiles and tails
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
