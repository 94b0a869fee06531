"""Finds installed plugins (entry point group "inferx") and looks implementations up by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import pluggy

from inferx_core import hookspecs

log = logging.getLogger("inferx.plugins")

# kind -> hook name. The kinds are what a deployment's TOML picks by name.
KINDS = {
    "model_arch": "inferx_model_archs",
    "checkpoint_format": "inferx_checkpoint_formats",
    "attention_backend": "inferx_attention_backends",
    "scheduler": "inferx_schedulers",
    "kv_manager": "inferx_kv_managers",
    "quant_scheme": "inferx_quant_schemes",
    "transport": "inferx_transports",
    "kernel_ops": "inferx_kernel_ops",
    "executor": "inferx_executors",
    "preset": "inferx_presets",
    "grammar_backend": "inferx_grammar_backends",
}
ENTRY_POINT_GROUP = "inferx"
# Comma-separated entry point names to load; unset loads all. "" loads only what is registered
# by hand (tests).
ALLOW_ENV = "INFERX_PLUGINS"


class PluginError(Exception):
    """A plugin failed to load, or a name is not registered."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    target: object  # the object, or "module:attr"
    package: str  # distribution that registered it

    def load(self) -> object:
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            obj: object = importlib.import_module(module)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
            raise PluginError(
                f"{self.kind} {self.name!r} from {self.package} failed to load "
                f"({self.target}): {exc}"
            ) from exc
        return obj


class Plugins:
    """The plugin manager plus a registry of what each plugin registered, by kind and name."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("inferx")
        self.pm.add_hookspecs(hookspecs)
        self._packages: dict[int, str] = {}
        self.failures: dict[str, str] = {}  # entry point -> why it did not load
        if load_entry_points:
            self._load_entry_points()
        self._entries: dict[str, dict[str, Entry]] | None = None

    def _load_entry_points(self) -> None:
        allow = os.environ.get(ALLOW_ENV)
        allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            package = ep.dist.name if ep.dist else ep.module
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop the rest
                self.failures[ep.name] = f"{package}: {type(exc).__name__}: {exc}"
                log.warning("plugin %r from %s failed to load: %s", ep.name, package, exc)
                continue
            if self.pm.is_registered(module):
                continue
            self.register(module, package=package, name=ep.name)

    def register(self, plugin: object, package: str, name: str | None = None) -> None:
        """Register a plugin object (a module or any object with hookimpls)."""
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        self._packages[id(plugin)] = package
        self._entries = None

    def unregister(self, plugin: object) -> None:
        self.pm.unregister(plugin)
        self._packages.pop(id(plugin), None)
        self._entries = None

    @property
    def entries(self) -> dict[str, dict[str, Entry]]:
        if self._entries is None:
            self._entries = self._collect()
        return self._entries

    def _collect(self) -> dict[str, dict[str, Entry]]:
        entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        for kind, hook_name in KINDS.items():
            # Oldest registration first, so built-ins come before third parties.
            for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
                package = self._packages.get(id(impl.plugin), _module_name(impl.plugin))

                def register(name: str, target: object, _p: str = package, _k: str = kind) -> None:
                    old = entries[_k].get(name)
                    if old is not None and old.target != target:
                        raise PluginError(
                            f"{_k} {name!r} is registered by both {old.package} and {_p}"
                        )
                    entries[_k][name] = Entry(_k, name, target, _p)

                impl.function(register=register)
        return entries

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def entry(self, kind: str, name: str) -> Entry:
        try:
            return self.entries[kind][name]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none installed"
            broken = "".join(
                f"; plugin {p!r} failed to load ({e})" for p, e in self.failures.items()
            )
            raise PluginError(f"unknown {kind} {name!r}; known: {known}{broken}") from None

    def get(self, kind: str, name: str) -> object:
        """The implementation registered as `name` for `kind`, imported now."""
        return self.entry(kind, name).load()


def _module_name(plugin: object) -> str:
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    return type(plugin).__module__


@cache
def plugins() -> Plugins:
    """The process-wide plugin set, loaded from entry points on first use."""
    return Plugins()
