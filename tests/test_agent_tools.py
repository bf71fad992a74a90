"""The agent examples' pure parts, run on the host without a model: the CodeACT executor (output
captured, one namespace across steps, tracebacks from the model's code down) and the
function-calling tools (a call checked against the tool's parameters, every mistake a ToolError)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[1] / "sdk" / "examples"


def load(folder: str, name: str) -> ModuleType:
    """sdk/examples/<folder>/<name>.py as a module (the folder names are not identifiers)."""
    spec = importlib.util.spec_from_file_location(
        f"{folder.replace('-', '_')}_{name}", EXAMPLES / folder / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up by name while the module runs.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


executor = load("codeact", "executor")
tools = load("function-calling", "tools")


def test_a_later_step_sees_the_variables_of_an_earlier_one() -> None:
    runner = executor.Executor()
    first = runner.run("answer = 6 * 7\n", "<step 1>")
    second = runner.run("print(answer)\nimport sys\nprint('warned', file=sys.stderr)\n", "<step 2>")
    assert (first.output, first.failed) == ("", False)
    assert (second.output, second.failed) == ("42\nwarned\n", False)


def test_an_exception_keeps_what_was_printed_and_quotes_the_models_lines() -> None:
    runner = executor.Executor()
    result = runner.run("print('before')\ndef half(x):\n    return x / 0\nhalf(1)\n", "<step 3>")
    assert result.failed
    lines = result.output.splitlines()
    assert lines[:2] == ["before", "Traceback (most recent call last):"]
    assert '  File "<step 3>", line 4, in <module>' in lines
    assert "    return x / 0" in lines
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert "executor.py" not in result.output


def test_a_syntax_error_and_an_exit_are_reported_not_raised() -> None:
    runner = executor.Executor()
    broken = runner.run("print(1\n", "<step 1>")
    exited = runner.run("raise SystemExit(3)\n", "<step 2>")
    assert (
        broken.failed and "SyntaxError" in broken.output and '"<step 1>", line 1' in broken.output
    )
    assert exited.failed and exited.output.endswith("SystemExit: 3\n")


def test_long_output_is_cut() -> None:
    result = executor.Executor(max_output_chars=10).run("print('x' * 100)\n", "<step 1>")
    assert result.output == "x" * 10 + "\n... (output cut)\n"


def test_a_well_formed_call_is_parsed_and_runs() -> None:
    box = tools.toolbox("2025-01-02 03:04:05 UTC")
    tool, arguments = tools.parse_call('{"name": "add", "arguments": {"a": 2, "b": 0.5}}', box)
    assert (tool.name, tool.run(**arguments)) == ("add", 2.5)
    clock, none = tools.parse_call('{"name": "clock"}', box)
    assert clock.run(**none) == "2025-01-02 03:04:05 UTC"
    lookup, country = tools.parse_call('{"name": "lookup", "arguments": {"country": "Peru"}}', box)
    assert lookup.run(**country) == "Lima"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "add", "arguments": {"a": 1,}}', "the tool call is not valid JSON"),
        ('["add", 1, 2]', 'a tool call is {"name": <tool name>'),
        (
            '{"name": "fly", "arguments": {}}',
            "unknown tool 'fly'; the tools are add, clock, lookup",
        ),
        ('{"name": "add", "arguments": [1, 2]}', "the arguments must be a JSON object"),
        ('{"name": "add", "arguments": {"a": 1, "c": 2}}', "add takes ['a', 'b']; missing ['b']"),
        ('{"name": "add", "arguments": {"a": 1, "b": "2"}}', 'add: b must be a number, not "2"'),
        ('{"name": "add", "arguments": {"a": true, "b": 2}}', "add: a must be a number, not true"),
    ],
)
def test_a_bad_call_raises_a_tool_error_that_says_why(body: str, message: str) -> None:
    with pytest.raises(tools.ToolError) as raised:
        tools.parse_call(body, tools.toolbox(None))
    assert str(raised.value).startswith(message)


def test_a_failing_tool_raises_a_tool_error() -> None:
    lookup = tools.toolbox(None)["lookup"]
    with pytest.raises(tools.ToolError, match="no capital known for 'Atlantis'"):
        lookup.run(country="Atlantis")
