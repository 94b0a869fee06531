"""W4A16 MoE experts: GPTQ and AWQ experts' 4-bit weights in the layout the W4A16 linear layer
loads them into (inferx_quant.w4a16: packed along K, scales and zero points per group), stacked
over the experts as ExpertWeights "w4a16", which the fused MoE kernels dequantize in registers.

Reads per-expert checkpoints ("{prefix}.{e}.gate_proj.qweight", ".qzeros", ".scales", GPTQ's
".g_idx"), the layout of Qwen3-MoE GPTQ / AWQ checkpoints, and the same tensors stacked over the
experts (a leading [E]).
"""

from __future__ import annotations

import torch

from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, QuantExperts
from inferx_core.moe import check_experts_loaded, expert_mlp, expert_rows, run_experts
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_quant.w4a16 import (
    AWQ_ORDER,
    BITS,
    PACK,
    W4Format,
    dequantize,
    pack_rows,
    sort_by_group,
    unpack_cols,
    unpack_rows,
)

_PARTS = ("gate", "up", "down")
_KINDS = ("qweight", "qzeros", "scales", "g_idx", "bias")


class W4A16Experts(QuantExperts):
    """A MoE layer's experts as 4-bit integers (ExpertWeights "w4a16"): gate_up int32
    [E, H / 8, 2n] (gate and up columns in the activation's layout), down int32 [E, n / 8, H],
    scales float16 [E, groups, outputs], zero points uint8 of the same shape (None for a
    symmetric checkpoint: zero 8) and, for act-order checkpoints, each expert's row order
    gate_up_perm [E, H] / down_perm [E, n]; optional biases [E, 2n] / [E, H] in the serving
    dtype (the down bias on rank 0).

    n is this rank's share of the intermediate size I: each rank keeps the same columns of
    every expert's gate and up and rows of its down, in whole groups (a group's scale cannot be
    split); a tensor parallel size that cuts a group is refused. Act-order over several ranks:
    a rank's rows of down hold a scattered part of each group, so as the linear layer does
    (inferx_quant.w4a16) it keeps down's scales and zeros of every group its rows touch, sorts
    each expert's rows by group and gives the kernels down_row_group [E, n], each row's
    group; its share then need only be a multiple of 16 rows.

    load() kinds: "gate", "up", "down" or "gate_up" (columns in the activation's layout)
    followed by ".qweight", ".qzeros", ".scales", ".g_idx" (GPTQ) or ".bias"; per expert
    (expert=e) or stacked (expert=None, leading [E]). Each tensor is unpacked, sliced to this
    rank's share and repacked along K as it arrives; finish_loading sorts act-order experts'
    rows into group order (their g_idx: gate's and up's must agree, they share their input).

    forward (the reference, any device): each expert with tokens dequantized exactly to
    float32 and run on the float32 activations, summed in float32; the kernels' "w4a16" path
    computes the same products with the weights dequantized in registers."""

    def __init__(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
        fmt: W4Format | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.fmt = fmt or W4Format("gptq")
        self.parallel = parallel
        e, h, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
        g = self.fmt.group_size
        # act-order down split along K: its g_idx decides the layout at finish_loading, so
        # every group's scales and zeros are kept until then
        self.k_split_act_order = self.fmt.desc_act and parallel.world_size > 1 and g != -1
        for k, what in ((h, "hidden size"), (inter, "intermediate size")):
            if g != -1 and k % g or k % 16:
                raise ValueError(
                    f"{spec.prefix}: the experts' {what} {k} is not a multiple of group_size "
                    f"{g} and of 16"
                )
        self.start, n = parallel.shard(inter, f"{spec.prefix}'s intermediate size")
        step = max(g, 16)  # whole groups, whole words, and a K tile of 16 for the kernels
        unit = f"a group of {step} (group_size {g})"
        if self.k_split_act_order:  # any rows, in whole 4-bit words and kernel K tiles
            step, unit = 16, "a multiple of 16 rows"
        if self.start % step or n % step:
            raise ValueError(
                f"parallel.tensor = {parallel.world_size} splits {spec.prefix}'s intermediate "
                f"size {inter} at {self.start}, not on {unit}"
            )
        self.n = n
        # the K columns a scale covers: gate_up's K is H, down's this rank's n
        self.group = {"gate_up": h if g == -1 else g, "down": n if g == -1 else g}
        gu, gd = h // self.group["gate_up"], n // self.group["down"]
        if self.k_split_act_order:
            gd = inter // g

        def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
            t = torch.zeros(*shape, dtype=dtype, device=device)
            return torch.nn.Parameter(t, requires_grad=False)

        self.gate_up = param(e, h // PACK, 2 * n, dtype=torch.int32)
        self.down = param(e, n // PACK, h, dtype=torch.int32)
        self.gate_up_scales = param(e, gu, 2 * n, dtype=torch.float16)
        self.down_scales = param(e, gd, h, dtype=torch.float16)
        self.gate_up_zeros: torch.nn.Parameter | None = None
        self.down_zeros: torch.nn.Parameter | None = None
        if not self.fmt.sym:
            self.gate_up_zeros = param(e, gu, 2 * n, dtype=torch.uint8)
            self.down_zeros = param(e, gd, h, dtype=torch.uint8)
        self.gate_up_bias = param(e, 2 * n, dtype=dtype) if spec.bias else None
        self.down_bias = param(e, h, dtype=dtype) if spec.bias and parallel.rank == 0 else None
        self.gate_up_perm: torch.nn.Parameter | None = None
        self.down_perm: torch.nn.Parameter | None = None
        self.down_row_group: torch.nn.Parameter | None = None
        # g_idx as loaded (input order), per part, until finish_loading turns it into perms
        self._g_idx: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, set[int]] = {}

    # --- loading --------------------------------------------------------------------------------

    def _dims(self, part: str) -> tuple[int, int]:
        """(outputs N, inputs K) of a whole checkpoint projection."""
        h, inter = self.spec.hidden_size, self.spec.intermediate_size
        return {"gate_up": (2 * inter, h), "down": (h, inter)}.get(part, (inter, h))

    def _expected(self, part: str, what: str) -> tuple[tuple[int, ...], str]:
        """(one expert's shape, dtype class) of a checkpoint tensor."""
        n, k = self._dims(part)
        groups = 1 if self.fmt.group_size == -1 else k // self.fmt.group_size
        if what == "qweight":
            return ((k // PACK, n) if self.fmt.method == "gptq" else (k, n // PACK)), "int32"
        if what == "qzeros":
            return (groups, n // PACK), "int32"
        if what == "scales":
            return (groups, n), "float"
        if what == "g_idx":
            return (k,), "int"
        return (n,), "float"  # bias

    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        spec = self.spec
        part, _, what = kind.partition(".")
        whats = _KINDS if self.fmt.method == "gptq" else tuple(k for k in _KINDS if k != "g_idx")
        if part not in (*_PARTS, "gate_up") or what not in whats:
            raise ValueError(f"{spec.prefix}: {self.fmt.method} experts have no {kind!r} tensor")
        if what == "bias" and not spec.bias:
            raise ValueError(f"{spec.prefix}: the experts have no biases ({kind!r})")
        shape, cls = self._expected(part, what)
        experts, tensor = expert_rows(spec, kind, tensor, expert, shape)
        ok = {
            "int32": tensor.dtype == torch.int32,
            "int": tensor.dtype in (torch.int32, torch.int64),
            "float": tensor.dtype.is_floating_point,
        }[cls]
        if not ok:
            raise ValueError(f"{spec.prefix}: {kind} is {tensor.dtype}, expected {cls}")
        tensor = tensor.to(self.gate_up.device)
        # to one form: qweight and qzeros unpacked to uint8 [E', rows, N] (qweight's rows are
        # K, qzeros' the groups), the zeros themselves
        if what == "qweight":
            if self.fmt.method == "gptq":
                tensor = unpack_rows(tensor)
            else:
                tensor = unpack_cols(tensor, AWQ_ORDER)
        elif what == "qzeros":
            tensor = unpack_cols(tensor, AWQ_ORDER if self.fmt.method == "awq" else None)
            tensor = tensor.to(torch.int32) + self.fmt.zero_offset
            if self.fmt.sym and not bool((tensor == 1 << (BITS - 1)).all()):
                stored = "7 (zero - 1)" if self.fmt.zero_offset else "8"
                raise ValueError(
                    f"{spec.prefix}: {kind} of expert {'all' if expert is None else expert}: "
                    f"the checkpoint is symmetric (sym) but its qzeros are not the zero point "
                    f"8 (stored as {stored} in this checkpoint_format)"
                )
        elif what == "scales" and not torch.equal(tensor.half().to(tensor.dtype), tensor):
            raise ValueError(
                f"{spec.prefix}: {kind} holds values float16 does not represent exactly "
                "(W4A16 experts keep their scales in float16, as GPTQ and AWQ store them)"
            )
        index = slice(experts.start, experts.stop)
        if part == "gate_up":
            pieces = self._gate_and_up(tensor, self.spec.intermediate_size, what)
            parts: tuple[str, ...] = ("gate", "up")
        else:
            pieces, parts = (tensor,), (part,)
        for p, piece in zip(parts, pieces, strict=True):
            self._copy(p, what, piece, index)
            self._loaded.setdefault(f"{p}.{what}", set()).update(experts)

    def _gate_and_up(self, t: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, ...]:
        """A gate_up tensor's gate and up outputs (its last dimension; g_idx, over K, is both's)
        in the activation's layout: "silu" gate then up, "swiglu_oai" interleaved."""
        if what == "g_idx":
            return t, t
        if self.spec.activation == "silu":
            return t[..., :n], t[..., n:]
        return t[..., 0::2], t[..., 1::2]

    def _copy(self, part: str, what: str, t: torch.Tensor, index: slice) -> None:
        """This rank's share of a whole gate / up / down tensor [E', ...] (unpacked) to experts
        `index`: gate and up keep output columns [start, start + n), down its input rows
        (K, or their groups)."""
        s, n = self.start, self.n
        if what == "bias":
            if part != "down":
                assert self.gate_up_bias is not None
                self._cols(self.gate_up_bias.data[index], part).copy_(t[..., s : s + n])
            elif self.down_bias is not None:  # rank 0's
                self.down_bias.data[index].copy_(t)
            return
        if what == "g_idx":
            if part == "down":  # this rank's rows, their groups counted from its first (from
                # 0 for an act-order split, whose first group is known at finish_loading)
                split = self.fmt.group_size == -1 or self.k_split_act_order
                t = t[:, s : s + n] - (0 if split else s // self.group["down"])
            whole = self.spec.num_experts, t.shape[1]
            staged = self._g_idx.setdefault(
                part, torch.zeros(whole, dtype=torch.int64, device=t.device)
            )
            staged[index] = t
            return
        if part == "down":
            g = self.group["down"]
            rows = slice(s, s + n) if what == "qweight" else slice(s // g, (s + n) // g)
            if what != "qweight" and (self.fmt.group_size == -1 or self.k_split_act_order):
                rows = slice(None)  # one group over all of K on every rank; or all, for now
            t = t[:, rows]
        else:
            t = t[..., s : s + n]
        name = "gate_up" if part != "down" else "down"
        if what == "qweight":
            dest, t = getattr(self, name), pack_rows(t)
        elif what == "scales":
            dest = getattr(self, f"{name}_scales")
        else:  # qzeros: kept where the checkpoint is asymmetric
            dest = getattr(self, f"{name}_zeros")
            if dest is None:
                return
        view = dest.data[index] if part == "down" else self._cols(dest.data[index], part)
        view.copy_(t)

    def _cols(self, t: torch.Tensor, part: str) -> torch.Tensor:
        """The gate or up columns (last dimension) of a gate_up tensor, as a view."""
        gate, up = self._gate_and_up(t, self.n, "")
        return gate if part == "gate" else up

    def finish_loading(self) -> None:
        names = {w: w for w in ("qweight", "qzeros", "scales")}
        if self.fmt.desc_act:
            names["g_idx"] = "g_idx"
        if self.spec.bias:
            names["bias"] = "bias"
        check_experts_loaded(self.spec, self._loaded, names)
        if "gate" in self._g_idx or "up" in self._g_idx:
            gate, up = self._g_idx.get("gate"), self._g_idx.get("up")
            if gate is None or up is None or not torch.equal(gate, up):
                differ = 0 if gate is None or up is None else int((gate != up).any(1).nonzero()[0])
                raise ValueError(
                    f"{self.spec.prefix}.{differ}.gate_proj.g_idx differs from its up_proj's: "
                    "an expert's gate and up share their input, so must share one act-order"
                )
            self.gate_up_perm = self._sorted("gate_up", gate)
        if self.k_split_act_order:
            self.down_perm = self._split_sorted(self._g_idx["down"])
        elif "down" in self._g_idx:
            self.down_perm = self._sorted("down", self._g_idx["down"])
        self._g_idx.clear()

    def _sorted(self, name: str, g_idx: torch.Tensor) -> torch.nn.Parameter | None:
        """Rows of each expert sorted into group order by its g_idx [E, K] (the packed weight
        rewritten in place) -> the perms [E, K] int32, or None where every g_idx is k // g."""
        e, k = g_idx.shape
        group = self.group[name]
        trivial = torch.arange(k, device=g_idx.device) // group
        if torch.equal(g_idx, trivial.expand(e, k)):
            return None
        perm = torch.argsort(g_idx, dim=1, stable=True)
        bad = (g_idx.gather(1, perm) != trivial).any(1)
        if bool(bad.any()):
            part = "gate" if name == "gate_up" else "down"
            raise ValueError(
                f"{self.spec.prefix}.{int(bad.nonzero()[0])}.{part}_proj.g_idx does not give "
                f"each of its {k // group} groups {group} rows"
            )
        return self._permuted(name, perm, (g_idx != trivial).any(1))

    def _permuted(self, name: str, perm: torch.Tensor, moved: torch.Tensor) -> torch.nn.Parameter:
        """The experts `moved` (bool [E]) of weight `name` rewritten in place in the row order
        `perm` [E, K] -> perm as an int32 parameter."""
        weight = getattr(self, name).data
        for i in moved.nonzero().flatten().tolist():
            weight[i] = pack_rows(unpack_rows(weight[i])[perm[i]])
        return torch.nn.Parameter(perm.to(torch.int32).contiguous(), requires_grad=False)

    def _split_sorted(self, g_idx: torch.Tensor) -> torch.nn.Parameter | None:
        """Act-order down over several ranks, g_idx [E, n] this rank's rows' groups (counted
        from 0 over all of I): where every expert's is plain k // g in whole groups, the
        one-rank layout (those groups' scales kept, no perm). Else each expert's rows sorted by
        group, down_row_group [E, n] their groups counted from the first any expert's rows
        touch, and the scales and zeros of the groups from there to the last -> the perms."""
        e, n = g_idx.shape
        g, s = self.group["down"], self.start
        whole = self.spec.intermediate_size // g
        plain = (torch.arange(s, s + n, device=g_idx.device) // g).expand(e, n)
        if s % g == 0 and n % g == 0 and torch.equal(g_idx, plain):
            self._keep_down_groups(s // g, (s + n) // g)
            return None
        perm, row_group, bad = sort_by_group(g_idx, g, whole)
        if bool(bad.any()):
            raise ValueError(
                f"{self.spec.prefix}.{int(bad.nonzero()[0])}.down_proj.g_idx does not give "
                f"each of its {whole} groups {g} rows (rows {s}..{s + n} of it)"
            )
        lo, hi = int(row_group[:, 0].min()), int(row_group[:, -1].max())
        self._keep_down_groups(lo, hi + 1)
        self.down_row_group = torch.nn.Parameter(
            (row_group - lo).to(torch.int32).contiguous(), requires_grad=False
        )
        moved = (perm != torch.arange(n, device=perm.device)).any(1)
        return self._permuted("down", perm, moved) if bool(moved.any()) else None

    def _keep_down_groups(self, first: int, end: int) -> None:
        """down's scales and zeros (all I / g groups, as loaded) cut to groups [first, end)."""
        for name in ("down_scales", "down_zeros"):
            t = getattr(self, name)
            if t is not None:
                kept = t.data[:, first:end].contiguous()
                setattr(self, name, torch.nn.Parameter(kept, requires_grad=False))

    # --- running --------------------------------------------------------------------------------

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(
            "w4a16",
            self.gate_up,
            self.down,
            self.gate_up_scales,
            self.down_scales,
            self.gate_up_bias,
            self.down_bias,
            gate_up_zeros=self.gate_up_zeros,
            down_zeros=self.down_zeros,
            gate_up_perm=self.gate_up_perm,
            down_perm=self.down_perm,
            group_size=self.fmt.group_size,
            down_row_group=self.down_row_group,
        )

    def weight(self, name: str, e: int) -> torch.Tensor:
        """Expert e's "gate_up" or "down" weight, [out, in] float32, exactly dequantized."""
        zeros, perm = getattr(self, f"{name}_zeros"), getattr(self, f"{name}_perm")
        row_group = self.down_row_group if name == "down" else None
        return dequantize(
            getattr(self, name)[e],
            getattr(self, f"{name}_scales")[e],
            None if zeros is None else zeros[e],
            self.group[name],
            None if perm is None else perm[e],
            None if row_group is None else row_group[e],
        )

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b13 = None if self.gate_up_bias is None else self.gate_up_bias[e].float()
        b2 = None if self.down_bias is None else self.down_bias[e].float()
        w13, w2 = self.weight("gate_up", e), self.weight("down", e)
        return expert_mlp(x.float(), w13, b13, w2, b2, self.spec)  # summed in float32

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, topk_weights, topk_ids, self.spec.num_experts, self._expert)
