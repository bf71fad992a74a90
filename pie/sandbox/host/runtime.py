"""The `runtime` interface: who and where the inferlet is, and child inferlets."""

from __future__ import annotations

from wasmtime.component import LinkerInstance

from pie.events import inferlet as ev
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/runtime@0.1.0"


def version() -> str:
    return current().version


def instance_id() -> str:
    return current().instance


def user() -> str:
    return current().user


def launch(program: str, input: str) -> int:
    state = current()
    event = ev.LaunchInferlet(
        corr=state.next_corr(),
        requester=state.address,
        program=program,
        input=input,
        user=state.user,
    )
    return state.launch_child(event)


def wait(child: int) -> int:
    return current().wait_child(child)


def child_result(pending: int) -> str:
    end = current().take(pending, "child")
    match end:
        case ev.InferletReturned():
            return end.result
        case ev.InferletFailed():
            raise HostFailure("failed", f"{end.status}: {end.error}")
        case ev.InferletTerminated():
            raise HostFailure("failed", f"terminated: {end.reason}")
    raise AssertionError(f"unexpected child end {end!r}")


def terminate(child: int) -> None:
    state = current()
    instance = state.child_instance(child)
    event = ev.TerminateInferlet(corr=state.next_corr(), requester=state.address, instance=instance)
    try:
        state.request("inferlets", event)
    except HostFailure as failure:
        # A child that has already ended is as stopped as it can be.
        if failure.kind != "no-such-inferlet":
            raise


def detach(child: int) -> None:
    state = current()
    instance = state.child_instance(child)
    state.request(
        "inferlets",
        ev.DetachInferlet(corr=state.next_corr(), requester=state.address, instance=instance),
    )


def register(instance: LinkerInstance) -> None:
    for plain in (version, instance_id, user):
        add_host_func(instance, plain.__name__.replace("_", "-"), plain)
    for fallible in (launch, wait, child_result, terminate, detach):
        add_host_func(instance, fallible.__name__.replace("_", "-"), host_call(fallible))
