"""The journal of adapters loaded at run time survives a restart, in load order."""
from engine.serving.adapter_journal import AdapterJournal


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
