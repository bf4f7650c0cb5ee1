"""The figures of "Serving is a memory problem" follow from its own inputs (and a wrong input would show)."""

import numpy as np

from lifeofprompt.lessons import article_arithmetic as article


def test_every_figure_of_the_article_follows_from_its_inputs():
    rows = article.checks()
    assert len(rows) == 19
    differ = [row for row in rows if not row.agrees]
    # one of the article's figures is itself imprecise: its p99 of 60 is not the second slowest sample
    assert [row.claim for row in differ] == [next(r.claim for r in rows if r.claim.startswith("p99 of 60"))], "\n".join(
        row.line() for row in differ
    )
    assert "DIFFERS" in differ[0].line() and "58.4" in differ[0].line()


def test_p99_of_60_is_interpolated_between_the_two_slowest():
    low, high, frac = article.p99_position(60)
    assert (low, high) == (58, 59) and abs(frac - 0.41) < 1e-9
    values = np.arange(60.0)  # sorted samples 0..59: the percentile is the index itself
    assert np.percentile(values, 99) == low + frac


def test_a_wrong_input_is_caught(monkeypatch):
    monkeypatch.setattr(article, "READ_BANDWIDTH", 300e9)
    floor = next(row for row in article.checks() if row.claim.startswith("decode floor"))
    assert not floor.agrees and "DIFFERS" in floor.line()


def test_select_picks_by_claim_and_refuses_nothing():
    from lifeofprompt.lessons.article_arithmetic import report, select

    assert [c.claim for c in select("decode floor (ms)")] == ["decode floor (ms)"]
    assert len(select("p99", "TPOT")) == 2
    assert report("p99").endswith("DIFFERS") and report("TPOT").endswith("agrees")
    import pytest

    with pytest.raises(KeyError):
        select("no such claim")
