"""CheckResult rules, the runner (an exception is a FAIL, never a traceback), exit codes and JSON."""

from __future__ import annotations

import json

import pytest

from mcp2026.doctor.report import exit_code, summary_line, to_json, to_table
from mcp2026.doctor.result import Check, CheckResult, Status, failed, passed, run_checks, skipped, warned


def test_fix_is_empty_on_pass_and_required_on_warn_and_fail():
    with pytest.raises(ValueError, match="has no fix"):
        CheckResult("x", Status.PASS, "fine", fix="do something")
    with pytest.raises(ValueError, match="needs a fix"):
        CheckResult("x", Status.FAIL, "broken")
    with pytest.raises(ValueError, match="needs a fix"):
        CheckResult("x", Status.WARN, "hmm")


def test_a_raising_check_becomes_a_fail_with_its_message():
    def boom(ctx):
        raise KeyError("no such thing")

    results = run_checks(
        (
            Check("model", "boom", boom),
            Check("runtime", "two", lambda ctx: [passed("a", "ok"), skipped("b", "n/a")]),
        ),
        context=None,
    )
    assert [(r.section, r.name, r.status) for r in results] == [
        ("model", "boom", Status.FAIL),
        ("runtime", "a", Status.PASS),
        ("runtime", "b", Status.SKIP),
    ]
    assert "KeyError" in results[0].reason and "no such thing" in results[0].reason
    assert results[0].fix


def test_exit_code_is_one_only_with_a_fail():
    ok = [passed("a", "ok"), warned("b", "meh", "do x"), skipped("c", "n/a")]
    assert exit_code(ok) == 0
    assert exit_code([*ok, failed("d", "bad", "do y")]) == 1
    assert summary_line(ok, 1.0).startswith("OK: 1 passed, 1 warnings, 0 failed, 1 skipped")


def test_json_document_has_results_and_summary():
    results = run_checks((Check("kv", "c", lambda ctx: failed("c", "bad", "do y", blocks=3)),), None)
    doc = json.loads(to_json(results, 0.5))
    assert doc["summary"] == {"pass": 0, "warn": 0, "fail": 1, "skip": 0, "ok": False, "elapsed_s": 0.5}
    (row,) = doc["results"]
    assert row == {
        "name": "c",
        "status": "FAIL",
        "reason": "bad",
        "fix": "do y",
        "details": {"blocks": 3},
        "section": "kv",
    }
    assert to_table(results).row_count == 1
