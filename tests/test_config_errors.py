"""A bad config file is told in one line that names the file, the table and the key: an unknown
key with the closest known one and the table's keys, an unknown table, a value of the wrong type
with the type expected, and a value a check refuses; the same words through the Python API
(ConfigError) and through `pie serve --config FILE` (exit code 2, before anything loads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie.cli import main
from pie.config import ConfigError, EngineConfig, config_from_dict, load_config, with_overrides

KV_KEYS = (
    "known keys: page_size, num_pages, memory_mb, memory_fraction, dtype, prefix_cache, "
    "inferlet_page_share, user_page_share, snapshot_page_share, snapshots_dir"
)
TABLES = (
    "known tables: model, driver, kv, scheduler, event_log, bus, sandbox, network, mcp, "
    "server, http, grammar, media, dashboard, tracing, metrics, cluster, models"
)
BAD_FILES = {
    "unknown key": (
        "[kv]\nnum_page = 3\n",
        f"[kv] has no key 'num_page'; did you mean 'num_pages'? {KV_KEYS}",
    ),
    "unknown table": (
        "[kvv]\nnum_pages = 3\n",
        f"there is no table [kvv]; did you mean [kv]? {TABLES}",
    ),
    "wrong type": ('[kv]\nnum_pages = "many"\n', "[kv] num_pages: expected an integer, got 'many'"),
    "bad value": ("[kv]\npage_size = -16\n", "[kv] page_size must be >= 1, got -16"),
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pie.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.unit
@pytest.mark.parametrize("case", BAD_FILES)
def test_the_python_api_names_the_file_the_table_and_the_key(tmp_path: Path, case: str) -> None:
    text, words = BAD_FILES[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"{path}: {words}"


@pytest.mark.integration
@pytest.mark.parametrize("case", BAD_FILES)
def test_pie_serve_says_it_in_one_line_and_exits_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text, words = BAD_FILES[case]
    path = write(tmp_path, text)
    # No model exists there: the config is refused before anything would load.
    code = main(["serve", "--config", str(path), "--model", str(tmp_path / "no-model")])
    told = capsys.readouterr()
    assert code == 2 and told.out == ""
    assert told.err == f"pie: {path}: {words}\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (
            {"port": 80},
            "there is no table [port]; 'port' is a key of [server], [http] and [metrics]; ",
        ),
        ({"server": {"auth": "maybe"}}, "[server] auth must be one of auto, on, off, got 'maybe'"),
        ({"kv": {"memory_fraction": "half"}}, "[kv] memory_fraction: expected a number, got"),
        ({"event_log": {"enabled": "yes"}}, "[event_log] enabled: expected true or false, got"),
        ({"network": {"allow": "example.com"}}, "[network] allow: expected a list, got"),
        ({"model": {"adapters": {"a": 3}}}, "[model] adapters.a: expected a string, got 3"),
        ({"driver": {"graph_batch_sizes": ["x"]}}, "[driver] graph_batch_sizes[0]: expected an"),
        ({"kv": 3}, "[kv] must be a table"),
        ({"models": [{"path": "x", "nme": "a"}]}, "[[models]] entry 1 has no key 'nme'; did you"),
        (
            {"mcp": {"servers": [{"command": ["x"]}]}},
            "[[mcp.servers]] entry 1 needs the key 'name'",
        ),
        ({"server": {"port": 70000}}, "[server] port must be <= 65535, got 70000"),
    ],
)
def test_each_kind_of_mistake_is_told_where_it_is(data: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict(data)
    assert str(refused.value).startswith(words), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.unit
def test_a_models_entry_with_a_mistake_is_told_once() -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"models": [{"path": "x", "nme": "a"}]})
    assert str(refused.value).count("'nme'") == 1


@pytest.mark.unit
def test_several_mistakes_are_told_together_on_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"kv": {"num_page": 3}, "server": {"port": "x"}})
    told = str(refused.value)
    assert "[kv] has no key 'num_page'" in told and "[server] port: expected an integer" in told
    assert "\n" not in told


@pytest.mark.unit
def test_a_flag_the_checks_refuse_names_its_table() -> None:
    with pytest.raises(ConfigError, match=r"^\[server\] port must be <= 65535, got 99999$"):
        with_overrides(EngineConfig(), server={"port": 99999})
