"""edgekit's own folders (paths.py): the cache from $EDGEKIT_CACHE or ~/.cache/edgekit, the staging
journal inside it, and whether the journal holds an entry (nothing is created by asking)."""
from __future__ import annotations

from pathlib import Path

from edgekit.paths import cache_path, has_journal_entries, staging_journal_path


def test_cache_and_journal_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "c"))
    assert cache_path() == tmp_path / "c" and staging_journal_path() == tmp_path / "c" / "staging"
    assert not has_journal_entries() and not (tmp_path / "c").exists()  # asking creates nothing
    (tmp_path / "c" / "staging").mkdir(parents=True)
    assert not has_journal_entries()
    (tmp_path / "c" / "staging" / "1234.json").write_text("{}")
    assert has_journal_entries()
    monkeypatch.setenv("EDGEKIT_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == Path(tmp_path / "home" / ".cache" / "edgekit")
