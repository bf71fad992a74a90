"""The wasm sandbox with hand-written WAT components (tests/wat): host functions, the
per-thread exception slot, the component cache, and the runner's limits."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from wasmtime import Engine, Store, WasmtimeError
from wasmtime.component import Component, Linker, Variant

from pie.sandbox import (
    ComponentCache,
    Err,
    GuestStopped,
    InvalidProgram,
    KillSwitch,
    Ok,
    RunOutcome,
    SandboxLimits,
    WasmRuntime,
    add_host_func,
    install_thread_safe_exceptions,
    record,
)
from pie.sandbox import cache as cache_module

WAT = Path(__file__).parent / "wat"


def wat(name: str) -> str:
    return (WAT / f"{name}.wat").read_text()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def host_types(engine: Engine) -> Component:
    return Component(engine, wat("host_types"))


def linker_of(engine: Engine, funcs: dict[str, Callable[..., Any]]) -> Linker:
    linker = Linker(engine)
    with linker.root() as root:
        for name, fn in funcs.items():
            add_host_func(root, name, fn)
    return linker


def instantiate(engine: Engine, component: Component, funcs: dict[str, Callable[..., Any]]) -> Any:
    """A call(name, *args) for one fresh instance whose imports are `funcs`."""
    return new_instance(linker_of(engine, funcs), component)


def new_instance(linker: Linker, component: Component) -> Any:
    store = Store(linker.engine)
    instance = linker.instantiate(store, component)

    def call(name: str, *args: Any) -> Any:
        func = instance.get_func(store, name)
        assert func is not None, name
        return func(store, *args)

    return call


def unused(*_: Any) -> Any:
    raise AssertionError("not called in this test")


HOST_TYPES_IMPORTS = (
    "count concat reverse scale blob move-point half check parse validate echo-payload "
    "echo-op model-info fail"
).split()


def host_types_linker(engine: Engine, **funcs: Callable[..., Any]) -> Linker:
    table = {name: unused for name in HOST_TYPES_IMPORTS}
    table.update({name.replace("_", "-"): fn for name, fn in funcs.items()})
    return linker_of(engine, table)


def host_types_call(engine: Engine, component: Component, **funcs: Callable[..., Any]) -> Any:
    return new_instance(host_types_linker(engine, **funcs), component)


# -- the per-thread exception slot -------------------------------------------------------------


class Mark(Exception):
    def __init__(self, owner: int) -> None:
        super().__init__(f"raised for caller {owner}")
        self.owner = owner


@pytest.mark.integration
@pytest.mark.parametrize("register", ["add_host_func", "wasmtime-py add_func"])
def test_each_thread_gets_the_exception_its_own_host_call_raised(
    engine: Engine, host_types: Component, register: str
) -> None:
    def raise_mark(x: int) -> int:
        raise Mark(x)

    threads, calls = 16, 250
    mixed_up: list[str] = []
    if register == "add_host_func":
        linker = host_types_linker(engine, count=raise_mark)
    else:
        linker = Linker(engine)
        with linker.root() as root:
            root.add_func("count", lambda _store, x: raise_mark(x))
        linker.define_unknown_imports_as_traps(host_types)

    def caller(owner: int) -> None:
        for _ in range(calls):
            try:
                # A trap leaves an instance unusable: one instance per call.
                new_instance(linker, host_types)("count", owner)
                mixed_up.append(f"{owner}: no exception")
            except Mark as mark:
                if mark.owner != owner:
                    mixed_up.append(f"{owner}: got {mark.owner}'s exception")
            except WasmtimeError as error:
                mixed_up.append(f"{owner}: bare trap {str(error)[:40]!r}")

    run_threads(caller, threads)
    assert mixed_up == [], f"{len(mixed_up)} of {threads * calls} calls: {mixed_up[:3]}"


@pytest.mark.integration
def test_core_module_host_exceptions_are_per_thread_too(engine: Engine) -> None:
    module = wasmtime.Module(
        engine,
        '(module (import "" "f" (func $f (param i32))) (func (export "g") (param i32)'
        " local.get 0 call $f))",
    )
    linker = wasmtime.Linker(engine)
    install_thread_safe_exceptions()

    def raise_mark(x: int) -> None:
        raise Mark(x)

    linker.define_func("", "f", wasmtime.FuncType([wasmtime.ValType.i32()], []), raise_mark)
    mixed_up: list[int] = []

    def caller(owner: int) -> None:
        for _ in range(250):
            store = Store(engine)
            g = linker.instantiate(store, module).exports(store)["g"]
            assert isinstance(g, wasmtime.Func)
            try:
                g(store, owner)
            except Mark as mark:
                if mark.owner != owner:
                    mixed_up.append(owner)
            except WasmtimeError:
                mixed_up.append(owner)

    run_threads(caller, 8)
    assert mixed_up == []


def run_threads(target: Callable[[int], None], count: int) -> None:
    """target(0) ... target(count - 1), each on a thread of its own."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


# -- host functions ----------------------------------------------------------------------------


@pytest.mark.integration
def test_numbers_and_strings_cross_both_ways(engine: Engine, host_types: Component) -> None:
    call = host_types_call(engine, host_types, count=lambda x: x + 1, concat=lambda a, n: a * n)
    assert call("count", 41) == 42
    assert call("concat", "ab€", 3) == "ab€ab€ab€"
    assert call("concat", "", 5) == ""


@pytest.mark.integration
@pytest.mark.parametrize("size", [0, 3, 1000])
def test_lists_cross_element_by_element_or_in_bulk(
    engine: Engine, host_types: Component, size: int
) -> None:
    call = host_types_call(
        engine,
        host_types,
        reverse=lambda xs: xs[::-1],
        scale=lambda xs, k: [x * k for x in xs],
        blob=lambda b: b[::-1],
    )
    numbers = list(range(size))
    assert call("reverse", numbers) == numbers[::-1]
    assert call("scale", [float(x) for x in numbers], 0.5) == [x * 0.5 for x in numbers]
    data = bytes(x % 256 for x in numbers)
    assert call("blob", data) == data[::-1]


@pytest.mark.integration
def test_bulk_lists_take_numpy_arrays_and_refuse_values_that_would_wrap(
    engine: Engine, host_types: Component
) -> None:
    import numpy as np

    answers: list[Any] = [np.arange(100, dtype=np.int64), [2**32] * 100]
    call = host_types_call(engine, host_types, reverse=lambda xs: answers.pop(0))
    assert call("reverse", [1]) == list(range(100))
    with pytest.raises(OverflowError):
        call("reverse", [1])


@pytest.mark.integration
def test_records_use_wit_field_names(engine: Engine, host_types: Component) -> None:
    seen: list[Any] = []

    def move_point(p: Any) -> Any:
        seen.append(p)
        return record(x=p.x + 1, label=p.label.upper())

    call = host_types_call(
        engine,
        host_types,
        move_point=move_point,
        model_info=lambda: record(name="tiny", vocab_size=49152),
    )
    moved = call("move-point", record(x=1, label="a"))
    assert (moved.x, moved.label) == (2, "A")
    gc.collect()  # the cached signature must not lean on C types freed after the first call
    moved = call("move-point", record(x=5, label="b"))
    assert (moved.x, moved.label) == (6, "B")
    assert (seen[0].x, seen[0].label) == (1, "a")
    info = call("model-info")
    assert (info.name, getattr(info, "vocab-size")) == ("tiny", 49152)


@pytest.mark.integration
def test_options_are_none_or_the_payload(engine: Engine, host_types: Component) -> None:
    call = host_types_call(engine, host_types, half=lambda x: None if x is None else x // 2)
    assert call("half", 8) == 4
    assert call("half", None) is None


@pytest.mark.integration
def test_results_take_ok_and_err_tagged_or_not(engine: Engine, host_types: Component) -> None:
    call = host_types_call(
        engine,
        host_types,
        check=lambda s: Ok(s) if s.isalpha() else Err(f"bad {s!r}"),
        parse=lambda s: Ok(int(s)) if s.isdigit() else Err(f"not a number: {s}"),
        validate=lambda x: Ok() if x < 10 else Err("too big"),
    )
    # result<string, string> is ambiguous, so wasmtime-py tags it; the others are not.
    assert call("check", "abc") == Variant("ok", "abc")
    assert call("check", "a1") == Variant("err", "bad 'a1'")
    assert call("parse", "12") == 12
    assert call("parse", "x") == "not a number: x"
    assert call("validate", 3) is None
    assert call("validate", 30) == "too big"


@pytest.mark.integration
def test_a_result_needs_ok_or_err(engine: Engine, host_types: Component) -> None:
    call = host_types_call(engine, host_types, parse=lambda s: 5)
    with pytest.raises(TypeError, match="Ok or Err"):
        call("parse", "5")


@pytest.mark.integration
def test_variants_are_tagged_only_when_ambiguous(engine: Engine, host_types: Component) -> None:
    call = host_types_call(engine, host_types, echo_payload=lambda p: p, echo_op=lambda o: o)
    assert call("echo-payload", "hi") == "hi"
    assert call("echo-payload", b"\x00\x01") == b"\x00\x01"
    for op in (Variant("stop"), Variant("top-k", 5), Variant("top-p", 0.5), Variant("keep", 7)):
        assert call("echo-op", op) == op


@pytest.mark.integration
def test_a_host_exception_traps_and_reaches_the_caller(
    engine: Engine, host_types: Component
) -> None:
    def fail() -> None:
        raise KeyError("no such thing")

    call = host_types_call(engine, host_types, fail=fail, count=lambda x: -1)
    with pytest.raises(KeyError, match="no such thing"):
        call("fail")
    call = host_types_call(engine, host_types, count=lambda x: -1)
    with pytest.raises(OverflowError, match="does not fit in u32"):
        call("count", 1)


@pytest.mark.integration
def test_one_host_function_serves_components_that_type_it_differently(engine: Engine) -> None:
    """The cached signature is checked against every value; another type re-reads it."""
    as_number = Component(engine, wat("host_loop"))
    as_text = Component(engine, wat("tick_text"))
    linker = Linker(engine)
    with linker.root() as root:
        add_host_func(root, "tick", lambda x: len(x) if isinstance(x, str) else x + 1)
    number_store, text_store = Store(engine), Store(engine)
    spin = linker.instantiate(number_store, as_number).get_func(number_store, "spin")
    measure = linker.instantiate(text_store, as_text).get_func(text_store, "measure")
    assert spin is not None and measure is not None
    for _ in range(3):
        assert spin(number_store, 5) == 5
        assert measure(text_store, "four") == 4


@pytest.mark.integration
def test_host_call_cost(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    component = Component(engine, wat("host_loop"))

    def per_call(register: Callable[[Any], None], calls: int = 10000) -> float:
        linker = Linker(engine)
        with linker.root() as root:
            register(root)
        store = Store(engine)
        spin = linker.instantiate(store, component).get_func(store, "spin")
        assert spin is not None
        spin(store, 100)
        started = time.perf_counter()
        assert spin(store, calls) == calls
        return (time.perf_counter() - started) / calls * 1e6

    cached = min(per_call(lambda r: add_host_func(r, "tick", lambda x: x + 1)) for _ in range(3))
    plain = min(per_call(lambda r: r.add_func("tick", lambda _s, x: x + 1)) for _ in range(3))
    with capsys.disabled():
        print(f"\nhost call: add_host_func {cached:.2f} µs, wasmtime-py add_func {plain:.2f} µs")
    assert cached < plain * 0.6


# -- the component cache -----------------------------------------------------------------------


@pytest.mark.integration
def test_a_second_cache_loads_from_disk_without_compiling(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = wat("host_loop").encode()
    digest, _ = ComponentCache(engine, tmp_path).load(source)
    assert len(list(tmp_path.glob(f"*/{digest}-*.cwasm"))) == 1

    def no_compile(*_: Any) -> Any:
        raise AssertionError("compiled again")

    monkeypatch.setattr(cache_module, "_compile", no_compile)
    started = time.perf_counter()
    again, component = ComponentCache(engine, tmp_path).load(source)
    assert time.perf_counter() - started < 0.1
    assert again == digest
    call = instantiate(engine, component, {"tick": lambda x: x + 2})
    assert call("spin", 3) == 6


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["garbage", "flipped byte", "truncated"])
def test_a_damaged_artifact_is_recompiled_and_rewritten(
    tmp_path: Path, engine: Engine, damage: str
) -> None:
    source = wat("host_loop").encode()
    ComponentCache(engine, tmp_path).load(source)
    [path] = tmp_path.glob("*/*.cwasm")
    data = bytearray(path.read_bytes())
    if damage == "garbage":
        data = bytearray(b"not an artifact")
    elif damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))

    _, component = ComponentCache(engine, tmp_path).load(source)
    call = instantiate(engine, component, {"tick": lambda x: x + 1})
    assert call("spin", 4) == 4
    [rewritten] = tmp_path.glob("*/*.cwasm")
    assert rewritten.read_bytes() != bytes(data)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("wasm", "message"),
    [
        (b"\0asm\x01\x00\x00\x00", "core WebAssembly module, not a component"),
        (b"\0asm\x0d\x00\x01\x00\x01", "not a valid WebAssembly component"),
        (b"hello", "neither a WebAssembly binary"),
    ],
)
def test_bytes_that_are_not_a_component_are_an_invalid_program(
    tmp_path: Path, engine: Engine, wasm: bytes, message: str
) -> None:
    with pytest.raises(InvalidProgram, match=message):
        ComponentCache(engine, tmp_path).load(wasm)


@pytest.mark.integration
def test_artifacts_of_another_wasmtime_are_never_read(tmp_path: Path, engine: Engine) -> None:
    cache = ComponentCache(engine, tmp_path)
    assert cache.directory.parent == tmp_path
    assert cache.directory.name.startswith(f"wasmtime-{wasmtime_version()}-")


def wasmtime_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("wasmtime")


# -- running guests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with WasmRuntime(tmp_path_factory.mktemp("wasm-cache")) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def guest(runtime: WasmRuntime) -> Component:
    return runtime.cache.load(wat("guest").encode())[1]


def run(
    runtime: WasmRuntime,
    guest: Component,
    input: str,
    *,
    block: Callable[[], None] = lambda: None,
    limits: SandboxLimits | None = None,
    kill: KillSwitch | None = None,
    output: list[tuple[str, bytes]] | None = None,
) -> RunOutcome:
    linker = runtime.new_linker()
    with linker.root() as root:
        add_host_func(root, "block", block)
    return runtime.run(
        guest,
        linker,
        input,
        limits=limits or SandboxLimits(),
        kill=kill or KillSwitch(),
        on_output=lambda stream, data: (output if output is not None else []).append(
            (stream, data)
        ),
    )


@pytest.mark.integration
def test_an_ok_result_returns_and_an_err_result_fails(
    runtime: WasmRuntime, guest: Component
) -> None:
    returned = run(runtime, guest, "ok, done")
    assert (returned.status, returned.value, returned.error) == ("returned", "ok, done", None)
    failed = run(runtime, guest, "err: no")
    assert (failed.status, failed.value) == ("failed", None)
    assert failed.error == "err: no"


@pytest.mark.integration
def test_a_trap_is_reported_with_its_cause(runtime: WasmRuntime, guest: Component) -> None:
    outcome = run(runtime, guest, "trap")
    assert outcome.status == "trapped"
    assert "unreachable" in (outcome.error or "")


@pytest.mark.integration
def test_a_host_exception_traps_the_guest(runtime: WasmRuntime, guest: Component) -> None:
    def block() -> None:
        raise ValueError("the host broke")

    outcome = run(runtime, guest, "host", block=block)
    assert outcome.status == "trapped"
    assert outcome.error == "a host function failed: ValueError: the host broke"


@pytest.mark.integration
def test_stdout_and_stderr_reach_on_output(
    runtime: WasmRuntime, guest: Component, tmp_path: Path
) -> None:
    output: list[tuple[str, bytes]] = []
    limits = SandboxLimits(scratch_dir=str(tmp_path))
    outcome = run(runtime, guest, "print me", output=output, limits=limits)
    assert outcome.status == "returned"
    assert sorted(output) == [("stderr", b"printed"), ("stdout", b"print me")]


@pytest.mark.integration
def test_an_endless_loop_stops_at_its_budget(runtime: WasmRuntime, guest: Component) -> None:
    outcome = run(runtime, guest, "loop", limits=SandboxLimits(budget_seconds=0.2))
    assert outcome.status == "timeout"
    assert outcome.error == "the program ran past its budget of 0.2 s"
    assert 0.2 <= outcome.seconds < 1.0


@pytest.mark.integration
def test_the_kill_switch_stops_one_guest_and_spares_another(
    runtime: WasmRuntime, guest: Component
) -> None:
    kill = KillSwitch()
    outcomes: dict[str, RunOutcome] = {}

    def looping() -> None:
        outcomes["looping"] = run(runtime, guest, "loop", kill=kill)

    def counting() -> None:
        outcomes["counting"] = run(runtime, guest, "count")

    threads = [threading.Thread(target=looping), threading.Thread(target=counting)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while runtime.statistics().running < 2:  # the guest threads report nothing to wait on
        assert time.monotonic() < deadline, "the two guests never ran at once"
        time.sleep(0.005)
    kill.kill("the client went away")
    for thread in threads:
        thread.join(timeout=10)
    assert runtime.statistics().running == 0
    assert (outcomes["looping"].status, outcomes["looping"].error) == (
        "killed",
        "the client went away",
    )
    assert outcomes["counting"].status == "returned"


@pytest.mark.integration
def test_a_guest_blocked_in_the_host_is_woken_by_the_kill_switch(
    runtime: WasmRuntime, guest: Component
) -> None:
    kill = KillSwitch()
    blocked, woken = threading.Event(), threading.Event()
    kill.add_waker(woken.set)

    def block() -> None:
        blocked.set()
        woken.wait(timeout=10)
        raise GuestStopped("killed", "woken up")

    def kill_once_blocked() -> None:
        blocked.wait(timeout=10)
        kill.kill("stop now")

    threading.Thread(target=kill_once_blocked).start()
    outcome = run(runtime, guest, "host", block=block, kill=kill)
    assert (outcome.status, outcome.error) == ("killed", "stop now")
    assert outcome.seconds < 5


@pytest.mark.integration
def test_the_budget_wakes_a_guest_blocked_in_the_host(
    runtime: WasmRuntime, guest: Component
) -> None:
    kill = KillSwitch()
    woken = threading.Event()
    kill.add_waker(woken.set)

    def block() -> None:
        woken.wait(timeout=10)
        raise GuestStopped("killed", "woken up")

    outcome = run(
        runtime, guest, "host", block=block, kill=kill, limits=SandboxLimits(budget_seconds=0.2)
    )
    assert outcome.status == "timeout"
    assert outcome.seconds < 5


@pytest.mark.integration
def test_memory_growth_past_the_cap_is_a_memory_outcome(
    runtime: WasmRuntime, guest: Component
) -> None:
    output: list[tuple[str, bytes]] = []
    outcome = run(
        runtime, guest, "more memory", limits=SandboxLimits(memory_bytes=1 << 20), output=output
    )
    assert outcome.status == "memory"
    assert (outcome.error or "").startswith("the program ran out of memory (cap 1 MiB)")
    assert output == [("stderr", b"memory allocation of 65536 bytes failed\n")]


@pytest.mark.integration
def test_a_cap_below_the_guests_first_memory_fails_at_start(
    runtime: WasmRuntime, guest: Component
) -> None:
    outcome = run(runtime, guest, "ok", limits=SandboxLimits(memory_bytes=1000))
    assert outcome.status == "memory"
    assert "exceeds memory limits" in (outcome.error or "")


@pytest.mark.integration
def test_a_component_without_run_fails_to_start(runtime: WasmRuntime) -> None:
    _, component = runtime.cache.load(wat("host_loop").encode())
    linker = runtime.new_linker()
    with linker.root() as root:
        add_host_func(root, "tick", lambda x: x)
    outcome = runtime.run(
        component, linker, "", limits=SandboxLimits(), kill=KillSwitch(), on_output=unused
    )
    assert outcome.status == "failed"
    assert (
        outcome.error
        == "the program could not start: ValueError: the program exports no `run` function"
    )


@pytest.mark.integration
def test_a_missing_import_fails_to_start(runtime: WasmRuntime, guest: Component) -> None:
    outcome = runtime.run(
        guest,
        runtime.new_linker(),
        "ok",
        limits=SandboxLimits(),
        kill=KillSwitch(),
        on_output=unused,
    )
    assert outcome.status == "failed"
    assert "block" in (outcome.error or "")


@pytest.mark.integration
def test_run_needs_a_started_runtime(tmp_path: Path, guest: Component) -> None:
    idle = WasmRuntime(tmp_path)
    with pytest.raises(RuntimeError, match="start"):
        idle.run(
            guest,
            idle.new_linker(),
            "",
            limits=SandboxLimits(),
            kill=KillSwitch(),
            on_output=unused,
        )


# -- the kill switch ---------------------------------------------------------------------------


@pytest.mark.unit
def test_the_first_kill_wins_and_wakers_run_once() -> None:
    kill = KillSwitch()
    woken: list[str] = []
    kill.add_waker(lambda: woken.append("early"))
    removed = lambda: woken.append("removed")  # noqa: E731
    kill.add_waker(removed)
    kill.remove_waker(removed)
    assert kill.kill("first") is True
    assert kill.kill("second", "timeout") is False
    kill.add_waker(lambda: woken.append("late"))
    assert (kill.killed, kill.reason, kill.status) == (True, "first", "killed")
    assert woken == ["early", "late"]
