"""Structured output without a model: the sampler's grammar mask against a plain reference, the
engine's grammar cache and backend choice, SamplingParams.json_schema, and the llguidance
backend on the Qwen vocabulary (compile errors, masks along a valid output)."""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq

import pydantic
import pytest
import torch
from conftest import FIXTURES

from inferx_core.config import EngineSection
from inferx_core.grammar import Grammars, GrammarState, catch_up, grammar_masks
from inferx_core.hookspecs import hookimpl
from inferx_core.interfaces import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.plugins import Plugins
from inferx_core.sampler import Sampler, apply_grammar
from inferx_core.sequence import PENDING, SamplingParams, Sequence

QWEN = FIXTURES / "tokenizers" / "qwen"


class SetMatcher(GrammarMatcher):
    """Allows a fixed set of tokens; terminated after `length` accepted tokens."""

    def __init__(self, backend: SetBackend, allowed: set[int], length: int = 3) -> None:
        self.backend = backend
        self.allowed = allowed
        self.length = length
        self.accepted: list[int] = []

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return token in self.allowed

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class SetBackend(GrammarBackend):
    """A schema here is {"allowed": [ids]}; counts its compilations."""

    def __init__(self, tokenizer: object = None, vocab_size: int = 0) -> None:
        self.vocab_size = vocab_size
        self.compiled: list[str] = []

    def compile(self, schema: str, kind: str = "json_schema") -> set[int]:
        self.compiled.append(schema)
        spec = json.loads(schema)
        if "allowed" not in spec:
            raise GrammarError("SetBackend: the schema has no 'allowed'")
        return set(spec["allowed"])

    def matcher(self, compiled: set[int]) -> SetMatcher:
        return SetMatcher(self, compiled)

    def fill_bitmask(self, matchers: Seq[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        words = bitmask.shape[1]
        for i, m in enumerate(matchers):
            if not isinstance(m, SetMatcher):
                continue
            bits = [0] * words
            for t in m.allowed:
                bits[t // 32] |= 1 << (t % 32)
            # int32 two's complement of each word
            bitmask[i] = torch.tensor([b - (1 << 32) if b >> 31 else b for b in bits])


def structured(params: list[SamplingParams], allowed: list[set[int] | None]) -> list[Sequence]:
    backend = SetBackend()
    out = []
    for p, a in zip(params, allowed, strict=True):
        seq = Sequence([1, 2, 3], p)
        if a is not None:
            seq.grammar = GrammarState(SetMatcher(backend, a, length=1000))
        out.append(seq)
    return out


def test_mask_matches_a_plain_reference() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(4, vocab, generator=g)
    allowed = [
        {0, 31, 32, 63, 999},  # word edges, bit 31 (the int32 sign bit), the last token
        None,
        set(torch.randperm(vocab, generator=g)[:300].tolist()),
        None,
    ]
    seqs = structured([SamplingParams()] * 4, allowed)
    got = apply_grammar(logits.clone(), seqs)
    ref = logits.double().clone()
    for row, a in enumerate(allowed):
        if a is not None:
            for t in range(vocab):
                if t not in a:
                    ref[row, t] = float("-inf")
    assert torch.equal(got.double(), ref)


def test_matchers_read_the_token_of_the_step_in_flight() -> None:
    """With a step in flight the previous token is still PENDING on the host: the masks' task
    asks for it (the executor reads that step's result) before filling; the engine's later
    catch-up finds nothing new to hand over; a complete grammar masks nothing (its row's token
    is dropped)."""
    seq = Sequence([1, 2, 3], SamplingParams())
    state = GrammarState(SetMatcher(SetBackend(), {7, 8, 9}, length=3))
    seq.grammar = state
    seq.token_ids += [7, PENDING, PENDING]  # 7 known, 8 in flight, the last sampled now
    seq.num_pending = 2
    asked: list[Sequence] = []

    def pending(s: Sequence) -> int:
        asked.append(s)
        return 8

    masks = grammar_masks([seq], pending, 40)
    logits = apply_grammar(torch.zeros(1, 40), [seq], masks)
    assert asked == [seq] and state.matcher.accepted == [7, 8] and state.accepted == 2
    assert set(torch.nonzero(logits[0] == 0).flatten().tolist()) == {7, 8, 9}
    seq.token_ids[-2:] = [8, 9]  # update() fills both in
    seq.num_pending = 0
    catch_up([seq])
    assert state.matcher.accepted == [7, 8, 9] and state.done
    seq.token_ids.append(PENDING)
    assert bool(apply_grammar(torch.zeros(1, 40), [seq]).isfinite().all())
    with pytest.raises(RuntimeError, match="PENDING"):  # no one to ask: a bug, said loudly
        fresh = Sequence([1, 7], SamplingParams(), num_prompt=1)
        fresh.token_ids[1] = PENDING
        fresh.token_ids.append(PENDING)
        fresh.grammar = GrammarState(SetMatcher(SetBackend(), {7}))
        apply_grammar(torch.zeros(1, 40), [fresh])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mask_and_sampling_at_a_real_vocabulary() -> None:
    """On the GPU at Qwen2.5's 151,936 logits and 64 rows (half structured), bf16 logits as a
    graph leaves them: the device's mask equals the CPU's, and greedy and sampled rows draw only
    allowed tokens."""
    g = torch.Generator().manual_seed(4)
    vocab, rows = 151_936, 64
    logits = torch.randn(rows, vocab, generator=g)
    allowed = [
        set(torch.randint(0, vocab, (50,), generator=g).tolist()) | {vocab - 1} if i % 2 else None
        for i in range(rows)
    ]
    seqs = structured([SamplingParams()] * rows, allowed)
    got = apply_grammar(logits.cuda(), seqs).cpu()
    assert torch.equal(got, apply_grammar(logits.clone(), seqs))
    sampler = Sampler(torch.device("cuda"), seed=1)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.95)):
        tokens, _ = sampler(logits.cuda().bfloat16(), structured([params] * rows, allowed))
        for t, a in zip(tokens.tolist(), allowed, strict=True):
            assert a is None or t in a


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=5),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=2, presence_penalty=0.5),
    ],
)
def test_sampler_draws_only_allowed_tokens(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(2)
    vocab = 300
    sampler = Sampler(torch.device("cpu"), seed=3)
    allowed = [{5, 77, 200}, None, {299}]
    for _ in range(30):
        logits = torch.randn(3, vocab, generator=g) * 3
        seqs = structured([params] * 3, allowed)
        tokens, top = sampler(logits.clone(), seqs)
        assert tokens[0].item() in allowed[0] and tokens[2].item() == 299
        if params.greedy:  # the best allowed token, and row 1 is untouched
            assert tokens[0].item() == max(allowed[0], key=lambda t: logits[0, t].item())
            assert tokens[1].item() == logits[1].argmax().item()
        if top is not None:  # logprobs stay those of the raw logits
            raw = logits.float().log_softmax(dim=1)
            want = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(top.sampled, want, atol=1e-5, rtol=0)


def _registry(name: str, cls: type[GrammarBackend]) -> Plugins:
    """Plugins holding one grammar backend, `cls` as `name`."""

    class Plugin:
        @hookimpl
        def inferx_grammar_backends(self, register: object) -> None:
            register(name, cls)  # type: ignore[operator]

    reg = Plugins(load_entry_points=False)
    reg.register(Plugin(), package="test")
    return reg


def _grammars(size: int = 2, backend: str = "auto") -> tuple[Grammars, SetBackend]:
    reg = _registry("sets", SetBackend)
    config = EngineSection(grammar_backend=backend, grammar_cache_size=size)
    grammars = Grammars(config, reg, tokenizer=object(), vocab_size=64)
    return grammars, grammars.backend  # type: ignore[return-value]


def test_compiled_schemas_are_kept_least_recently_used_first_out() -> None:
    grammars, backend = _grammars(size=2)
    a, b, c = (json.dumps({"allowed": [i]}) for i in range(3))
    for schema in (a, b, a, c, a, b):
        grammars.matcher(schema)
    # a, b compiled; a hit; c evicts b (a was used last); a hit; b evicts c
    assert backend.compiled == [a, b, c, b]
    m1, m2 = grammars.matcher(a), grammars.matcher(a)
    assert m1 is not m2 and m1.allowed == {0}  # one matcher per sequence


def test_cache_size_zero_compiles_every_time() -> None:
    grammars, backend = _grammars(size=0)
    for _ in range(3):
        grammars.matcher('{"allowed":[1]}')
    assert len(backend.compiled) == 3


def test_compile_errors_are_grammar_errors_and_not_cached() -> None:
    grammars, backend = _grammars()
    for _ in range(2):
        with pytest.raises(GrammarError, match="no 'allowed'"):
            grammars.matcher('{"type":"object"}')
    assert len(backend.compiled) == 2


def test_unknown_backend_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"engine.grammar_backend: unknown backend 'xg'.*sets"):
        _grammars(backend="xg")


def test_no_backend_installed_says_what_to_install() -> None:
    grammars = Grammars(EngineSection(), Plugins(load_entry_points=False), object(), 64)
    with pytest.raises(ValueError, match="pip install inferx-server"):
        grammars.matcher('{"type":"object"}')


def test_preload_builds_the_backend_on_a_thread_before_the_first_request() -> None:
    """A server preloads: the backend is built on another thread, once, and the first
    structured request uses that one."""
    import threading

    built: list[str] = []

    class SlowBackend(SetBackend):
        def __init__(self, tokenizer: object = None, vocab_size: int = 0) -> None:
            super().__init__(tokenizer, vocab_size)
            built.append(threading.current_thread().name)

    grammars = Grammars(EngineSection(), _registry("slow", SlowBackend), object(), 64)
    grammars.preload()
    grammars.preload()  # a second call starts nothing
    assert grammars.matcher('{"allowed":[3]}').allowed == {3}
    assert built == ["inferx-grammar-load"]
    assert isinstance(grammars.backend, SlowBackend) and len(built) == 1


def test_a_failed_preload_is_the_first_structured_requests_error() -> None:
    grammars = Grammars(EngineSection(), Plugins(load_entry_points=False), object(), 64)
    grammars.preload()
    for _ in range(2):  # raised to the first request, and built (and refused) again after
        with pytest.raises(ValueError, match="pip install inferx-server"):
            grammars.matcher('{"type":"object"}')
    no_tokenizer = Grammars(EngineSection(), Plugins(load_entry_points=False), None, 64)
    no_tokenizer.preload()  # nothing to build without a tokenizer
    assert no_tokenizer._loader is None


def test_sampling_params_json_schema() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    p = SamplingParams(json_schema=schema)
    assert p.json_schema == json.dumps(schema, separators=(",", ":"))  # key order kept
    assert SamplingParams(json_schema=json.dumps(schema, indent=2)).json_schema == p.json_schema
    with pytest.raises(pydantic.ValidationError, match="not valid JSON"):
        SamplingParams(json_schema="{type: object")
    with pytest.raises(pydantic.ValidationError, match="an object"):
        SamplingParams(json_schema="[1, 2]")


# -- llguidance on a real vocabulary --------------------------------------------------------


@pytest.fixture(scope="module")
def llg() -> GrammarBackend:
    pytest.importorskip("llguidance")
    from inferx_core.tokenizer import Tokenizer
    from inferx_server.grammar_llguidance import LLGuidanceBackend

    tok = Tokenizer.from_dir(QWEN)
    return LLGuidanceBackend(tok, tok.vocab_size + 7)  # logits wider than the vocabulary


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "foo"}, "Invalid type"),
        ({"type": "string", "pattern": "[a-"}, "regex"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
        ({"properties": {"a": {"$ref": "#/defs/x"}}}, "/defs/x"),
        ({"not": {"type": "string"}}, "not"),
    ],
)
def test_llguidance_refuses_bad_schemas_by_name(
    llg: GrammarBackend, schema: dict, problem: str
) -> None:
    with pytest.raises(GrammarError, match=problem):
        llg.compile(json.dumps(schema))


def test_llguidance_masks_along_a_valid_output(llg: GrammarBackend) -> None:
    from inferx_core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(QWEN)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2}},
        "required": ["n", "tags"],
        "additionalProperties": False,
    }
    text = '{"n":12,"tags":["a",true]}'
    ids = tok.encode(text, add_special_tokens=False)
    matchers = [llg.matcher(llg.compile(json.dumps(schema))), None]
    vocab = llg.vocab_size  # type: ignore[attr-defined]
    words = (vocab + 31) // 32
    for i, t in enumerate(ids):
        mask = torch.full((2, words), -1, dtype=torch.int32)
        llg.fill_bitmask(matchers, mask)
        bits = ((mask.unsqueeze(2) >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1)
        assert bits[0, t] == 1, tok.decode([t])
        # it constrains (inside a string nearly anything goes; an object opens with '{')
        assert bits[0, :vocab].sum() < (1000 if i == 0 else tok.vocab_size)
        assert bits[0, tok.vocab_size :].sum() == 0  # ids past the vocabulary never
        assert bool((mask[1] == -1).all())  # an unconstrained row is left alone
        assert not matchers[0].is_terminated()
        assert matchers[0].accept(t)
    assert matchers[0].is_terminated()  # the object is closed: nothing but EOS may follow
    fresh = llg.matcher(llg.compile(json.dumps(schema)))
    assert not fresh.accept(tok.encode("hello", add_special_tokens=False)[0])
