"""Media through the OpenAI endpoint and the WebSocket client, on a tiny random Qwen2-VL whose
chat template places images, served beside a tiny text model: a picture in a chat message (a data
URL) gives the same greedy text and prompt count as the same turn run in a program, whole and
streamed, and through the Responses API; `/v1/models` says what each model reads; bad media are
400s naming the part, the server serving afterwards; and a file sent with `send_file` reaches a
session while one over the frame limit is refused before it is sent (by `pie submit --file`
too)."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import trio

from pie.cli import client as client_cli
from pie.cli.parser import build_parser
from pie.client import MessageTooLarge, SessionMessage, connect
from pie.config import HttpConfig
from pie.engine import open_engine
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER, Mounts
from pie.wire.frames import DEFAULT_MAX_FRAME
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_chat_media import QWEN2_VL
from tests.tiny_media import png, save_tiny_vl, vl_beside_text

pytestmark = pytest.mark.model

TEXT, TOKENS = "What is this?", 6


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory,
    built: Callable[[Path], Path],  # noqa: F811
) -> SimpleNamespace:
    """The two models' config, the server and probe components, and three pictures."""
    root = tmp_path_factory.mktemp("openai-media")
    save_tiny_vl(root / "vl", seed=0, chat_template=QWEN2_VL)
    server = {"host": "127.0.0.1", "port": 0, "programs_dir": str(root / "programs")}
    config = vl_beside_text(root, num_pages=512, server=server)
    return SimpleNamespace(
        config=config,
        server=built(OPENAI_SERVER).read_bytes(),
        probe=built(GUESTS / "media_probe").read_bytes(),
        pictures=[png(i, *size) for i, size in enumerate([(56, 84), (60, 60), (28, 28)])],
    )


@contextlib.asynccontextmanager
async def endpoints(tiny: SimpleNamespace) -> AsyncIterator[SimpleNamespace]:
    """One engine behind the OpenAI API (`api`, an openai client) and the WebSocket server
    (`ws`, its URL), with the probe installed (`probe`, its hash)."""
    async with open_engine(tiny.config) as engine:
        mounts = Mounts({OPENAI_PREFIX: engine.programs.add(tiny.server, name="openai").hash})
        front = HttpFront(engine, HttpConfig(port=0), mounts, host="127.0.0.1")
        server = Server(engine, tiny.config.server)
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            await nursery.start(server.run)
            api = openai.OpenAI(
                base_url=f"{front.url}{OPENAI_PREFIX}", api_key="-", max_retries=0, timeout=120
            )
            probe = engine.programs.add(tiny.probe, name="file-probe").hash
            yield SimpleNamespace(engine=engine, api=api, ws=server.url, probe=probe)
            with trio.CancelScope(shield=True):
                await server.stop(grace=5)
            front.stop()
            nursery.cancel_scope.cancel()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_turn(url: str, text: str = TEXT) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


async def call(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def refused(fn: Callable[[], Any]) -> dict[str, Any]:
    """The error object of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        await call(fn)
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    return body


async def test_a_picture_in_a_chat_turn_answers_as_the_same_turn_run_in_a_program(
    tiny: SimpleNamespace,
) -> None:
    picture = tiny.pictures[0]
    greedy = {"model": "vl", "max_tokens": TOKENS, "temperature": 0}
    async with endpoints(tiny) as served:
        api = served.api
        with trio.fail_after(120):
            direct = await run_json(
                served.engine,
                served.probe,
                {
                    "probe": "files",
                    "mode": "chat",
                    "model": "vl",
                    "image": base64.b64encode(picture).decode(),
                }
                | {"text": TEXT, "tokens": TOKENS},
            )
            messages = image_turn(data_url(picture))
            whole = await call(
                lambda: api.chat.completions.create(
                    messages=messages, extra_body={"ignore_eos": True}, **greedy
                )
            )
            chunks = await call(
                lambda: list(
                    api.chat.completions.create(
                        messages=messages, stream=True, extra_body={"ignore_eos": True}, **greedy
                    )
                )
            )
            stopping = await call(lambda: api.chat.completions.create(messages=messages, **greedy))
            content = [
                {"type": "input_image", "image_url": data_url(picture)},
                {"type": "input_text", "text": TEXT},
            ]
            response = await call(
                lambda: api.responses.create(
                    model="vl",
                    input=[{"role": "user", "content": content}],
                    max_output_tokens=TOKENS,
                    temperature=0,
                )
            )
            cards = {m.id: m.modalities for m in await call(api.models.list)}
    assert whole.choices[0].message.content == direct["text"]
    assert whole.usage.prompt_tokens == direct["prompt"]
    assert whole.usage.completion_tokens == TOKENS == len(direct["tokens"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == direct["text"]
    # The model's stop tokens end both APIs' answers alike.
    assert response.output_text == stopping.choices[0].message.content
    assert response.usage.input_tokens == direct["prompt"]
    assert cards == {
        "vl": {"input": ["text", "image", "video"], "output": ["text"]},
        "text": {"input": ["text"], "output": ["text"]},
    }


async def test_bad_media_are_refused_naming_the_part_and_the_server_goes_on(
    tiny: SimpleNamespace,
) -> None:
    good = data_url(tiny.pictures[2])
    broken_png = data_url(b"\x89PNG\r\n\x1a\n" + bytes(40))
    wav = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    async with endpoints(tiny) as served:
        api = served.api

        def chat(messages: Any, model: str = "vl", **extra: Any) -> Callable[[], Any]:
            return lambda: api.chat.completions.create(
                model=model, messages=messages, max_tokens=2, **extra
            )

        with trio.fail_after(120):
            seen = [
                await refused(chat(image_turn(good), model="text")),
                await refused(chat(image_turn("data:image/png;base64,%%%not base64"))),
                await refused(chat(image_turn(broken_png))),
                await refused(chat(image_turn("http://127.0.0.1:9/picture.png"))),
                await refused(chat([{"role": "user", "content": [wav]}])),
                await refused(chat([{"role": "user", "content": [{"type": "file", "file": {}}]}])),
                await refused(chat(image_turn(good, "a \ue000image\ue001 mark"))),
                await refused(chat(image_turn(good), modalities=["text", "audio"])),
                await refused(chat(image_turn(good), audio={"voice": "alloy", "format": "wav"})),
            ]
            parts = [{"type": "image_url", "image_url": {"url": good}}] * 9
            seen.append(await refused(chat([{"role": "user", "content": parts}])))
            served_after = await call(chat(image_turn(good)))
    part = "messages[0].content[0]"
    assert seen[0]["param"] == part and "model 'text' does not take image" in seen[0]["message"]
    assert seen[1]["param"] == part and "base64" in seen[1]["message"]
    assert seen[2]["param"] == part and "image" in seen[2]["message"]
    assert seen[3]["param"] == part and "remote media is not allowed" in seen[3]["message"]
    assert seen[4]["param"] == part and "does not take audio" in seen[4]["message"]
    assert seen[5]["param"] == part and "a part is text" in seen[5]["message"]
    assert seen[6]["param"] == "messages[0].content[1]" and "U+E000" in seen[6]["message"]
    assert seen[7] == seen[7] | {
        "param": "modalities",
        "message": "modalities: audio output is not supported by model 'vl'",
    }
    assert seen[8]["param"] == "audio" and "not supported by model 'vl'" in seen[8]["message"]
    assert seen[9]["param"] == "messages" and "9 media parts" in seen[9]["message"]
    assert served_after.usage.completion_tokens >= 1


async def test_a_file_sent_to_a_session_arrives_and_one_too_large_is_refused_before_sending(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    picture, huge = tmp_path / "picture.png", tmp_path / "huge.bin"
    picture.write_bytes(tiny.pictures[1])
    with huge.open("wb") as sparse:
        sparse.truncate(DEFAULT_MAX_FRAME)
    async with endpoints(tiny) as served, connect(served.ws) as client:
        with trio.fail_after(120):
            inferlet = await client.launch(
                served.probe, {"probe": "files", "mode": "files", "model": "vl"}
            )
            await client.send_file(inferlet.instance, picture)
            with pytest.raises(MessageTooLarge, match="frame limit"):
                await client.send_file(inferlet.instance, huge)
            await inferlet.send_file(picture)
            await inferlet.send("bye")
            answers = [
                json.loads(event.text)
                async for event in inferlet.events()
                if isinstance(event, SessionMessage)
            ]
    assert answers == [{"tokens": 4 + 2, "grid": [1, 2, 2]}] * 2
    assert inferlet.outcome is not None and inferlet.outcome.result == "2"


def test_pie_submit_refuses_a_file_too_large_for_a_message_before_installing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program, huge = tmp_path / "probe.wasm", tmp_path / "huge.bin"
    program.write_bytes(b"\0asm")
    with huge.open("wb") as sparse:
        sparse.truncate(DEFAULT_MAX_FRAME)
    args = build_parser().parse_args(
        ["submit", str(program), "--file", str(huge), "--server", "ws://127.0.0.1:9"]
    )
    assert client_cli.run_submit(args) == 2
    assert f"{huge} is {DEFAULT_MAX_FRAME} bytes" in capsys.readouterr().err
