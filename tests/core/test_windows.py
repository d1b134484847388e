"""Completion windows (batchfile/windows.py): what is a window, which ones the operator offers and how long each
really is, and why a create body's window is refused."""

from __future__ import annotations

import pytest

from batch_dagster.batchfile.windows import CompletionWindows, Window, window_hours


def test_a_window_is_a_whole_number_of_hours():
    assert [window_hours(w) for w in ("1h", "24h", "720h")] == [1, 24, 720]
    for bad in ("0h", "721h", "01h", "1.5h", "1H", "24", "h", "1d", "24 h", "", "24h\n", "٢h"):
        assert window_hours(bad) is None, bad


def test_the_offered_windows_and_their_real_lengths():
    windows = CompletionWindows.of(["1h", "24h"])
    assert windows.lengths == {"1h": 3600, "24h": 86_400} and windows.names == ("1h", "24h")
    assert windows.window("1h") == Window("1h", 3600)
    assert windows.default == Window("24h", 86_400)  # a dropped file's: the longest
    short = CompletionWindows.of(["1h=60", " 24h=1440 ", ""])  # a bench's windows, 60 times shorter
    assert short.lengths == {"1h": 60, "24h": 1440} and short.default.name == "24h"


@pytest.mark.parametrize("entries, message", [
    (["1d"], "'1d' is not a window"),
    (["24h=0"], "whole number of seconds"),
    (["24h=x"], "whole number of seconds"),
    (["24h", "24h=60"], "listed twice"),
    ([""], "no window"),
])
def test_a_setting_that_is_not_a_list_of_windows_is_refused(entries, message):
    with pytest.raises(ValueError, match=message):
        CompletionWindows.of(entries)


def test_a_create_bodys_window_unknown_or_not_offered_is_refused_with_its_own_code():
    windows = CompletionWindows.of(["24h"])
    assert windows.refusal("24h") is None
    code, message = windows.refusal("1h")
    assert code == "completion_window_not_offered" and "'24h'" in message and "BATCH_COMPLETION_WINDOWS" in message
    code, message = windows.refusal("fast" * 100)
    assert code == "invalid_completion_window" and "not a window" in message and len(message) < 250
