"""Atomic outputs: nothing half-written, and the mode an ordinary write would give."""

import os
import stat

import pytest

from commsim.util.files import atomic_write_text, output_folder_problem, output_problem


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


def test_new_files_honour_the_umask(tmp_path, umask):
    umask(0o022)
    atomic_write_text(tmp_path / "a.json", "{}")
    assert mode(tmp_path / "a.json") == 0o644  # was 0600: mkstemp's mode renamed into place
    umask(0o077)
    atomic_write_text(tmp_path / "b.json", "{}")
    assert mode(tmp_path / "b.json") == 0o600
    umask(0o002)
    atomic_write_text(tmp_path / "c.json", "{}")
    assert mode(tmp_path / "c.json") == 0o664


def test_a_rewritten_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    p = tmp_path / "a.json"
    p.write_text("old")
    p.chmod(0o640)
    atomic_write_text(p, "new")
    assert (p.read_text(), mode(p)) == ("new", 0o640)


def test_cli_outputs_honour_the_umask(tmp_path, umask):
    from commsim.cli import main

    umask(0o022)
    assert main(["schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2",
                 "--seq", "16", "-o", str(tmp_path / "s.json")]) == 0
    assert mode(tmp_path / "s.json") == 0o644


def test_output_problems(tmp_path):
    assert output_problem(tmp_path / "x.json") is None
    assert output_problem(tmp_path) == "is a folder; give a file name"
    assert output_problem(tmp_path / "no" / "x.json") == f"folder {tmp_path / 'no'} does not exist"
    (tmp_path / "f").write_text("")
    assert output_problem(tmp_path / "f" / "x.json") == f"{tmp_path / 'f'} is not a folder"
    assert output_folder_problem(tmp_path / "new") is None
    assert output_folder_problem(tmp_path) is None
    assert output_folder_problem(tmp_path / "f") == "exists and is not a folder"
    assert output_folder_problem(tmp_path / "no" / "new") == f"folder {tmp_path / 'no'} does not exist"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
