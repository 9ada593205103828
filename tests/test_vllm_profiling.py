"""``switchyard.vllm_profiling``: settings checks and the command recorded in a profile."""

from __future__ import annotations

import pytest

from switchyard.vllm_profiling import ProfileSettings, command_line


def test_command_line_names_no_directory_of_this_machine() -> None:
    cmd = command_line(["/usr/bin/switchyard", "profile-vllm", "--model", "/home/me/models/q3",
                        "--out=/tmp/x/p.json", "--quick"])  # fmt: skip
    assert cmd == "switchyard profile-vllm --model q3 --out=p.json --quick"


def test_settings_reject_non_positive_values() -> None:
    with pytest.raises(ValueError, match="--max-num-seqs must be >= 1"):
        ProfileSettings(max_num_seqs=0)
    with pytest.raises(ValueError, match="--threads"):
        ProfileSettings(threads=0)


def test_a_session_is_prioritised_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from switchyard.vllm_env import AUTOGROUP_NICE_ENV, prioritise_session

    monkeypatch.delenv(AUTOGROUP_NICE_ENV, raising=False)
    assert prioritise_session(os.getpid()) is None
    monkeypatch.setenv(AUTOGROUP_NICE_ENV, "not a number")
    assert prioritise_session(os.getpid()) is None
    monkeypatch.setenv(AUTOGROUP_NICE_ENV, "0")
    assert prioritise_session(2**22 + 12345) is None  # no such process
