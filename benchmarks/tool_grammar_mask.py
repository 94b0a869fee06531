"""Per-token cost of the tool-call grammars' masks on the CPU (inferx_server.tool_grammars).

For each family and kind of grammar, `rows` matchers walk a recorded reply token by token; before
each token the next-token bitmask of all rows is filled in one llguidance call (the engine's
work per step), and the mean and worst fill are printed with those of a plain-text grammar
(`start: /(.|\\n)*/`) on the same reply, the floor a grammar that lets text through can reach.

python benchmarks/tool_grammar_mask.py [--rows 1 64] [--threads 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import llguidance
import torch

from inferx_core.tokenizer import Tokenizer
from inferx_server.grammar_llguidance import LLGuidanceBackend
from inferx_server.tool_grammars import tool_grammar

FIXTURES = (
    os.environ.get("INFERX_FIXTURES") or Path(__file__).resolve().parents[2] / "shared/fixtures"
)
TOKENIZERS = Path(FIXTURES) / "tokenizers"
VOCAB = {"qwen": 151936, "llama3": 128256, "gpt-oss": 201088}
FUNCS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
    {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {}}}},
]
TEXT = (
    "Paris has a temperate oceanic climate: mild winters, warm summers and rain spread over "
    "the year. Let me look up today's weather for you before I answer."
)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
# (tokenizer, family, required, what the reply is, reply)
HARMONY_CALL = (
    "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)
CASES = [
    ("qwen", "hermes", False, "text, call", f"{TEXT}\n<tool_call>\n{CALL}\n</tool_call>"),
    ("qwen", "hermes", True, "call", f"<tool_call>\n{CALL}\n</tool_call>"),
    # Llama 3's vocabulary has no <tool_call> token: the hermes fallback's text marker.
    ("llama3", "hermes", False, "text, call", f"{TEXT}\n<tool_call>\n{CALL}\n</tool_call>"),
    ("llama3", "llama3", False, "call", CALL.replace('"arguments"', '"parameters"')),
    ("llama3", "llama3", False, "text", TEXT),
    (
        "gpt-oss",
        "harmony",
        False,
        "analysis, call",
        f"<|channel|>analysis<|message|>{TEXT}{HARMONY_CALL}",
    ),
    (
        "gpt-oss",
        "harmony",
        False,
        "analysis, final",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        f"<|message|>{TEXT}<|return|>",
    ),
    (
        "gpt-oss",
        "harmony",
        True,
        "analysis, call",
        f"<|channel|>analysis<|message|>{TEXT}{HARMONY_CALL}",
    ),
]


def walk(backend: LLGuidanceBackend, compiled: str, ids: list[int], rows: int) -> list[float]:
    """Seconds of each step's fill of `rows` rows walking `ids`."""
    matchers = [backend.matcher(compiled) for _ in range(rows)]
    mask = torch.zeros(rows, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        start = time.perf_counter()
        backend.fill_bitmask(matchers, mask)
        times.append(time.perf_counter() - start)
        for m in matchers:
            if not m.accept(token):
                raise RuntimeError(f"the grammar refused token {token}")
    return times


def _ms(times: list[float]) -> str:
    return f"{statistics.mean(times) * 1e3:.3f} / {max(times) * 1e3:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    toks = {name: Tokenizer.from_dir(TOKENIZERS / name) for name in VOCAB}
    backends = {name: LLGuidanceBackend(tok, VOCAB[name]) for name, tok in toks.items()}
    for backend in backends.values():
        backend.executor = llguidance.LLExecutor(args.threads)
    plain = "start: TEXT\nTEXT: /(.|\\n)*/\n"
    print(f"threads {args.threads}, best of {args.repeat}; ms per step: mean / max")
    head = f"{'tokenizer':9} {'family':8} {'kind':8} {'reply':16} {'tokens':>6} {'rows':>4}"
    print(head + "  mean / max")
    plains = [(n, "plain", False, "text", TEXT) for n in VOCAB]
    for name, family, required, what, reply in plains + CASES:
        tok, backend = toks[name], backends[name]
        ids = tok.encode(reply, add_special_tokens=False)
        if family == "plain":
            compiled, kind = backend.compile(plain, "lark"), "text"
        else:
            grammar = tool_grammar(tok, family, FUNCS, required=required)
            compiled, kind = backend.compile(grammar, "lark"), "required" if required else "lazy"
        for rows in args.rows:
            runs = [walk(backend, compiled, ids, rows) for _ in range(args.repeat)]
            best = min(runs, key=sum)
            print(f"{name:9} {family:8} {kind:8} {what:16} {len(ids):>6} {rows:>4}  {_ms(best)}")


if __name__ == "__main__":
    main()
