"""dynamo-once overhead: results land in --out (default: the current directory), never in the source tree."""

import os
import pathlib

import pytest

from models.cli import main

SOURCE_TREE = pathlib.Path(__file__).resolve().parents[2]


def _result_files(root: pathlib.Path) -> set[pathlib.Path]:
    return {p for p in root.rglob("guard_overhead_cpu.*") if ".venv" not in p.parts}


def test_overhead_writes_into_the_current_directory(tmp_path, monkeypatch, capsys):
    before = {p: p.stat().st_mtime for p in _result_files(SOURCE_TREE)}
    monkeypatch.chdir(tmp_path)
    assert main(["overhead", "--layers", "1", "--calls", "5", "--repeats", "1"]) == 0
    assert "dynamo-once fast" in capsys.readouterr().out  # the table is printed
    for ext in ("md", "csv"):
        assert (tmp_path / f"guard_overhead_cpu.{ext}").stat().st_size > 0
    after = {p: p.stat().st_mtime for p in _result_files(SOURCE_TREE)}
    assert after == before  # nothing written (or rewritten) in the checkout


def test_overhead_out_argument(tmp_path):
    out = tmp_path / "results"
    assert main(["overhead", "--layers", "1", "--calls", "5", "--repeats", "1", "--out", str(out)]) == 0
    assert sorted(p.suffix for p in out.iterdir() if p.suffix in (".md", ".csv")) == [".csv", ".md"]


@pytest.mark.parametrize("argv, message", [
    (["--layers", "1,x"], "--layers: expected comma-separated integers"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
])
def test_overhead_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["overhead", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert os.path.exists(SOURCE_TREE / "models" / "overhead.py")
