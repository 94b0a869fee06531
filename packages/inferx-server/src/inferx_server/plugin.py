"""Registers InferX's HTTP server as transport "litestar", and llguidance as structured
output's grammar backend, through the hooks any plugin uses."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_transports(register: Register) -> None:
    register("litestar", "inferx_server.transport:LitestarTransport")


@hookimpl
def inferx_grammar_backends(register: Register) -> None:
    register("llguidance", "inferx_server.grammar_llguidance:LLGuidanceBackend")
