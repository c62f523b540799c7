"""frontends/request_id.py: which X-Request-Id values are kept, which are made, which are refused."""
import pytest

from frontends.request_id import MAX_LEN, new_request_id, request_id, traced


def test_a_callers_id_is_kept_and_a_missing_or_empty_one_is_made():
    assert request_id("abc-123_x/y:z") == "abc-123_x/y:z"
    assert request_id("x" * MAX_LEN) == "x" * MAX_LEN
    made = {request_id(None), request_id(""), new_request_id()}
    assert len(made) == 3 and all(m.startswith("req_") and len(m) == 36 for m in made)


@pytest.mark.parametrize("bad", ["x" * (MAX_LEN + 1), "two words", "tab\there", "caf\u00e9", "nul\x00"])
def test_an_id_too_long_or_with_other_characters_is_refused_naming_the_rule(bad):
    with pytest.raises(ValueError, match="X-Request-Id must be 1-128 visible ASCII characters"):
        request_id(bad)


def test_the_log_names_both_ids():
    assert traced({"request_id": "trace-1"}, "cmpl-9") == "cmpl-9 (X-Request-Id trace-1)"
