"""Registers inferx-quant's schemes. It registers none yet (see the package docstring)."""
