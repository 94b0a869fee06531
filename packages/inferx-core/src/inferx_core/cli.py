"""The `inferx` command: plugins, generate, checkpoint. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import pydantic

from inferx_core.config import ConfigError, config_keys, error_lines, flag_help, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


class UsageError(Exception):
    pass


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--config FILE, and a flag for every config key (see config.ALIASES for the short ones),
    its help the key's description, default and choices (config.flag_help)."""
    parser.add_argument("--config", metavar="FILE", help="deploy.toml; flags override it")
    group = parser.add_argument_group("config keys (override the file)")
    for flag, (section, key, _) in config_keys().items():
        metavar, text = flag_help(section, key)
        group.add_argument(
            f"--{flag}",
            dest=f"cfg:{section}.{key}",
            metavar=metavar,
            help=text.replace("%", "%%"),  # argparse formats help with %
        )


def config_from_args(args: argparse.Namespace):  # -> Config
    overrides: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name.startswith("cfg:") and value is not None:
            overrides[name[4:]] = value
    return load_config(args.config, overrides)


def cmd_plugins(args: argparse.Namespace) -> int:
    from inferx_core.plugins import KINDS, plugins

    reg = plugins()
    rows = [("KIND", "NAME", "PACKAGE", "TARGET")]
    for kind in KINDS:
        for name in reg.names(kind):
            e = reg.entry(kind, name)
            target = e.target if isinstance(e.target, str) else repr(e.target)
            rows.append((kind, name, e.package, target))
    if args.json:
        print(
            json.dumps(
                [dict(zip(("kind", "name", "package", "target"), r, strict=True)) for r in rows[1:]]
            )
        )
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[3])
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    config = config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(config)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
    if args.stream and not args.json:
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    done = llm.generate(prompt, params)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": done.text,
                    "token_ids": done.token_ids,
                    "finish_reason": done.finish_reason,
                },
                ensure_ascii=False,
            )
        )
    else:
        print(done.text)
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    import torch

    from inferx_core.plugins import plugins

    write = plugins().get("preset", args.preset)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    out = write(  # type: ignore[operator]
        args.preset, args.out, tokenizer_dir=args.tokenizer, dtype=dtype[args.dtype], seed=args.seed
    )
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="inferx", description="InferX: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plugins", help="list every registered implementation")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    g = sub.add_parser("generate", help="complete one prompt offline")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help='print {"text": ..., "token_ids": [...]}')
    add_config_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("checkpoint", help="write a random-weight checkpoint of a preset's shapes")
    c.add_argument("--preset", required=True)
    c.add_argument(
        "--tokenizer",
        help="directory whose tokenizer files are copied in; for DeepSeek-V2 presets, a "
        "byte-level BPE tokenizer (Llama 3's) is cut down to the model's 102,400 ids with "
        "DeepSeek's special tokens and chat template (docs/BENCHMARKS.md)",
    )
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("out", help="output directory")
    c.set_defaults(func=cmd_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    from inferx_core.executor import LoadError
    from inferx_core.plugins import PluginError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except pydantic.ValidationError as exc:  # sampling flags: one line per bad value, by name
        for line in error_lines(exc, whole=exc.title):
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (ConfigError, LoadError, PluginError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `inferx` command: main(), then a process that joined a torch.distributed group (a
    tensor-parallel rank 0, under torchrun too) ends at once through exit_if_joined: a plain
    interpreter exit with gloo's threads alive aborts now and then. Not in main(), which tests
    call in a process that may have joined a group earlier."""
    code = main()
    joined = sys.modules.get("inferx_core.distributed")
    sys.exit(joined.exit_if_joined(code) if joined is not None else code)


if __name__ == "__main__":
    run()
