"""`inferx-server`: serve a model over OpenAI's HTTP API. Bad flags or config: one line, exit 2.

With no flags it serves the built-in demo model on 127.0.0.1:8000. SIGTERM drains (see
LitestarTransport.drain) and exits 0.
"""

from __future__ import annotations

import logging
import sys
import time

from inferx_core.cli import UsageError, _Parser, add_config_flags, config_from_args
from inferx_core.config import Config, ConfigError


def build_parser() -> _Parser:
    parser = _Parser(
        prog="inferx-server",
        description="Serve a model over OpenAI's HTTP API (completions, chat, models, metrics).",
    )
    add_config_flags(parser)
    return parser


def engine_in_process(config: Config) -> bool:
    """server.engine_process with "auto" resolved: a child process where the engine runs on a
    GPU, a thread of this process on a CPU."""
    choice = config.server.engine_process
    if choice == "auto":
        from inferx_core.executor import resolve_device

        return resolve_device(config.engine.device).type == "cuda"
    return choice


def main(argv: list[str] | None = None) -> int:
    from inferx_core.engine import Engine
    from inferx_core.executor import LoadError
    from inferx_core.plugins import PluginError, plugins

    logging.basicConfig(level=logging.WARNING, format="inferx-server: %(message)s")
    try:
        config = config_from_args(build_parser().parse_args(argv))
        t0 = time.perf_counter()
        reg = plugins()
        transport_cls = reg.get("transport", config.server.transport)
        if engine_in_process(config):
            from functools import partial

            from inferx_server.engine_process import EngineProcess, build_engine

            engine = EngineProcess(partial(build_engine, config))
        else:
            engine = Engine(config, reg=reg)
        transport = transport_cls(engine, config)  # type: ignore[operator]
        loaded = time.perf_counter() - t0
        from inferx_server.transport import bind

        sock = bind(config.server.host, config.server.port)
    except (UsageError, ConfigError, LoadError, PluginError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, or the host is not ours
        where = f"{config.server.host}:{config.server.port}"
        print(f"error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

    def ready(url: str) -> None:
        name = getattr(getattr(transport, "state", None), "model_name", "the model")
        print(f"inferx-server: {name} loaded in {loaded:.1f} s; listening on {url}", flush=True)

    transport.serve(sock, on_ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
