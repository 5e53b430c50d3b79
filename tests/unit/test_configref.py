"""The configuration reference page is rendered from TrainConfig and kept current."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from sparktrain import configref
from sparktrain.config import TrainConfig, _dotted
from sparktrain.errors import SparkTrainError

ROOT = Path(__file__).resolve().parents[2]


def test_docstring_entries_group_names_and_unwrap_descriptions():
    doc = """Summary.

    Parameters
    ----------
    a, b_c:
        First line with ``code`` and
        :mod:`some.module`.
    d:
        One.

    Notes
    -----
    ignored:
        not a parameter
    """
    assert configref.docstring_entries(doc) == [
        (["a", "b_c"], "First line with `code` and `some.module`."),
        (["d"], "One."),
    ]
    with pytest.raises(SparkTrainError, match="no 'Parameters' section"):
        configref.docstring_entries("Nothing here.")


def test_page_lists_every_key_with_its_default_and_every_docstring_entry():
    page = configref.render()
    for f in fields(TrainConfig):
        assert f"| `{_dotted(f.name)}` |" in page
    assert '| `strategy` | `str` | `"ring"` |' in page
    assert "| `overlap` | `bool` | `true` |" in page
    assert "| `compression` | `str \\| dict[str, str]` |" in page  # the | stays in its cell
    assert "## `link`, `link.bandwidth_mbit`" in page
    assert "## `ps_mode`, `staleness`, `ps_shards`, `staleness_lr`" in page


def test_check_fails_when_stale_and_passes_after_regeneration(tmp_path: Path, capsys):
    page = tmp_path / "configuration.md"
    assert configref.main(["--page", str(page), "--check"]) == 1  # missing
    page.write_text("old\n")
    assert configref.main(["--page", str(page), "--check"]) == 1
    assert configref.main(["--page", str(page)]) == 0
    assert configref.main(["--page", str(page), "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_the_repository_page_is_current():
    assert (ROOT / configref.DEFAULT_PAGE).read_text() == configref.render()
