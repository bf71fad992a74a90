"""Several models in one engine: [[models]] and `--model NAME=PATH`, each model with its own KV
pages and batches, greedy tokens on each equal to transformers' alone and with both generating
at once, programs listing and binding models by name, a snapshot of one model refused on
another with the program going on, and clients seeing every model with what it reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from pie.actors.generate import generate
from pie.actors.requester import RequestRefused
from pie.cli import build_parser
from pie.cli.options import engine_config
from pie.config import ConfigError, EngineConfig, ServerConfig, config_from_dict, with_overrides
from pie.drivers.factory import model_configs
from pie.engine import Engine, open_engine
from pie.events.sampling import Argmax
from pie.server.app import Server
from tests.engine_greedy import hf_greedy
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.tiny_models import save_tiny_model

PROMPTS = [[5, 9, 33, 71, 2, 18], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
TOKENS = 8


def entry(name: str, path: Path) -> dict[str, Any]:
    return {"name": name, "path": str(path), "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Llama and a tiny Qwen2, each with transformers' greedy tokens for every prompt,
    and a config that serves both."""
    root = tmp_path_factory.mktemp("models")
    references = {
        "writer": save_tiny_model(root / "writer", dict(model_type="llama"), seed=1),
        "critic": save_tiny_model(root / "critic", dict(model_type="qwen2"), seed=2),
    }
    expected = {
        (name, i): hf_greedy(model, ids, TOKENS)
        for name, model in references.items()
        for i, ids in enumerate(PROMPTS)
    }
    config = config_from_dict(
        {
            "models": [entry(n, root / n) for n in references],
            "kv": {"num_pages": 96, "page_size": 4},
        }
    )
    return SimpleNamespace(config=config, expected=expected, root=root)


async def greedy(engine: Engine, model: str | None, ids: list[int]) -> list[int]:
    async with engine.requester(model=model) as requester:
        done = await generate(requester, ids, max_tokens=TOKENS, sampler=Argmax())
    return list(done.tokens)


@pytest.mark.unit
def test_models_entries_replace_the_single_model_and_share_the_kv_budget() -> None:
    config = config_from_dict(
        {"models": [{"name": "a", "path": "x"}, {"name": "b", "path": "y", "kv_share": 0.25}]}
    )
    assert [m.name for m in config.model_entries] == ["a", "b"]
    assert config.model.name == "a"  # [model] is the default entry
    assert config.kv_shares() == (0.75, 0.25)
    sized = with_overrides(config, kv={"num_pages": 100})
    assert [c.kv.num_pages for c in model_configs(sized)] == [75, 25]
    assert [c.model.path for c in model_configs(sized)] == ["x", "y"]
    assert EngineConfig().model_entries == (EngineConfig().model,)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        ({"model": {}, "models": [{}]}, "not both"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "['a'] given more than once"),
        ({"models": [{"kv_share": 0.75}, {"kv_share": 0.5}]}, "add up to 1.25, over 1"),
        ({"models": [{"name": "bad name"}]}, "model name 'bad name'"),
    ],
)
def test_bad_models_entries_are_refused_naming_the_problem(
    data: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(ConfigError, match=complaint.replace("[", r"\[").replace("(", r"\(")):
        config_from_dict(data)


@pytest.mark.unit
def test_repeated_model_flags_name_each_model_and_share_the_other_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "a=one.gguf", "--model", "b=/models/two", "--weights", "int8"]
    )
    config = engine_config(args)
    assert [(m.name, m.path, m.weights) for m in config.model_entries] == [
        ("a", "one.gguf", "int8"),
        ("b", "/models/two", "int8"),
    ]
    single = engine_config(build_parser().parse_args(["serve", "--model", "one.gguf"]))
    assert single.models == () and single.model.path == "one.gguf"
    with pytest.raises(ValueError, match="NAME=PATH"):
        engine_config(build_parser().parse_args(["serve", "--model", "a", "--model", "b"]))


@pytest.mark.model
async def test_each_model_generates_its_own_greedy_tokens_alone_and_at_once(
    tiny: SimpleNamespace,
) -> None:
    async with open_engine(tiny.config) as engine:
        assert [m.name for m in engine.models] == ["writer", "critic"]
        alone = {
            (name, i): await greedy(engine, name, ids)
            for name in ("writer", "critic")
            for i, ids in enumerate(PROMPTS)
        }
        together: dict[tuple[str, int], list[int]] = {}

        async def run(name: str, i: int) -> None:
            together[(name, i)] = await greedy(engine, name, PROMPTS[i])

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for key in tiny.expected:
                    nursery.start_soon(run, *key)
        stats = engine.statistics()
    assert alone == tiny.expected
    assert together == tiny.expected
    assert [m.kv.pages_total for m in stats.models] == [48, 48]
    assert all(m.kv.pages_free == m.kv.pages_total for m in stats.models)
    assert all(m.inference.passes > 0 for m in stats.models)


@pytest.mark.model
async def test_a_snapshot_of_one_model_is_refused_on_another_by_name(
    tiny: SimpleNamespace,
) -> None:
    async with open_engine(tiny.config) as engine:
        async with engine.requester(model="writer") as writer:
            context = await writer.create_context()
            await writer.forward(context, PROMPTS[0])
            await writer.save(context, "draft")
        async with engine.requester(model="critic") as critic:
            with pytest.raises(RequestRefused) as refused:
                await critic.open("draft")
            served = await greedy(engine, "critic", PROMPTS[0])
    assert refused.value.kind == "wrong_model"
    assert "snapshot 'draft' holds the KV of model 'writer', not 'critic'" in str(refused.value)
    assert served == tiny.expected[("critic", 0)]


@pytest.mark.model
async def test_programs_list_bind_and_run_every_model_by_name(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "model_probe").read_bytes()
    requests = [
        {"model": name, "prompt": PROMPTS[i], "tokens": TOKENS} for (name, i) in tiny.expected
    ]
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        cards = await run_json(engine, program, {"mode": "list"})
        tokens = await run_json(engine, program, {"mode": "greedy", "requests": requests})
        cross = await run_json(
            engine,
            program,
            {
                "mode": "cross",
                "saved_on": "writer",
                "opened_on": "critic",
                "name": "notes",
                "prompt": PROMPTS[1],
            },
        )
        missing = await run_json(engine, program, {"mode": "missing", "name": "painter"})
        free = [(m.kv.pages_free, m.kv.pages_total) for m in engine.statistics().models]
    text = {"inputs": ["text"], "outputs": ["text"]}
    assert cards == [{"name": "writer", **text}, {"name": "critic", **text}]
    assert tokens == list(tiny.expected.values())
    assert cross["refused"]["kind"] == "wrong-model"
    assert "open it with model 'writer'" in cross["refused"]["message"]
    assert cross["after"] == tiny.expected[("critic", 1)][:2]
    assert missing == {
        "kind": "no-such-model",
        "message": "no model 'painter'; the engine serves ['writer', 'critic']",
    }
    assert all(f == t for f, t in free)


@pytest.mark.model
async def test_clients_see_every_model_with_what_it_reads(tiny: SimpleNamespace) -> None:
    async with open_engine(tiny.config) as engine:
        server = Server(engine, ServerConfig(auth="off"))
        welcome = server.welcome()
        status = server.engine_status(corr=1)
    assert welcome.model == "writer"
    assert [(c.name, c.inputs, c.outputs) for c in welcome.models] == [
        ("writer", ("text",), ("text",)),
        ("critic", ("text",), ("text",)),
    ]
    assert [(m.card.name, m.pages_total) for m in status.models] == [("writer", 48), ("critic", 48)]


@pytest.mark.model
async def test_two_models_with_one_name_stop_the_engine_from_starting(
    tiny: SimpleNamespace,
) -> None:
    config = config_from_dict(
        {"models": [entry("", tiny.root / "writer"), entry("", tiny.root / "writer")]}
    )
    with pytest.raises(ValueError, match=r"two models are named \['writer'\]"):
        async with open_engine(config):
            pass
