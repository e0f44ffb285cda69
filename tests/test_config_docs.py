"""The docs' tables of config keys are the code's: every key has its meaning on its dataclass field, and
each table in README.md, docs/vllm.md, docs/sglang.md and docs/remote.md is what ``scripts/config_docs.py``
writes from the fields (run it after changing a key). Also the generated-block machinery both generators
share (``scripts/doc_blocks.py``)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import pytest

from scripts import config_docs
from scripts.doc_blocks import BlockError, fill, sync
from tiered_kv.values.config_keys import config_key, key_rows, markdown_table, undocumented


def test_every_config_key_has_a_meaning():
    assert config_docs.missing_docs() == {}


def test_the_docs_tables_are_the_code(capsys):
    assert config_docs.main(["--check"]) == 0, capsys.readouterr().out


def test_a_table_that_differs_from_the_code_is_found(tmp_path):
    for rel in config_docs.TABLES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(config_docs.ROOT / rel, tmp_path / rel)
    vllm_md = tmp_path / "docs/vllm.md"
    text = vllm_md.read_text()
    assert "| `chunk_blocks` | int | `16` |" in text
    vllm_md.write_text(text.replace("| `chunk_blocks` | int | `16` |", "| `chunk_blocks` | int | `32` |"))
    diffs = sync(config_docs.wanted(tmp_path), config_docs.PREFIX, check=True)
    assert len(diffs) == 1 and "chunk_blocks" in diffs[0] and "docs/vllm.md" in diffs[0]
    assert "`32`" in vllm_md.read_text()  # check mode writes nothing
    assert sync(config_docs.wanted(tmp_path), config_docs.PREFIX) and not sync(
        config_docs.wanted(tmp_path), config_docs.PREFIX, check=True)


@dataclass(frozen=True)
class _Cfg:
    size: int = config_key(3 << 20, "how big", "bytes")
    budget: int | str = config_key("auto", "per step, or `auto`", "bytes")
    name: str = config_key("", "a | name")
    where: str | None = config_key(None, "a path")
    tags: dict = config_key({}, "more parts")
    plain: int = 4
    internal: dict = field(default_factory=dict)


def test_rows_show_type_default_and_unit_as_a_user_writes_them():
    rows = {r.key: r for r in key_rows(_Cfg, ["size", "budget", "name", "where", "tags"])}
    assert rows["`size`"][1:4] == ("size", "`3MiB`", "bytes")
    assert rows["`budget`"].type == "size or `auto`" and rows["`budget`"].default == "`auto`"
    assert rows["`name`"].default == '`""`' and rows["`where`"][1:3] == ("string or null", "`null`")
    assert rows["`tags`"][1:3] == ("mapping", "`{}`") and _Cfg().tags == {} and _Cfg().tags is not _Cfg().tags
    assert "a \\| name" in markdown_table(_Cfg, ["name"])  # a pipe in a meaning does not split the row


def test_a_key_without_a_meaning_is_refused():
    assert undocumented(_Cfg) == ["plain", "internal"] and undocumented(_Cfg, ["size"]) == []
    with pytest.raises(ValueError, match="plain"):
        key_rows(_Cfg)
    with pytest.raises(ValueError, match="meaning"):
        config_key(1, " ")


def test_blocks_are_refilled_and_prose_is_left_alone():
    text = ("intro\n<!-- generated:t:a note for readers -->\nold\n<!-- /generated:t:a -->\nmiddle\n"
            "<!-- generated:other -->\nkept\n<!-- /generated:other -->\n")
    out = fill(text, {"t:a": "new"}, prefix="t:")
    assert out == text.replace("old\n", "new\n")
    with pytest.raises(BlockError, match="no generator writes"):
        fill(text, {}, prefix="t:")
    with pytest.raises(BlockError, match="no <!-- generated:NAME --> marker"):
        fill(text, {"t:a": "x", "t:b": "y"}, prefix="t:")
    with pytest.raises(BlockError, match="no matching"):
        fill("<!-- generated:t:a -->\nx\n", {"t:a": "x"}, prefix="t:")
