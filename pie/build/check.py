"""The checks `pie build` makes before compiling: the folder, main.py, its syntax, and the entry
function that picks the world (`async def main` or `async def handle`)."""

from __future__ import annotations

import ast
from pathlib import Path

WORLDS = {
    "main": ("inferlet", "inferlet._entry"),
    "handle": ("http-inferlet", "inferlet._http_entry"),
}
"""The function main.py defines -> the world it is built for and the module that exports it."""


class BuildError(Exception):
    """The folder is not a buildable inferlet, or componentize-py failed; the message says why."""


def check_inferlet(folder: Path) -> str:
    """The checks that need no compiler: the folder, main.py, syntax, and `async def main` (or
    `async def handle`). Returns the entry function's name."""
    if not folder.is_dir():
        raise BuildError(f"{folder}: no such folder")
    main = folder / "main.py"
    if not main.is_file():
        raise BuildError(f"{folder}: no main.py (an inferlet is a folder with main.py in it)")
    trees = {path: _parse(path) for path in sorted(folder.rglob("*.py"))}
    return _check_entry(main, trees[main])


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as err:
        where = f"{err.filename}:{err.lineno}" + (f":{err.offset}" if err.offset else "")
        raise BuildError(f"{where}: syntax error: {err.msg}") from None
    except UnicodeDecodeError as err:
        raise BuildError(f"{path}: not UTF-8 text ({err.reason})") from None


def _check_entry(path: Path, tree: ast.Module) -> str:
    found = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in WORLDS
    }
    if not found:
        raise BuildError(
            f"{path}: no `main` function (write `async def main(input): ...`, or"
            " `async def handle(request): ...` for an HTTP-served inferlet)"
        )
    if len(found) > 1:
        raise BuildError(f"{path}: define `main` or `handle`, not both")
    name, node = found.popitem()
    if not isinstance(node, ast.AsyncFunctionDef):
        signature = "main(input)" if name == "main" else "handle(request)"
        raise BuildError(
            f"{path}:{node.lineno}: `{name}` must be `async def {signature}`, not a plain `def`"
        )
    return name
