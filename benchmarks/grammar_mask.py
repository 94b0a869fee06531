"""Per-token cost of a JSON-schema token mask on the CPU: xgrammar against llguidance.

For each tokenizer and schema: the compile time (fresh, no cache), then a matcher walks a valid
instance token by token, filling the next-token bitmask before each token and accepting it
(the work the engine does per constrained row per step). Prints a table (ms).

python benchmarks/grammar_mask.py [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.torch
import torch
import transformers
import xgrammar as xgr
from commit_id import commit_id

from inferx_core.tokenizer import Tokenizer

# INFERX_FIXTURES as the tests read it, else shared/ beside the checkout
FIXTURES = (
    os.environ.get("INFERX_FIXTURES") or Path(__file__).resolve().parents[2] / "shared/fixtures"
)
QWEN = Path(FIXTURES) / "tokenizers" / "qwen"

# (name, schema, a valid instance)
SCHEMAS: list[tuple[str, dict, object]] = [
    (
        "flat object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    (
        "nested + enum + array",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "status": {"enum": ["active", "inactive", "banned"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                },
            },
            "required": ["id", "status", "tags", "address"],
        },
        {
            "id": 42,
            "status": "active",
            "tags": ["alpha", "beta", "gamma"],
            "address": {"street": "1 Main Street", "city": "Springfield", "zip": "12345"},
        },
    ),
    (
        "anyOf + numbers",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"radius": {"type": "number", "minimum": 0}},
                            "required": ["radius"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "w": {"type": "number", "minimum": 0},
                                "h": {"type": "number", "minimum": 0},
                            },
                            "required": ["w", "h"],
                        },
                    ]
                },
                "score": {"type": "number", "minimum": 0, "maximum": 100},
            },
            "required": ["shape", "score"],
        },
        {"shape": {"w": 3.5, "h": 2.25}, "score": 87.5},
    ),
    ("any JSON object", {"type": "object"}, {"a": [1, 2, {"b": None}], "text": "hello world"}),
]


def load_tokenizers() -> list[tuple[str, Tokenizer]]:
    import gguf

    from inferx_models.gguf import _tokenizer, find_demo_gguf

    reader = gguf.GGUFReader(find_demo_gguf())
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return [("SmolLM2", _tokenizer(meta, "demo")), ("Qwen2.5", Tokenizer.from_dir(QWEN))]


class XGrammar:
    name = "xgrammar " + getattr(xgr, "__version__", "0.2.9")

    def __init__(self, tok: Tokenizer, threads: int) -> None:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        self.vocab = tok.vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=self.vocab, stop_token_ids=sorted(tok.eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict) -> object:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: object) -> object:
        return xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int = 1) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab)

    def step(self, m: object, mask: torch.Tensor, token: int) -> None:
        m.fill_next_token_bitmask(mask, 0)
        assert m.accept_token(token), token

    def advance(self, m: object, token: int) -> None:
        assert m.accept_token(token), token

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)


COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidance:
    name = "llguidance " + llguidance.get_version().split()[0].split("@")[-1]

    def __init__(self, tok: Tokenizer, threads: int) -> None:
        self.vocab = tok.vocab_size
        self.tok = llguidance.LLTokenizer(
            tok.backend.to_str(), n_vocab=self.vocab, eos_token=sorted(tok.eos_token_ids)
        )
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, schema: dict) -> object:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=COMPACT
        )
        m = llguidance.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled: object) -> object:
        return llguidance.LLMatcher(self.tok, compiled)

    def bitmask(self, rows: int = 1) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(rows, self.vocab)

    def step(self, m: object, mask: torch.Tensor, token: int) -> None:
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(token), (token, m.get_error())

    def advance(self, m: object, token: int) -> None:
        assert m.consume_token(token), (token, m.get_error())

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], mask
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="rows of the batched fill")
    ap.add_argument("--repeat", type=int, default=3, help="walks of each instance")
    args = ap.parse_args()
    print(f"commit {commit_id()}, {os.cpu_count()} CPUs, compile threads {args.threads}")
    hdr = (
        f"| library | tokenizer (vocab) | schema | tokenizer setup s | compile ms "
        f"| mask ms/token p50 | p90 | max | tokens | batch {args.batch} ms p50 |"
    )
    print(hdr)
    print("|" + "---|" * 10)
    for tok_name, tok in load_tokenizers():
        for cls in (XGrammar, LLGuidance):
            t0 = time.perf_counter()
            lib = cls(tok, args.threads)
            setup = time.perf_counter() - t0
            for name, schema, instance in SCHEMAS:
                text = json.dumps(instance, separators=(",", ":"))
                ids = tok.encode(text, add_special_tokens=False)
                t0 = time.perf_counter()
                compiled = lib.compile(schema)
                compile_ms = (time.perf_counter() - t0) * 1e3
                times = []
                mask = lib.bitmask()
                for _ in range(args.repeat):
                    m = lib.matcher(compiled)
                    for t in ids:
                        t0 = time.perf_counter()
                        lib.step(m, mask, t)
                        times.append((time.perf_counter() - t0) * 1e3)
                q = statistics.quantiles(times, n=10)
                # A batch of rows at staggered positions, filled in one call on the threads.
                matchers = []
                for i in range(args.batch):
                    m = lib.matcher(compiled)
                    for t in ids[: i % len(ids)]:
                        lib.advance(m, t)
                    matchers.append(m)
                bmask = lib.bitmask(args.batch)
                batch_times = []
                for _ in range(args.repeat * 5):
                    t0 = time.perf_counter()
                    lib.fill_batch(matchers, bmask)
                    batch_times.append((time.perf_counter() - t0) * 1e3)
                print(
                    f"| {lib.name} | {tok_name} ({tok.vocab_size}) | {name} | {setup:.2f} "
                    f"| {compile_ms:.1f} | {statistics.median(times):.3f} | {q[8]:.3f} "
                    f"| {max(times):.3f} | {len(ids)} | {statistics.median(batch_times):.2f} |",
                    flush=True,
                )
                setup = float("nan")


if __name__ == "__main__":
    main()
