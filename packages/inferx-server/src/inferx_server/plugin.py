"""Registers InferX's HTTP server as transport "litestar", through the hook any plugin uses."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_transports(register: Register) -> None:
    register("litestar", "inferx_server.transport:LitestarTransport")
