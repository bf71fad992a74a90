"""The inferlet actor's pure core (admission queue and lifecycle) and the program registry."""

from __future__ import annotations

import pytest

from pie.actors.inferlet import InferletCore, ProgramError, ProgramRegistry
from pie.actors.inferlet.admission import AdmissionLimits
from pie.actors.inferlet.core import InferletStatistics
from pie.actors.inferlet.programs import NameTaken
from pie.events import inferlet as ev
from pie.events.kv import Done, RequestFailed

pytestmark = pytest.mark.unit

WASM = b"\0asm\x0d\x00\x01\x00"


def core_with_program(max_concurrent: int = 2, **limits: int) -> tuple[InferletCore, str]:
    programs = ProgramRegistry()
    info = programs.add(WASM, name="demo", version="1.0")
    admission = AdmissionLimits(max_concurrent=max_concurrent, **limits)
    return InferletCore(programs, admission), info.hash


def launch(
    core: InferletCore, corr: int, who: str = "client:1", program: str = "demo", user: str = "local"
) -> str:
    out = core.handle(
        ev.LaunchInferlet(corr=corr, requester=who, program=program, input="{}", user=user)
    )
    launched = out[0][1]
    assert isinstance(launched, ev.InferletLaunched)
    return launched.instance


def finish(core: InferletCore, instance: str, status: str = "returned", **fields: object) -> list:
    return core.handle(ev.InferletFinished(instance=instance, status=status, **fields))


class TestRegistry:
    def test_finds_programs_by_hash_name_and_version(self) -> None:
        programs = ProgramRegistry()
        first = programs.add(WASM, name="demo", version="1.0")
        second = programs.add(WASM + b"\x01", name="demo", version="2.0")
        assert programs.resolve(first.hash).info == first
        assert programs.resolve("demo").info == second
        assert programs.resolve("demo@1.0").info == first

    def test_refuses_what_is_not_wasm_and_bad_names(self) -> None:
        programs = ProgramRegistry()
        with pytest.raises(ProgramError, match="not a WebAssembly binary"):
            programs.add(b"hello")
        with pytest.raises(ProgramError, match="bad program name"):
            programs.add(WASM, name="../etc")
        with pytest.raises(ProgramError, match="no program 'missing'"):
            programs.resolve("missing")

    def test_names_live_in_each_users_namespace_then_the_shared_one(self) -> None:
        programs = ProgramRegistry()
        shared = programs.add(WASM, name="tool", version="1.0")
        mine = programs.add(WASM + b"\x01", name="tool", version="1.0", owner="alice")
        assert programs.resolve("tool@1.0", "alice").info == mine
        assert programs.resolve("tool@1.0", "bob").info == shared
        assert programs.resolve("tool@1.0").info == shared
        assert programs.resolve(mine.hash, "bob").info.name == f"program-{mine.hash[:12]}"

    def test_a_bound_name_is_never_rebound_to_other_bytes(self) -> None:
        programs = ProgramRegistry()
        first = programs.add(WASM, name="tool", version="1.0", owner="alice")
        with pytest.raises(NameTaken, match="new version"):
            programs.add(WASM + b"\x01", name="tool", version="1.0", owner="alice")
        assert programs.add(WASM, name="tool", version="1.0", owner="alice") == first
        assert programs.resolve("tool", "alice").info == first

    def test_a_program_without_a_name_is_named_by_its_hash(self) -> None:
        info = ProgramRegistry().add(WASM)
        assert info.name == f"program-{info.hash[:12]}" and info.version == "0.1.0"


class TestAdmission:
    def test_unknown_program_is_refused(self) -> None:
        core, _ = core_with_program()
        out = core.handle(ev.LaunchInferlet(corr=7, requester="c", program="nope", input=""))
        assert out == [
            ("c", RequestFailed(corr=7, kind="no_such_program", message=out[0][1].message))
        ]

    def test_instances_beyond_the_limit_wait_their_turn(self) -> None:
        core, _ = core_with_program(max_concurrent=2)
        ids = [launch(core, corr) for corr in (1, 2, 3)]
        assert [i.id for i in core.to_start] == ids[:2]
        assert core.statistics().queued == 1 and core.statistics().running == 2
        core.to_start.clear()
        out = finish(core, ids[0], result="done", seconds=0.5)
        assert ("client:1", ev.InferletReturned(instance=ids[0], result="done", seconds=0.5)) in out
        assert [i.id for i in core.to_start] == [ids[2]]
        assert (
            "client:1",
            ev.InferletStarted(instance=ids[2], program=core.instances[ids[2]].program.hash),
        ) in out

    def test_an_unknown_program_is_named_in_the_refusal(self) -> None:
        core, _ = core_with_program()
        [(_, failed)] = core.handle(
            ev.LaunchInferlet(corr=7, requester="c", program="nope", input="")
        )
        assert "'nope'" in failed.message

    def test_instances_are_numbered_in_launch_order(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        assert [launch(core, corr) for corr in (1, 2, 3)] == ["i1", "i2", "i3"]

    def test_a_started_instance_carries_what_its_launcher_gave(self) -> None:
        core, program = core_with_program()
        request = ev.IncomingRequest(method="GET", path="/", query="", headers=(), body=b"")
        out = core.handle(
            ev.LaunchInferlet(
                corr=5, requester="c", program="demo", input="{}", user="ann", request=request
            )
        )
        assert out[0] == ("c", ev.InferletLaunched(corr=5, instance="i1", queued=False))
        [started] = core.to_start
        assert (started.launcher, started.user, started.input) == ("c", "ann", "{}")
        assert started.request == request and started.program.hash == program

    def test_launch_reply_says_whether_it_was_queued(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        first = core.handle(ev.LaunchInferlet(corr=1, requester="c", program="demo", input=""))
        second = core.handle(ev.LaunchInferlet(corr=2, requester="c", program="demo", input=""))
        assert first[0][1].queued is False and second[0][1].queued is True

    def test_ends_carry_the_instance_its_reason_and_its_time(self) -> None:
        core, _ = core_with_program(max_concurrent=6)
        finishes: list[tuple[str, dict[str, str], type, dict[str, str]]] = [
            ("returned", {"result": "42"}, ev.InferletReturned, {"result": "42"}),
            ("returned", {}, ev.InferletReturned, {"result": ""}),
            ("killed", {"error": "by hand"}, ev.InferletTerminated, {"reason": "by hand"}),
            ("killed", {}, ev.InferletTerminated, {"reason": "killed"}),
            ("trapped", {"error": "oob"}, ev.InferletFailed, {"status": "trapped", "error": "oob"}),
            ("memory", {}, ev.InferletFailed, {"status": "memory", "error": "memory"}),
        ]
        for corr, (status, fields, kind, expected) in enumerate(finishes, start=1):
            instance = launch(core, corr)
            out = finish(core, instance, status=status, seconds=1.5, **fields)
            assert out == [("client:1", kind(instance=instance, seconds=1.5, **expected))]

    def test_statistics_count_launches_and_each_kind_of_end(self) -> None:
        core, _ = core_with_program(max_concurrent=2)
        ids = [launch(core, corr) for corr in range(1, 6)]
        core.handle(ev.TerminateInferlet(corr=9, requester="client:1", instance=ids[4]))
        finish(core, ids[0])
        finish(core, ids[1], status="failed", error="boom")
        finish(core, ids[2], status="killed")
        assert core.statistics() == InferletStatistics(
            queued=0, running=1, launched=5, returned=1, failed=1, terminated=2, programs=1
        )

    @pytest.mark.parametrize(
        ("status", "kind"),
        [
            ("failed", ev.InferletFailed),
            ("trapped", ev.InferletFailed),
            ("timeout", ev.InferletFailed),
            ("memory", ev.InferletFailed),
            ("killed", ev.InferletTerminated),
        ],
    )
    def test_every_end_is_reported_to_the_launcher(self, status: str, kind: type) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        out = finish(core, instance, status=status, error="why")
        assert [type(e) for dst, e in out if dst == "client:1"] == [kind]
        assert instance not in core.instances


class TestTerminate:
    def test_a_queued_instance_ends_at_once(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        launch(core, 1)
        queued = launch(core, 2)
        out = core.handle(ev.TerminateInferlet(corr=3, requester="client:1", instance=queued))
        assert out[0] == ("client:1", Done(corr=3))
        assert isinstance(out[1][1], ev.InferletTerminated) and core.statistics().queued == 0

    def test_a_queued_instance_ends_as_terminated_by_the_requester(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        launch(core, 1)
        queued = launch(core, 2)
        out = core.handle(ev.TerminateInferlet(corr=3, requester="client:1", instance=queued))
        assert out[1] == (
            "client:1",
            ev.InferletTerminated(instance=queued, reason="terminated by client:1", seconds=0.0),
        )

    def test_a_running_instance_is_killed_by_the_shell(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        core.handle(ev.TerminateInferlet(corr=2, requester="client:1", instance=instance))
        assert core.to_kill == [(instance, "terminated by client:1")]

    def test_only_the_launcher_may_terminate_or_send(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        out = core.handle(ev.TerminateInferlet(corr=2, requester="client:2", instance=instance))
        assert out[0][1].kind == "not_owner" and out[0][1].corr == 2
        out = core.handle(
            ev.SendToInferlet(corr=3, requester="client:2", instance=instance, text="x")
        )
        assert out[0][1].kind == "not_owner"
        out = core.handle(ev.TerminateInferlet(corr=4, requester="client:1", instance="i99"))
        assert out[0][1].kind == "no_such_inferlet"

    def test_refusals_carry_the_corr_and_name_the_instance(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        commands = [
            ev.TerminateInferlet(corr=2, requester="client:2", instance=instance),
            ev.DetachInferlet(corr=3, requester="client:2", instance=instance),
            ev.SendToInferlet(corr=4, requester="client:2", instance=instance, text="x"),
            ev.DetachInferlet(corr=5, requester="client:1", instance="i99"),
        ]
        for command in commands:
            [(dst, failed)] = core.handle(command)
            assert dst == command.requester and isinstance(failed, RequestFailed)
            assert failed.corr == command.corr and command.instance in failed.message


def send(core: InferletCore, instance: str, corr: int, text: str, who: str = "client:1") -> list:
    return core.handle(ev.SendToInferlet(corr=corr, requester=who, instance=instance, text=text))


def send_refused(out: list, kind: str) -> str:
    [(_, failed)] = out
    assert isinstance(failed, RequestFailed) and failed.kind == kind, failed
    return failed.message


class TestSessionBounds:
    def test_messages_past_an_inferlets_count_are_refused_until_it_receives(self) -> None:
        core, _ = core_with_program(max_session_messages=2)
        instance = launch(core, 1)
        assert send(core, instance, 2, "a")[0] == ("client:1", Done(corr=2))
        assert send(core, instance, 3, "b")[0] == ("client:1", Done(corr=3))
        message = send_refused(send(core, instance, 4, "c"), "overrun")
        assert "2 messages" in message and "max_session_messages" in message
        assert core.handle(ev.SessionReceived(instance=instance, size=1)) == []
        assert send(core, instance, 5, "c")[0] == ("client:1", Done(corr=5))
        assert core.statistics().session_bytes == 2

    def test_bytes_past_an_inferlets_bound_are_refused_and_a_queued_inbox_counts(self) -> None:
        core, _ = core_with_program(max_concurrent=1, max_session_bytes=10)
        launch(core, 1)
        queued = launch(core, 2)
        assert send(core, queued, 3, "ü" * 4)[0] == ("client:1", Done(corr=3))  # 8 bytes
        message = send_refused(send(core, queued, 4, "xyz"), "overrun")
        assert "8 bytes" in message and "max_session_mb" in message
        assert send(core, queued, 5, "xy")[0] == ("client:1", Done(corr=5))

    def test_a_users_inferlets_share_a_bound_and_an_end_gives_its_share_back(self) -> None:
        core, _ = core_with_program(max_user_session_bytes=10)
        first = launch(core, 1, user="alice")
        second = launch(core, 2, user="alice")
        other = launch(core, 3, who="client:2", user="bob")
        assert send(core, first, 4, "x" * 6)[0] == ("client:1", Done(corr=4))
        message = send_refused(send(core, second, 5, "x" * 6), "quota")
        assert "alice" in message and "max_user_session_mb" in message
        assert send(core, other, 6, "x" * 6, who="client:2")[0] == ("client:2", Done(corr=6))
        finish(core, first)
        assert send(core, second, 7, "x" * 6)[0] == ("client:1", Done(corr=7))
        assert core.statistics().session_bytes == 12

    def test_a_receipt_for_an_ended_inferlet_changes_nothing(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        send(core, instance, 2, "abc")
        finish(core, instance)
        assert core.handle(ev.SessionReceived(instance=instance, size=3)) == []
        assert core.statistics().session_bytes == 0


class TestSessionsAndChildren:
    def test_messages_to_a_queued_instance_arrive_when_it_starts(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        first = launch(core, 1)
        queued = launch(core, 2)
        core.handle(ev.SendToInferlet(corr=3, requester="client:1", instance=queued, text="hi"))
        out = finish(core, first)
        assert (f"inferlet:{queued}", ev.SessionInput(instance=queued, text="hi")) in out

    def test_a_message_to_a_running_instance_goes_straight_to_it(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        send = ev.SendToInferlet(corr=2, requester="client:1", instance=instance, data=b"\x00")
        assert core.handle(send) == [
            ("client:1", Done(corr=2)),
            (f"inferlet:{instance}", ev.SessionInput(instance=instance, data=b"\x00")),
        ]

    def test_guest_output_goes_to_the_launcher(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        output = ev.InferletOutput(instance=instance, stream="stdout", text="hello\n")
        assert core.handle(output) == [("client:1", output)]

    def test_output_of_an_instance_that_has_ended_is_dropped(self) -> None:
        core, _ = core_with_program()
        instance = launch(core, 1)
        finish(core, instance)
        late = ev.InferletOutput(instance=instance, stream="stdout", text="late\n")
        assert core.handle(late) == []

    def test_children_end_with_their_parent(self) -> None:
        core, _ = core_with_program(max_concurrent=2)
        parent = launch(core, 1)
        running = launch(core, 2, who=f"inferlet:{parent}")
        queued = launch(core, 3, who=f"inferlet:{parent}")
        out = finish(core, parent, status="failed", error="boom")
        assert (running, f"its parent {parent} ended") in core.to_kill
        ended = [e for dst, e in out if dst == f"inferlet:{parent}"]
        assert ended == [
            ev.InferletTerminated(instance=queued, reason=f"its parent {parent} ended", seconds=0.0)
        ]

    def test_a_detached_child_is_not_stopped_with_its_parent(self) -> None:
        core, _ = core_with_program(max_concurrent=3)
        parent = launch(core, 1)
        kept = launch(core, 2, who=f"inferlet:{parent}")
        dropped = launch(core, 3, who=f"inferlet:{parent}")
        reply = core.handle(
            ev.DetachInferlet(corr=4, requester=f"inferlet:{parent}", instance=kept)
        )
        assert reply == [(f"inferlet:{parent}", Done(corr=4))]
        finish(core, parent)
        assert [who for who, _ in core.to_kill] == [dropped]
        assert core.instances[kept].state == "running"

    def test_only_the_launcher_may_detach(self) -> None:
        core, _ = core_with_program()
        parent = launch(core, 1)
        child = launch(core, 2, who=f"inferlet:{parent}")
        out = core.handle(ev.DetachInferlet(corr=3, requester="client:9", instance=child))
        assert out[0][1].kind == "not_owner" and not core.instances[child].detached

    def test_stop_all_ends_queued_and_kills_running(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        running = launch(core, 1)
        launch(core, 2)
        core.stop_all("shutdown")
        assert core.to_kill == [(running, "shutdown")] and core.statistics().queued == 0


def refused(core: InferletCore, corr: int, who: str = "client:1", user: str = "local") -> str:
    """The message of a launch refused for being over a limit."""
    launched = ev.LaunchInferlet(corr=corr, requester=who, program="demo", input="", user=user)
    [(dst, failed)] = core.handle(launched)
    assert dst == who and isinstance(failed, RequestFailed) and failed.corr == corr
    assert failed.kind == "too_many_inferlets"
    return failed.message


class TestLimits:
    def test_a_user_over_its_instance_limit_is_refused_and_others_are_not(self) -> None:
        core, _ = core_with_program(max_concurrent=1, max_per_user=2)
        first = launch(core, 1, user="ann")
        launch(core, 2, user="ann")
        assert "max_inferlets_per_user" in refused(core, 3, user="ann")
        launch(core, 4, user="bob")
        assert core.statistics().refused == 1 and core.statistics().queued == 2
        finish(core, first)
        launch(core, 5, user="ann")

    def test_queued_instances_count_towards_the_user_limit(self) -> None:
        core, _ = core_with_program(max_concurrent=1, max_per_user=2)
        launch(core, 1)
        queued = launch(core, 2)
        refused(core, 3)
        core.handle(ev.TerminateInferlet(corr=4, requester="client:1", instance=queued))
        launch(core, 5)

    def test_a_parent_over_its_children_limit_is_refused(self) -> None:
        core, _ = core_with_program(max_concurrent=1, max_children=2)
        parent = f"inferlet:{launch(core, 1)}"
        first = launch(core, 2, who=parent)
        launch(core, 3, who=parent)
        assert "max_children" in refused(core, 4, who=parent)
        launch(core, 5)
        core.handle(ev.TerminateInferlet(corr=6, requester=parent, instance=first))
        launch(core, 7, who=parent)

    def test_a_detached_child_still_counts_while_its_parent_lives(self) -> None:
        core, _ = core_with_program(max_children=1)
        parent = f"inferlet:{launch(core, 1)}"
        child = launch(core, 2, who=parent)
        core.handle(ev.DetachInferlet(corr=3, requester=parent, instance=child))
        refused(core, 4, who=parent)

    def test_children_may_go_only_so_deep(self) -> None:
        core, _ = core_with_program(max_concurrent=8, max_depth=2)
        top = launch(core, 1)
        child = launch(core, 2, who=f"inferlet:{top}")
        grandchild = launch(core, 3, who=f"inferlet:{child}")
        assert [core.instances[i].depth for i in (top, child, grandchild)] == [0, 1, 2]
        message = refused(core, 4, who=f"inferlet:{grandchild}")
        assert "max_child_depth" in message and grandchild in message
        launch(core, 5, who=f"inferlet:{child}")

    def test_no_children_at_depth_zero(self) -> None:
        core, _ = core_with_program(max_depth=0)
        refused(core, 2, who=f"inferlet:{launch(core, 1)}")

    def test_a_client_is_not_a_parent_whatever_its_name(self) -> None:
        core, _ = core_with_program(max_concurrent=8, max_depth=0, max_children=1)
        launch(core, 1, who="client:1")
        launch(core, 2, who="client:1")
        launch(core, 3, who="inferlet:gone")

    def test_zero_means_no_limit_for_users_and_children(self) -> None:
        core, _ = core_with_program(max_concurrent=1, max_per_user=0, max_children=0)
        parent = f"inferlet:{launch(core, 1)}"
        for corr in range(2, 40):
            launch(core, corr, who=parent)

    def test_admission_keeps_within_the_memory_budget(self) -> None:
        core, _ = core_with_program(max_concurrent=8, memory_cap=100, memory_budget=200)
        ids = [launch(core, corr) for corr in (1, 2, 3)]
        assert [i.id for i in core.to_start] == ids[:2]
        assert core.statistics().queued == 1
        finish(core, ids[0])
        assert [i.id for i in core.to_start] == ids

    def test_the_memory_budget_says_queued_at_launch(self) -> None:
        core, _ = core_with_program(max_concurrent=8, memory_cap=100, memory_budget=100)
        first = core.handle(ev.LaunchInferlet(corr=1, requester="c", program="demo", input=""))
        second = core.handle(ev.LaunchInferlet(corr=2, requester="c", program="demo", input=""))
        assert first[0][1].queued is False and second[0][1].queued is True

    def test_a_stopping_instance_still_holds_its_memory(self) -> None:
        core, _ = core_with_program(max_concurrent=8, memory_cap=100, memory_budget=100)
        first = launch(core, 1)
        second = launch(core, 2)
        core.handle(ev.TerminateInferlet(corr=3, requester="client:1", instance=first))
        assert core.instances[second].state == "queued"
        finish(core, first, status="killed")
        assert core.instances[second].state == "running"

    def test_no_memory_budget_admits_up_to_max_concurrent(self) -> None:
        core, _ = core_with_program(max_concurrent=3, memory_cap=100, memory_budget=0)
        for corr in (1, 2, 3, 4):
            launch(core, corr)
        assert core.statistics().running == 3


def started(core: InferletCore) -> list[str]:
    """The instances admitted since the last call, in order."""
    ids = [instance.id for instance in core.to_start]
    core.to_start.clear()
    return ids


class TestFairAdmission:
    def test_a_freed_slot_goes_to_the_user_with_the_fewest_running(self) -> None:
        core, _ = core_with_program(max_concurrent=2)
        hog = [launch(core, corr, user="hog") for corr in (1, 2, 3, 4)]
        good = launch(core, 5, user="good")
        started(core)
        finish(core, hog[0])
        assert started(core) == [good]
        finish(core, hog[1])
        assert started(core) == [hog[2]]

    def test_users_with_as_many_running_take_turns(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        first = launch(core, 1, user="ann")
        ann = [launch(core, corr, user="ann") for corr in (2, 3)]
        bob = [launch(core, corr, user="bob") for corr in (4, 5)]
        started(core)
        order, running = [], first
        for _ in range(4):
            finish(core, running)
            [running] = started(core)
            order.append(running)
        assert order == [ann[0], bob[0], ann[1], bob[1]]

    def test_one_users_instances_start_in_launch_order(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        ids = [launch(core, corr, user="ann") for corr in (1, 2, 3)]
        started(core)
        finish(core, ids[0])
        assert started(core) == [ids[1]]

    def test_a_user_at_its_running_bound_waits_while_others_start(self) -> None:
        core, _ = core_with_program(max_concurrent=4, max_running_per_user=2)
        hog = [launch(core, corr, user="hog") for corr in (1, 2, 3)]
        assert core.statistics().running == 2 and core.instances[hog[2]].state == "queued"
        good = core.handle(ev.LaunchInferlet(corr=4, requester="c", program="demo", input=""))
        assert good[0][1].queued is False
        assert started(core) == [*hog[:2], good[0][1].instance]
        finish(core, hog[0])
        assert started(core) == [hog[2]]

    def test_the_launch_reply_says_queued_for_a_user_at_its_bound(self) -> None:
        core, _ = core_with_program(max_concurrent=4, max_running_per_user=1)
        first = core.handle(ev.LaunchInferlet(corr=1, requester="c", program="demo", input=""))
        second = core.handle(ev.LaunchInferlet(corr=2, requester="c", program="demo", input=""))
        assert first[0][1].queued is False and second[0][1].queued is True

    def test_a_stopping_instance_still_counts_against_its_user(self) -> None:
        core, _ = core_with_program(max_concurrent=4, max_running_per_user=1)
        first = launch(core, 1)
        second = launch(core, 2)
        core.handle(ev.TerminateInferlet(corr=3, requester="client:1", instance=first))
        assert core.instances[second].state == "queued"
        finish(core, first, status="killed")
        assert core.instances[second].state == "running"

    def test_a_queued_instance_that_ends_frees_none_of_its_users_running_share(self) -> None:
        core, _ = core_with_program(max_concurrent=4, max_running_per_user=1)
        launch(core, 1)
        queued = launch(core, 2)
        core.handle(ev.TerminateInferlet(corr=3, requester="client:1", instance=queued))
        assert core.handle(ev.LaunchInferlet(corr=4, requester="c", program="demo", input=""))[0][
            1
        ].queued

    def test_with_no_running_bound_one_user_fills_every_slot(self) -> None:
        core, _ = core_with_program(max_concurrent=3)
        for corr in (1, 2, 3, 4):
            launch(core, corr)
        assert core.statistics().running == 3 and core.statistics().queued == 1

    def test_the_queue_counts_every_users_waiting_instances(self) -> None:
        core, _ = core_with_program(max_concurrent=1)
        launch(core, 1, user="ann")
        waiting = [launch(core, 2, user="ann"), launch(core, 3, user="bob")]
        assert core.statistics().queued == 2
        core.handle(ev.TerminateInferlet(corr=4, requester="client:1", instance=waiting[1]))
        core.handle(ev.TerminateInferlet(corr=5, requester="client:1", instance=waiting[0]))
        assert core.statistics().queued == 0 and len(core.queue) == 0


def test_an_unknown_event_is_refused_by_name() -> None:
    core, _ = core_with_program()
    with pytest.raises(TypeError, match="unexpected event object"):
        core.handle(object())
