"""Sizes a user or a file controls, bounded before allocation (edgekit/limits.py), with the
cases that passed 6 GB or waited for hours: --batch, a sparse 6 GiB tokenizer.json, text
files, sweep grids and --jobs. The memory available is set small here (never allocated)."""
from __future__ import annotations

import os
import re
import resource
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from edgekit import limits
from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.limits import MAX_DIM, available_memory, check_file_size, format_bytes, require_disk, require_memory


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture
def small_memory(monkeypatch: pytest.MonkeyPatch) -> int:
    """This machine, as edgekit sees it, has 64 MiB available."""
    monkeypatch.setattr(limits, "available_memory", lambda: 64 * 2**20)
    return 64 * 2**20


def test_available_memory_reads_the_system_and_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    got = available_memory()
    assert got is not None and 0 < got <= total
    monkeypatch.setattr(limits, "_cgroup_room", lambda: 123 * 2**20)  # a container's limit is lower
    assert available_memory() == 123 * 2**20
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (2**40, hard) if which == resource.RLIMIT_AS
                        else (soft, hard))
    assert limits._address_space_room() is not None and limits._address_space_room() < 2**40


def test_require_memory_names_the_need_and_the_limit(small_memory: int) -> None:
    require_memory(16 * 2**20, "a small buffer")  # a quarter of 64 MiB fits
    with pytest.raises(BadInputError, match=r"^a batch of 3 samples needs 20 MiB; edgekit lets it take at most a "
                                            r"quarter of the 64 MiB of memory available here; lower --batch$"):
        require_memory(20 * 2**20, "a batch of 3 samples", "lower --batch")


def test_require_disk_checks_the_nearest_existing_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_disk(tmp_path / "a" / "b", 1, "the output")
    monkeypatch.setattr(limits.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(BadInputError, match=rf"^cannot write {tmp_path}/a/b: the output needs about 1.95 KiB and "
                                            rf"{tmp_path} has 1000 B free; free some space or choose another folder$"):
        require_disk(tmp_path / "a" / "b", 2000, "the output")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 * 2**20, 6.5 * 2**30, 2**41)] == [
        "0 B", "1023 B", "1 KiB", "5 MiB", "6.5 GiB", "2 TiB"]


def test_a_sparse_file_counts_at_its_size_and_is_never_read(tmp_path: Path, small_memory: int) -> None:
    big = tmp_path / "tokenizer.json"
    with open(big, "wb") as f:
        f.truncate(6 * 2**30)  # 6 GiB, sparse: no disk, and nothing reads it
    with pytest.raises(BadInputError, match=r"tokenizer file .*tokenizer.json is 6 GiB; edgekit reads at most 128 MiB"):
        check_file_size(big, 128 * 2**20, "tokenizer file")
    small = tmp_path / "vocab.txt"
    with open(small, "wb") as f:
        f.truncate(10 * 2**20)
    with pytest.raises(BadInputError, match=r"reading tokenizer file .*vocab.txt \(10 MiB\) needs 80 MiB; edgekit "
                                            r"lets it take at most half of the 64 MiB"):
        check_file_size(small, 128 * 2**20, "tokenizer file", expansion=8)


@pytest.mark.parametrize("size, message", [
    (6 * 2**30, "tokenizer.json is 6 GiB; edgekit reads at most 128 MiB"),
    (20 * 2**20, r"reading tokenizer file .*tokenizer.json \(20 MiB\) needs 160 MiB"),
])
def test_export_refuses_a_huge_tokenizer_before_reading_it(tmp_path: Path, small_memory: int, size: int,
                                                           message: str) -> None:
    """A 6 GiB sparse tokenizer.json took `export` past 8.9 GB before anything was refused."""
    from tiny_models import save_tiny

    folder = save_tiny("llama", tmp_path)
    with open(folder / "tokenizer.json", "r+b") as f:
        f.truncate(size)
    r = CliRunner().invoke(cli, ["export", str(folder), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "tokenizer file" in one_line(r.stderr)
    assert re.search(message, r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


def test_text_files_are_bounded_by_memory(tmp_path: Path, small_memory: int) -> None:
    from edgekit.sources.data import _read_text_file

    text = tmp_path / "corpus.txt"
    with open(text, "wb") as f:
        f.truncate(5 * 2**20)
    with pytest.raises(BadInputError, match=r"reading text file .*corpus.txt \(5 MiB\) needs 40 MiB"):
        _read_text_file(text)


@pytest.mark.parametrize("args", [
    ["build", "TINY", "-o", "OUT", "--batch", "1500000"],
    ["build", "TINY", "-o", "OUT", "--batch", "1000000000"],
    ["profile", "OUT", "--batch", "1000000000"],
    ["profile", "OUT", "--batch", "1500000"],
    ["estimate", "TINY", "--target", "cpu", "--batch", "1500000"],
])
def test_batch_is_bounded_like_a_dimension(tmp_path: Path, tiny_onnx: Path, args: list[str]) -> None:
    """`build --batch 1500000` and `profile --batch 1000000000` passed 6 GB (or a traceback:
    "Unable to allocate 5.70 TiB") while --shapes was capped at 2^20 per dimension."""
    out = tmp_path / "engine"
    r = CliRunner().invoke(cli, [a.replace("TINY", str(tiny_onnx)).replace("OUT", str(out)) for a in args])
    assert r.exit_code == 2, r.output
    value = args[args.index("--batch") + 1]
    assert one_line(r.stderr) == (f"error: Invalid value for '--batch': {value} is not in the range "
                                  f"1<=x<={MAX_DIM}.")
    assert not out.exists()


def test_a_batch_is_bounded_by_the_memory_before_it_is_allocated(tmp_path: Path, tiny_onnx: Path,
                                                                 small_memory: int) -> None:
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "-o", str(tmp_path / "e"), "--batch", "100000"])
    assert r.exit_code == 2, r.output
    assert one_line(r.stderr) == ("error: a batch of 100000 sample inputs of tiny needs 293 MiB; edgekit lets it "
                                  "take at most a quarter of the 64 MiB of memory available here; lower --batch or "
                                  "--shapes")
    assert not (tmp_path / "e").exists()


def test_profile_batch_is_bounded_by_the_memory(tmp_path: Path, tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tmp_path / "e"
    assert CliRunner().invoke(cli, ["build", str(tiny_onnx), "-o", str(engine)]).exit_code == 0
    monkeypatch.setattr(limits, "available_memory", lambda: 64 * 2**20)
    r = CliRunner().invoke(cli, ["profile", str(engine), "--batch", "100000", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 2, r.output
    assert one_line(r.stderr) == ("error: a batch of 100000 sample inputs needs 293 MiB; edgekit lets it take at "
                                  "most a quarter of the 64 MiB of memory available here; lower --batch")
    assert not (tmp_path / "p.json").exists()


def test_an_unforeseen_memory_error_is_one_line(tmp_path: Path, tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's "Unable to allocate 5.70 TiB ..." and ONNX Runtime's allocation failure were
    tracebacks; whatever allocation no limit foresaw fails in one line, exit 2."""
    from edgekit.onnx_checks import allocation_failures

    with pytest.raises(MemoryError, match=r"^ONNX Runtime: .*Failed to allocate memory for requested buffer"):
        with allocation_failures():
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
                               "running Conv node. Name:'conv' Status Message: Failed to allocate memory for "
                               "requested buffer of size 6291456000")
    import edgekit.build as build

    def huge(*a: object, **k: object) -> None:
        raise MemoryError("Unable to allocate 5.70 TiB for an array with shape (1000000000, 3, 16, 16)")

    monkeypatch.setattr(build, "_save_inputs", huge)
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "-o", str(tmp_path / "e")])
    assert r.exit_code == 2, r.output
    assert one_line(r.stderr) == ("error: out of memory: Unable to allocate 5.70 TiB for an array with shape "
                                  "(1000000000, 3, 16, 16)")
    assert sorted(os.listdir(tmp_path)) == []


def _sweep_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "target": "cpu", "stages": [
        {"name": "m", "model": "fmnist-cnn", "steps": [{"prune": {"ratio": 0.5}}]}]}))
    return path


def test_a_sweep_says_its_size_at_once_and_refuses_a_huge_grid(tmp_path: Path) -> None:
    """A 1000 x 1000 grid was silent for over 300 s (about 50 ms of validation per point:
    14 hours before anything ran)."""
    recipe = _sweep_recipe(tmp_path)
    values = ",".join(str(round(0.001 * i, 3)) for i in range(1, 1001))
    rounds = ",".join(str(i) for i in range(1, 1001))
    r = CliRunner().invoke(cli, ["sweep", str(recipe), "--grid", f"prune.ratio={values}", "--grid",
                                 f"prune.round_to={rounds}", "-o", str(tmp_path / "sw")])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["sweep: 1000000 points (1000 prune.ratio x 1000 prune.round_to)",
                     "error: the sweep has 1000000 points (1000 prune.ratio x 1000 prune.round_to), more than "
                     "--max-points 256; narrow the grid or raise --max-points"]
    assert not (tmp_path / "sw").exists()


def test_jobs_are_bounded_by_cores_and_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--jobs 100000` was accepted."""
    recipe = _sweep_recipe(tmp_path)
    r = CliRunner().invoke(cli, ["sweep", str(recipe), "--grid", "prune.ratio=0.5", "--jobs", "100000",
                                 "-o", str(tmp_path / "sw")])
    assert r.exit_code == 2, r.output
    cores = os.cpu_count()
    assert one_line(r.stderr) == (f"error: --jobs 100000 is more than this machine's {cores} cores; at most {cores} "
                                  "(each job compresses, builds and times models)")
    from edgekit.pipelines.sweep import check_jobs

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(limits, "available_memory", lambda: 3 * 2**30)
    with pytest.raises(BadInputError, match=r"^--jobs 8 \(1 GiB per sweep process\) needs 8 GiB; edgekit lets it take "
                                            r"at most all of the 3 GiB of memory available here; lower --jobs$"):
        check_jobs(8)
    check_jobs(2)
    assert not (tmp_path / "sw").exists()
