"""Choosing the quant scheme from the checkpoint and [quantization], and the shared ignore lists."""

from __future__ import annotations

import pytest
import torch

from inferx_core import builtin
from inferx_core.config import ConfigError, load_config
from inferx_core.executor import LoadError, build_quant_scheme, pick_quant_scheme
from inferx_core.hookspecs import hookimpl
from inferx_core.interfaces.quant import LinearSpec, QuantLinear, QuantScheme
from inferx_core.parallel import SINGLE
from inferx_core.plugins import Plugins
from inferx_core.quant_none import Unquantized
from inferx_core.quant_utils import is_ignored


class FakeFp8(QuantScheme):
    name = "fake-fp8"
    checkpoint_methods = ("fp8", "float-quantized")
    option_names = ("activation_scheme",)

    def linear(self, spec, dtype, device, parallel) -> QuantLinear:
        raise NotImplementedError


class FakeOnline(FakeFp8):
    name = "fake-online"
    checkpoint_methods = ("fake-online",)
    online = True


class _Schemes:
    @hookimpl
    def inferx_quant_schemes(self, register):
        register("fake-fp8", FakeFp8)
        register("fake-online", FakeOnline)


@pytest.fixture
def reg() -> Plugins:
    reg = Plugins(load_entry_points=False)
    reg.register(builtin, package="inferx-core")
    reg.register(_Schemes(), package="fake")
    return reg


def test_auto_without_quantization_config_is_none(reg: Plugins) -> None:
    assert pick_quant_scheme("auto", {}, reg) == "none"
    scheme = build_quant_scheme(load_config(), {"vocab_size": 10}, reg)
    assert isinstance(scheme, Unquantized)


def test_auto_picks_the_scheme_that_reads_the_method(reg: Plugins) -> None:
    assert pick_quant_scheme("auto", {"quant_method": "fp8"}, reg) == "fake-fp8"
    compressed = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"format": "float-quantized"}},
    }
    assert pick_quant_scheme("auto", compressed, reg) == "fake-fp8"


def test_auto_with_an_unknown_method_lists_the_known_ones(reg: Plugins) -> None:
    with pytest.raises(LoadError, match="'awq'.*fake-fp8 \\(fp8, float-quantized\\).*none"):
        pick_quant_scheme("auto", {"quant_method": "awq"}, reg)
    compressed = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(LoadError, match="format pack-quantized"):
        pick_quant_scheme("auto", compressed, reg)


def test_schemes_named_in_toml_must_fit_the_checkpoint(reg: Plugins) -> None:
    with pytest.raises(LoadError, match="'none'.*quant_method 'fp8'.*would not load"):
        pick_quant_scheme("none", {"quant_method": "fp8"}, reg)
    with pytest.raises(LoadError, match="'fake-fp8' needs a checkpoint quantized with it"):
        pick_quant_scheme("fake-fp8", {}, reg)
    with pytest.raises(LoadError, match="unknown scheme 'nope'"):
        pick_quant_scheme("nope", {}, reg)
    assert pick_quant_scheme("fake-online", {}, reg) == "fake-online"
    assert pick_quant_scheme("fake-fp8", {"quant_method": "fp8"}, reg) == "fake-fp8"


def test_options_reach_the_scheme_and_unknown_ones_are_refused(reg: Plugins) -> None:
    hf = {"quantization_config": {"quant_method": "fp8"}}
    config = load_config(overrides={"quantization.activation_scheme": "dynamic"})
    scheme = build_quant_scheme(config, hf, reg)
    assert isinstance(scheme, FakeFp8)
    assert scheme.config.options == {"activation_scheme": "dynamic"}
    assert scheme.config.checkpoint == {"quant_method": "fp8"}
    config = load_config(overrides={"quantization.group_size": 128})
    with pytest.raises(ConfigError, match="quantization.group_size: unknown option"):
        build_quant_scheme(config, hf, reg)
    with pytest.raises(ConfigError, match="quantization.group_size"):
        build_quant_scheme(config, {}, reg)  # Unquantized takes no options


def test_other_sections_still_refuse_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="engine.nope: unknown key"):
        load_config(overrides={"engine.nope": 1})


QKV = LinearSpec(
    "model.layers.0.self_attn.qkv_proj", 8, (8, 4, 4), part_names=("q_proj", "k_proj", "v_proj")
)
O_PROJ = LinearSpec("model.layers.0.self_attn.o_proj", 8, (8,))


def test_is_ignored_by_name_and_regex() -> None:
    assert is_ignored(O_PROJ, ["lm_head", "model.layers.0.self_attn.o_proj"])
    assert not is_ignored(O_PROJ, ["model.layers.1.self_attn.o_proj", "self_attn.o_proj"])
    assert is_ignored(O_PROJ, [r"re:.*\.o_proj"])
    assert not is_ignored(O_PROJ, [r"re:o_proj"])  # the regex matches the whole name
    assert not is_ignored(QKV, [])


def test_fused_layers_are_ignored_only_whole() -> None:
    parts = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert is_ignored(QKV, parts)
    assert is_ignored(QKV, [r"re:model\.layers\.0\..*"])
    assert is_ignored(QKV, ["model.layers.0.self_attn.qkv_proj"])
    assert not is_ignored(QKV, ["model.layers.1.self_attn.q_proj"])
    with pytest.raises(ValueError, match="qkv_proj: .*k_proj unquantized but not"):
        is_ignored(QKV, [parts[1]])


def test_unquantized_builds_dense_layers() -> None:
    layer = Unquantized().linear(O_PROJ, torch.float32, torch.device("cpu"), SINGLE)
    assert layer.dense_weight() is not None
