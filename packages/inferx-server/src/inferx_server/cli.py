"""`inferx-server`: serve a model over OpenAI's HTTP API. Bad flags or config: one line, exit 2.

With no flags it serves the built-in demo model on 127.0.0.1:8000. SIGTERM drains (see
LitestarTransport.drain) and exits 0.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from functools import partial

from inferx_core.cli import UsageError, _Parser, add_config_flags, config_from_args
from inferx_core.config import Config, ConfigError
from inferx_server.engine_process import (
    EngineProcess,
    build_engine,
    preload_grammars,
    show_startup_progress,
)
from inferx_server.listen import bind


def build_parser() -> _Parser:
    parser = _Parser(
        prog="inferx-server",
        description="Serve a model over OpenAI's HTTP API (completions, chat, models, metrics).",
    )
    add_config_flags(parser)
    return parser


def engine_in_process(config: Config) -> bool:
    """server.engine_process with "auto" resolved: a child process where the engine runs on a
    GPU, a thread of this process on a CPU. Decided without importing torch (see main)."""
    choice = config.server.engine_process
    if choice != "auto":
        return choice
    device = config.engine.device
    return device.startswith("cuda") or (device == "auto" and cuda_devices() > 0)


def cuda_devices() -> int:
    """CUDA devices the driver shows this process (0 without a driver), asked of libcuda
    directly: importing torch to ask would cost seconds before the child could start."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _user_errors() -> tuple[type[BaseException], ...]:
    """What main reports in one line (exit 2) rather than a traceback. A function, evaluated
    only when something was raised: LoadError's module imports torch."""
    from inferx_core.executor import LoadError
    from inferx_core.plugins import PluginError

    return (UsageError, ConfigError, LoadError, PluginError, ValueError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="inferx-server: %(message)s")
    show_startup_progress()
    engine = sock = None
    try:
        config = config_from_args(build_parser().parse_args(argv))
        if os.environ.get("RANK", "0") != "0":  # under torchrun: a tensor-parallel rank only
            from inferx_core.distributed import exit_if_joined, run_if_worker

            if (code := run_if_worker(config)) is not None:
                return exit_if_joined(code)
        # Listening first: a taken port is reported now, not after the model has loaded.
        sock = bind(config.server.host, config.server.port)
        t0 = time.perf_counter()
        if engine_in_process(config):
            # Started first: this process's own imports below (torch, the transport's) then
            # overlap the child's, instead of preceding them.
            engine = EngineProcess(partial(build_engine, config), wait=False)
        from inferx_core.engine import Engine
        from inferx_core.plugins import plugins

        reg = plugins()
        transport_cls = reg.get("transport", config.server.transport)
        if engine is None:
            engine = Engine(config, reg=reg)
            preload_grammars(engine)
        else:
            engine.wait_ready()
        transport = transport_cls(engine, config)  # type: ignore[operator]
        loaded = time.perf_counter() - t0
    except _user_errors() as exc:
        _close(engine, sock)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        _close(engine, sock)
        if sock is not None:  # listening already: the model's files
            print(f"error: {exc}", file=sys.stderr)
            return 2
        where = f"{config.server.host}:{config.server.port}"
        print(
            f"error: cannot listen on {where} (server.host, server.port): {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        _close(engine, sock)
        return 130

    def ready(url: str) -> None:
        name = getattr(getattr(transport, "state", None), "model_name", "the model")
        print(f"inferx-server: {name} loaded in {loaded:.1f} s; listening on {url}", flush=True)

    transport.serve(sock, on_ready=ready)
    code = 1 if getattr(transport, "failure", None) is not None else 0
    # Rank 0 of a tensor-parallel world (torchrun's, or one whose engine runs in this process)
    # ends at once: see exit_if_joined.
    parallel = config.parallel
    if parallel.tensor > 1 or parallel.distributed_executor or os.environ.get("WORLD_SIZE"):
        from inferx_core.distributed import exit_if_joined

        return exit_if_joined(code)
    return code


def _close(engine: object, sock: socket.socket | None = None) -> None:
    """Stop an engine process that was started before start-up failed; free the port."""
    if isinstance(engine, EngineProcess):
        engine.close()
    if sock is not None:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
