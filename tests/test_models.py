"""Llama and Qwen2 against transformers: loaded by SafetensorsFormat, run on a paged cache."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from inferx_core.attention_torch import TorchAttention
from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.model import BuildContext, ModelArch
from inferx_core.plugins import plugins
from inferx_core.quant_none import Unquantized
from inferx_models.formats import DummyFormat, SafetensorsFormat
from inferx_models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from inferx_models.presets import PRESETS, write_checkpoint

transformers = pytest.importorskip("transformers")

# fp32 on both sides; the differences are summation order in matmuls and softmax, ~1e-6.
RTOL = 1e-4
CPU = torch.device("cpu")
VOCAB = 300

TINY_BASE = {
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS = {
    # head_dim 24 (not hidden / heads) and llama3 scaling with all three frequency bands in use.
    "llama3-scaled": TINY_BASE
    | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": 24,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama-plain": TINY_BASE
    | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
    },
    "qwen2-tied": TINY_BASE
    | {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "head_dim": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def hf_model(cfg: dict[str, Any], path: Path | None = None) -> torch.nn.Module:
    """A transformers model for cfg with every parameter perturbed (so norms and biases are not
    their trivial 1 and 0), saved to `path` when given."""
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.empty_like(p).uniform_(-0.05, 0.05))
    model.eval()
    if path is not None:
        model.save_pretrained(path)
    return model


def spread_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Weights larger than the default init, so that logits are far apart and greedy is stable;
    norm weights (the 1-d ones) away from 1, so that they matter."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.08)
    return model


def saved(
    model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory, name: str
) -> tuple[Path, torch.nn.Module]:
    """(a fresh folder named after `name` holding the model's checkpoint, the model)."""
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return path, model


# Steps of (sequence, start, end) for check_steps: prompt chunks packed with fresh prompts, a
# chunk over a cached prefix beside a decode, then the rest of one prompt.
PACKED_CHUNKS = [
    [("a", 0, 11), ("b", 0, 21)],
    [("a", 11, 30), ("c", 0, 6)],
    [("a", 30, 31), ("c", 6, 13)],
    [("a", 31, 37)],
]


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


class Runner:
    """Our model over a paged cache: hands out scattered blocks and runs one step at a time."""

    def __init__(self, path: Path, block_size: int, num_blocks: int = 64) -> None:
        ckpt = SafetensorsFormat().open(path, torch.float32)
        arch: type[ModelArch] = plugins().get("model_arch", ckpt.hf_config["architectures"][0])
        self.backend = TorchAttention(
            arch.kv_layout(ckpt.hf_config), block_size, torch.float32, CPU
        )
        self.backend.allocate(num_blocks)
        ctx = BuildContext(torch.float32, CPU, self.backend, Unquantized())
        self.model = arch(ckpt.hf_config, ctx)
        self.model.load_weights(ckpt.weights)
        self.block_size = block_size
        self.free = random.Random(block_size).sample(range(num_blocks), num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run each (sequence, new tokens) chunk in one packed step; logits of every new token."""
        ids, positions, query_lens, context_lens, tables = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.done.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            context_lens.append(end)
            tables.append(table)
            self.done[seq] = end
        batch = make_attention_batch(query_lens, context_lens, tables, self.block_size)
        self.backend.begin_step(batch)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


# Scenarios the architecture tests (Qwen3, gpt-oss, DeepSeek-V2) share.
# Engine overrides: prompts in 7-token chunks beside other sequences' decodes.
CHUNKED_PREFILL = {
    "scheduler.prefill_chunk": 7,
    "scheduler.max_batched_tokens": 16,
    "scheduler.max_running": 4,
    "kv_cache.block_size": 4,
}
# 40 blocks of 4 tokens cannot hold test_engine's five prompts at once: some are preempted.
PREEMPTING = {"kv_cache.block_size": 4, "kv_cache.num_blocks": 40, "scheduler.prefix_cache": False}


def check_steps(
    runner: Runner,
    ref: torch.nn.Module,
    full: dict[str, list[int]],
    schedule: list[list[tuple[str, int, int]]],
    rtol: float,
) -> None:
    """Each step's (sequence, start, end) slices through runner, every output's logits within
    rtol of transformers' over the whole sequence."""
    want = {seq: hf_logits(ref, tokens) for seq, tokens in full.items()}
    for step in schedule:
        outs = runner.step([(seq, full[seq][a:b]) for seq, a, b in step])
        for (seq, a, b), out in zip(step, outs, strict=True):
            assert rel_err(out, want[seq][a:b]) <= rtol, (seq, a, b)


def check_prefix_hit(llm: Any, ref: torch.nn.Module, generate: Any, reference: Any) -> None:
    """Two prompts sharing a 40-token prefix, one after the other: the second reads the first's
    cached blocks, and both give transformers' greedy tokens."""
    first = list(range(3, 43)) + [50, 51, 52]
    second = list(range(3, 43)) + [90, 91]
    assert generate(llm, [first]) == reference(ref, [first])
    assert llm.engine.scheduler.stats().prefix_hits == 0
    assert generate(llm, [second]) == reference(ref, [second])
    assert llm.engine.scheduler.stats().prefix_hits > 0


def check_preemption(llm: Any, generate: Any, expected: list[list[int]]) -> None:
    """An engine with PREEMPTING's cache gives transformers' greedy tokens (`expected`) although
    it preempted sequences, and holds no block at the end."""
    assert generate(llm) == expected
    assert llm.engine.scheduler.stats().preemptions > 0
    assert llm.engine.kv.usage() == 0.0


def check_stacked_experts(
    model: torch.nn.Module, tmp_path: Path, stacked: str, tokens: list[int], rtol: float
) -> None:
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]; `stacked` among its names) saved as a checkpoint gives the logits of the
    per-expert checkpoint transformers writes exactly, and those are within rtol of its own."""
    from safetensors.torch import save_file

    model.save_pretrained(tmp_path / "published")
    (tmp_path / "stacked").mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert stacked in state
    save_file(state, tmp_path / "stacked" / "model.safetensors", metadata={"format": "pt"})
    config = (tmp_path / "published" / "config.json").read_text()
    (tmp_path / "stacked" / "config.json").write_text(config)
    (published,) = Runner(tmp_path / "published", 4).step([("a", tokens)])
    (from_stacked,) = Runner(tmp_path / "stacked", 4).step([("a", tokens)])
    assert torch.equal(published, from_stacked)
    assert rel_err(published, hf_logits(model, tokens)) <= rtol


def check_preset_command(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, tokens: list[int], rtol: float
) -> type:
    """`inferx checkpoint --preset name` writes a checkpoint that transformers loads and whose
    logits over `tokens` ours match within rtol. Returns the model arch registered for the
    checkpoint's architecture."""
    from inferx_core.cli import main

    out = tmp_path / name
    assert main(["checkpoint", "--preset", name, "--dtype", "float32", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    (ours,) = Runner(out, 16).step([("a", tokens)])
    assert rel_err(ours, hf_logits(ref, tokens)) <= rtol
    config = json.loads((out / "config.json").read_text())
    return plugins().get("model_arch", config["architectures"][0])


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    cfg = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, hf_model(cfg, path)


@pytest.mark.parametrize("block_size", [4, 16])
def test_packed_prefill_matches_transformers(checkpoint, block_size: int) -> None:
    path, ref = checkpoint
    runner = Runner(path, block_size)
    prompts = {"a": random_tokens(11, 1), "b": random_tokens(1, 2), "c": random_tokens(19, 3)}
    outs = runner.step(list(prompts.items()))
    for tokens, out in zip(prompts.values(), outs, strict=True):
        assert rel_err(out, hf_logits(ref, tokens)) <= RTOL


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_and_decode_match_transformers(checkpoint, block_size: int) -> None:
    path, ref = checkpoint
    runner = Runner(path, block_size)
    # Whole sequences up front: "decode" feeds their next token, as if it had been sampled.
    full = {"a": random_tokens(27, 4), "b": random_tokens(15, 5), "c": random_tokens(10, 6)}
    schedule = [
        [("a", 0, 7), ("b", 0, 6)],
        [("a", 7, 16)],
        [("a", 16, 23), ("b", 6, 13)],
        [("a", 23, 24), ("b", 13, 14), ("c", 0, 5)],
        [("a", 24, 25), ("c", 5, 9)],
        [("a", 25, 26), ("b", 14, 15), ("c", 9, 10)],
        [("a", 26, 27)],
    ]
    expected = {seq: hf_logits(ref, tokens) for seq, tokens in full.items()}
    for step in schedule:
        outs = runner.step([(seq, full[seq][a:b]) for seq, a, b in step])
        for (seq, a, b), out in zip(step, outs, strict=True):
            assert rel_err(out, expected[seq][a:b]) <= RTOL, (seq, a, b)


def test_sharded_checkpoint_gives_same_logits(tmp_path: Path) -> None:
    cfg = CONFIGS["llama3-scaled"]
    ref = hf_model(cfg)
    ref.save_pretrained(tmp_path / "one")
    ref.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "many").glob("model-*.safetensors"))) > 1
    tokens = random_tokens(9, 7)
    (one,) = Runner(tmp_path / "one", 4).step([("a", tokens)])
    (many,) = Runner(tmp_path / "many", 4).step([("a", tokens)])
    assert torch.equal(one, many)


def _tiny_model(cfg: dict[str, Any]) -> ModelArch:
    backend = TorchAttention(LlamaForCausalLM.kv_layout(cfg), 4, torch.float32, CPU)
    arch = Qwen2ForCausalLM if cfg["model_type"] == "qwen2" else LlamaForCausalLM
    return arch(cfg, BuildContext(torch.float32, CPU, backend, Unquantized()))


def test_unknown_missing_and_misshapen_tensors_are_named() -> None:
    cfg = CONFIGS["qwen2-tied"]
    weights = {
        name: torch.zeros(shape) for name, shape in Qwen2ForCausalLM.checkpoint_shapes(cfg).items()
    }
    extra = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match="unexpected checkpoint tensor.*q_norm"):
        _tiny_model(cfg).load_weights([*weights.items(), (extra, torch.zeros(32))])
    with pytest.raises(ValueError, match="unexpected checkpoint tensor.*layers.7"):
        _tiny_model(cfg).load_weights([("model.layers.7.input_layernorm.weight", torch.ones(64))])
    dropped = "model.layers.1.self_attn.v_proj.bias"
    with pytest.raises(ValueError, match=f"lacks 1 tensors: {dropped}"):
        _tiny_model(cfg).load_weights((n, t) for n, t in weights.items() if n != dropped)
    with pytest.raises(ValueError, match="shape"):
        _tiny_model(cfg).load_weights([("model.norm.weight", torch.ones(63))])
    with pytest.raises(ValueError, match="shape"):
        _tiny_model(cfg).load_weights([("model.layers.0.mlp.up_proj.weight", torch.ones(96, 63))])
    # Tied checkpoints that store lm_head anyway, and old rotary buffers, are accepted.
    extras = [("lm_head.weight", torch.zeros(VOCAB, 64))]
    extras.append(("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(16)))
    _tiny_model(cfg).load_weights([*weights.items(), *extras])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_write_checkpoint_loads_here_and_in_transformers(tmp_path: Path, name: str) -> None:
    one = write_checkpoint(name, tmp_path / "one", dtype=torch.float32, seed=3)
    many = write_checkpoint(
        name, tmp_path / "many", dtype=torch.float32, seed=3, max_shard_bytes=40_000
    )
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((one / "config.json").read_text())["torch_dtype"] == "float32"
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        one, attn_implementation="eager", dtype=torch.float32
    ).eval()
    tokens = random_tokens(13, 8)
    expected = hf_logits(ref, tokens)
    for path in (one, many):
        (out,) = Runner(path, 16).step([("a", tokens)])
        assert rel_err(out, expected) <= RTOL
    # The same seed gives DummyFormat's weights.
    stored = dict(SafetensorsFormat().open(one, torch.float32).weights)
    dummy = dict(DummyFormat().open(Path(name), torch.float32, seed=3).weights)
    assert stored.keys() == dummy.keys()
    assert all(torch.equal(stored[k], dummy[k]) for k in stored)


def test_write_checkpoint_copies_tokenizer(tmp_path: Path) -> None:
    source = FIXTURES / "tokenizers" / "qwen"
    out = write_checkpoint("tiny-qwen2", tmp_path, tokenizer_dir=source, dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (source / f).read_bytes()
    if importlib.util.find_spec("inferx_core.tokenizer") is not None:
        assert SafetensorsFormat().open(out, torch.bfloat16).tokenizer is not None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_dummy_is_seeded_and_finite(name: str) -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        return dict(DummyFormat().open(Path(name), torch.bfloat16, seed=seed).weights)

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])

    cfg = PRESETS[name]
    arch: type[ModelArch] = plugins().get("model_arch", cfg["architectures"][0])
    backend = TorchAttention(arch.kv_layout(cfg), 16, torch.bfloat16, CPU)
    backend.allocate(4)
    model = arch(cfg, BuildContext(torch.bfloat16, CPU, backend, Unquantized()))
    model.load_weights(a.items())
    backend.begin_step(make_attention_batch([20], [20], [[2, 0]], 16))
    with torch.no_grad():
        hidden = model(torch.arange(20), torch.arange(20))
        logits = model.compute_logits(hidden)
        into = torch.full((24, logits.shape[1]), float("nan"), dtype=logits.dtype)
        written = model.compute_logits_into(hidden, into[:20])  # the graphs' static rows
    assert logits.dtype == torch.bfloat16  # the model's; the sampler upcasts what it needs
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    assert written.data_ptr() == into.data_ptr() and torch.equal(into[:20], logits)
    assert into[20:].isnan().all()


def test_dummy_reads_config_dir_and_rejects_unknown_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    names = [n for n, _ in DummyFormat().open(tmp_path, torch.float32).weights]
    assert names == list(LlamaForCausalLM.checkpoint_shapes(PRESETS["tiny-llama"]))
    assert DummyFormat().detect(Path("tiny-llama")) and not DummyFormat().detect(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a directory with config.json"):
        DummyFormat().open(tmp_path / "nope", torch.float32)


def test_plugin_registers_archs_and_formats() -> None:
    assert plugins().get("model_arch", "LlamaForCausalLM") is LlamaForCausalLM
    assert plugins().get("model_arch", "Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert plugins().get("checkpoint_format", "safetensors") is SafetensorsFormat
    assert plugins().get("checkpoint_format", "dummy") is DummyFormat
    assert plugins().entry("checkpoint_format", "gguf").target == "inferx_models.gguf:GGUFFormat"


def test_building_an_engine_does_not_import_torch_dynamo() -> None:
    """Start-up never pays for torch._dynamo's import (1.2-1.3 s on the CPU VM, more on the H200
    machine's slower cores): nothing here compiles. nn.utils.skip_init(nn.Embedding) did import
    it, through a decomposition of normal_ on the meta device. A fresh interpreter, since
    another test may have imported it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from inferx_core.config import load_config\n"
        "from inferx_core.engine import LLM\n"
        "LLM(load_config(None, {'model.preset': 'tiny-qwen2', 'model.dtype': 'float32'}))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
