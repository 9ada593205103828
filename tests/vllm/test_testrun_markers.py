"""``testrun --vllm-last`` splits one pytest command line into the main run and the vllm run."""

from __future__ import annotations

from switchyard.testrun import with_marker


def test_marker_appended_when_none() -> None:
    assert with_marker(["pytest", "-q"], "not vllm") == ["pytest", "-q", "-m", "not vllm"]


def test_users_marker_kept_and_narrowed() -> None:
    got = with_marker(["pytest", "-m", "faults", "tests/faults"], "vllm")
    assert got == ["pytest", "-m", "(faults) and (vllm)", "tests/faults"]
    assert with_marker(["pytest", "-mfaults"], "not vllm") == [
        "pytest",
        "-m(faults) and (not vllm)",
    ]
