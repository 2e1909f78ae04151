"""The home page's status table is the one ``verify.status`` generates from the repository
(regenerate it with ``python -m verify.status --write``)."""

from __future__ import annotations

from verify import status


def test_home_page_status_table_is_current():
    page = status.INDEX.read_text()
    assert page == status.render(page), (
        "docs/index.md's status table is stale: run `python -m verify.status --write`")


def test_the_table_lists_every_stage_and_what_exists():
    rows = {r[0]: r for r in status.rows()}
    assert list(rows) == list(status.PLACES)
    assert rows["finalize"][1] == "`reference.finalize`" and rows["finalize"][2] == "`fast.finalize`"
    assert rows["dep"][2] == "not built" or (status.ROOT / "fast/schedules/dep.py").is_file()
    assert "reference" in rows["finalize"][3] and "fast" in rows["finalize"][3]
