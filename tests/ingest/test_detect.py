"""Telling run records apart by content (commsim.ingest.detect): commsim's own traces are
recognised whatever their name, pickles of anything but plain values are refused without
being built, and files of no known kind are named in one line."""

import os
import pickle
from collections import OrderedDict

import pytest

from commsim.api import Scenario, predict
from commsim.ingest.detect import Format, detect, read_plain_pickle
from commsim.ingest.load import load_collectives, load_trace
from commsim.ir.errors import CommsimInputError


@pytest.fixture(scope="module")
def trace():
    return predict(Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16)).trace()


def test_a_commsim_trace_is_known_by_its_content_not_its_name(trace, tmp_path):
    path = tmp_path / "rank7.pt.trace"  # a name that says something else
    trace.save(path)
    found = detect(path)
    assert found.format is Format.COMMSIM_TRACE and [r.path for r in found.records] == [path]
    assert load_trace(path) == trace
    gz = tmp_path / "whatever.bin.gz"
    trace.save(gz)
    assert load_trace(gz) == trace


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch boom-was-run",))


def test_pickles_of_objects_are_refused_unbuilt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_plain_pickle(pickle.dumps({"entries": [{"a": (1, 2.5, None, True, {3})}]}), "x") == \
        {"entries": [{"a": (1, 2.5, None, True, {3})}]}
    for obj, named in ((_Boom(), "posix.system"), (OrderedDict(a=1), "collections.OrderedDict")):
        with pytest.raises(CommsimInputError, match=f"not plain Python values \\(holds a {named} object\\)"):
            read_plain_pickle(pickle.dumps(obj), "x")
    assert not (tmp_path / "boom-was-run").exists()
    with pytest.raises(CommsimInputError, match="a damaged pickle"):
        read_plain_pickle(pickle.dumps({"entries": []})[:-3], "x")


def test_unknown_files_and_folders_are_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here\n")
    (tmp_path / "data.json").write_text('{"a": 1}')
    for path, words in ((tmp_path / "notes.txt", "not a file commsim reads"),
                        (tmp_path / "data.json", "not a file commsim reads"),
                        (tmp_path, "holds no file commsim reads"),
                        (tmp_path / "missing", "no such file or folder")):
        with pytest.raises(CommsimInputError, match=words) as e:
            detect(path)
        assert "\n" not in str(e.value)


def test_a_folder_of_commsim_traces_is_one_kind(trace, tmp_path):
    trace.save(tmp_path / "a.json")
    trace.save(tmp_path / "b.json")
    (tmp_path / "README").write_text("not a record\n")  # left aside
    found = detect(tmp_path)
    assert found.format is Format.COMMSIM_TRACE and len(found.records) == 2
    with pytest.raises(CommsimInputError, match="a folder of 2 commsim traces; give one trace file"):
        load_trace(tmp_path)
    assert load_collectives(tmp_path / "a.json", 0).records == trace.records  # (symmetric: rank 0 only)
    with pytest.raises(CommsimInputError, match="no records of rank 1 \\(it holds rank\\(s\\) 0\\)"):
        load_collectives(tmp_path / "a.json", 1)
