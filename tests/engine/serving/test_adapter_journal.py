"""The journal of adapters loaded at run time survives a restart, in load order."""
from engine.serving.adapter_journal import COMPACT_SLACK, AdapterJournal


def test_loads_and_unloads_survive_a_new_instance(tmp_path):
    j = AdapterJournal(tmp_path / "state" / "adapters.json")
    j.loaded("a", "/p/a", False)
    j.loaded("b", "/p/b", True)
    j.loaded("c", "/p/c", False)
    j.unloaded("b")
    j.loaded("a", "/p/a2", True)            # reloaded with new weights: moves last
    again = AdapterJournal(tmp_path / "state" / "adapters.json")
    assert list(again.entries.values()) == [{"name": "c", "path": "/p/c", "pinned": False},
                                            {"name": "a", "path": "/p/a2", "pinned": True}]
    again.unloaded("missing")               # no-op
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["adapters.json"]   # no temporary files left


def test_a_damaged_file_starts_empty(tmp_path):
    f = tmp_path / "adapters.json"
    f.write_text("{not json")
    assert AdapterJournal(f).entries == {}
    f.write_text('{"adapters": [{"name": 3}, {"name": "ok", "path": "/x"}]}')
    assert list(AdapterJournal(f).entries.values()) == [{"name": "ok", "path": "/x", "pinned": False}]


def test_a_call_appends_one_line_and_a_torn_last_line_is_skipped(tmp_path):
    f = tmp_path / "adapters.json"
    j = AdapterJournal(f)
    for i in range(50):
        j.loaded(f"t{i}", f"/p/{i}", False)
    before = f.read_text()
    j.unloaded("t7")
    assert f.read_text().startswith(before) and f.read_text().count("\n") == 51     # appended, not rewritten
    with open(f, "a") as out:
        out.write('{"load": {"name": "cut", "pa')                                  # a crash mid-write
    again = AdapterJournal(f)
    assert len(again.entries) == 49 and "t7" not in again.entries and "cut" not in again.entries
    again.loaded("after", "/p/after", False)               # the compacted file takes new lines cleanly
    assert list(AdapterJournal(f).entries)[-1] == "after"


def test_churn_keeps_the_file_bounded(tmp_path):
    f = tmp_path / "adapters.json"
    j = AdapterJournal(f)
    j.loaded("keep", "/p/keep", True)
    for i in range(3000):
        j.loaded("churn", f"/p/{i}", False)
        j.unloaded("churn")
    lines = f.read_text().count("\n")
    assert lines <= 2 + COMPACT_SLACK + 2
    assert list(AdapterJournal(f).entries.values()) == [{"name": "keep", "path": "/p/keep", "pinned": True}]
