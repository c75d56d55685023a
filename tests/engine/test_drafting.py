"""Prompt-lookup drafts and the per-request decision of how many to draft."""

from __future__ import annotations

import pytest

from mcp2026.config import SpeculativeConfig
from mcp2026.engine.drafting import Drafter, NgramIndex, StepCosts, expected_tokens


def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_proposed():
    index = NgramIndex(2, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0..2 (followed by 8, 1); (6, 7) also at 5..6 (followed by 9), but the
    # longer match wins
    assert index.propose(tokens, 2) == [8, 1]
    tokens += [4, 6, 7]  # now (x, 6, 7) with x=4 is new; (6, 7) last occurred at 9..10, followed by 4
    assert index.propose(tokens, 3) == [4, 6, 7]


def test_no_match_no_draft_and_the_suffix_is_not_its_own_match():
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4], 4) == []
    assert index.propose([1, 2], 4) == []  # the only (1, 2) is the suffix itself
    assert index.propose([1, 2, 1, 2], 4) == [1, 2]  # the continuation may run into the suffix
    assert index.propose([9], 4) == []


def test_a_growing_sequence_is_indexed_incrementally_like_a_fresh_one():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 3) == NgramIndex(1, 3).propose(tokens[:end], 3)


def test_expected_tokens_and_measured_step_costs():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = StepCosts()
    assert costs.ratio(3, 1) > 1.0  # a prior before anything was measured: extra tokens are never free
    costs.observe(1, 0.010)
    costs.observe(5, 0.018)
    assert costs.ratio(5, 1) == pytest.approx(1.8)
    assert costs.ratio(1, 1) == 1.0
    assert costs.ratio(6, 1) > costs.ratio(5, 1)  # beyond the measured sizes: more than the largest below


def test_drafting_stops_where_drafts_fail_and_tries_again_later():
    drafter = Drafter(SpeculativeConfig(num_tokens=4))
    drafter.observe_step(1, 0.010)
    drafter.observe_step(5, 0.012)  # drafting is cheap here: any reasonable acceptance pays
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert drafter.propose("r", tokens, 10, 1) == [4, 1, 2, 3]
    for _ in range(12):
        drafter.observe("r", 4, 0)  # every draft rejected at its first token
    assert drafter.propose("r", tokens, 10, 1) == []
    for _ in range(200):  # steps without drafts: the acceptance drifts back to the prior
        drafter.propose("r", tokens, 10, 1)
    assert drafter.propose("r", tokens, 10, 1) != []


def test_expensive_steps_draft_less():
    drafter = Drafter(SpeculativeConfig(num_tokens=4))
    for n, seconds in ((1, 0.010), (2, 0.020), (3, 0.030), (4, 0.040), (5, 0.050)):
        drafter.observe_step(n, seconds)  # every token costs a whole step: no draft can pay at a < 1
    assert drafter.propose("r", [1, 2, 3, 1, 2], 10, 1) == []


def test_the_limit_caps_the_draft():
    drafter = Drafter(SpeculativeConfig(num_tokens=4))
    drafter.observe_step(1, 0.010)
    drafter.observe_step(2, 0.010)
    drafter.observe_step(3, 0.010)
    assert drafter.propose("r", [7, 8, 9, 7, 8], 2, 1) == [9, 7]
    assert drafter.propose("r", [7, 8, 9, 7, 8], 0, 1) == []


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeConfig(min_ngram=3, max_ngram=2)


def test_a_requests_token_view_reads_like_its_token_list():
    from mcp2026.engine.request import Request

    request = Request("r", [5, 6, 7, 8, 5, 6], output_token_ids=[7, 9, 5, 6])
    tokens, view = request.all_token_ids, request.token_view
    assert len(view) == len(tokens) and list(view) == tokens
    for a, b in ((0, 3), (4, 8), (2, 9), (-3, None), (7, 3)):
        assert view[a:b] == tokens[a:b]
    assert view[-1] == 6 and view[6] == 7
    with pytest.raises(IndexError):
        view[10]
    assert NgramIndex(2, 3).propose(view, 3) == NgramIndex(2, 3).propose(tokens, 3) == [7, 9, 5]
