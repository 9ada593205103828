"""The step-time profiles file (loaders/profiles.py): read once per path, read only for a
cluster that names a profile, a missing file says how to rebuild it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loaders.profiles import (
    PROFILES_FILE,
    clear_cache,
    load_profile,
    profile_record,
    profiles_for,
    read_profiles,
)
from schemas import ClusterConfig


def _cluster(**model: object) -> ClusterConfig:
    spec = {"name": "m", "input_usd_per_token": 0.0, "output_usd_per_token": 0.0, **model}
    return ClusterConfig.model_validate(
        {"models": [spec], "instances": [{"id": "m-0", "model": "m"}]}
    )


def test_shipped_file_is_read_once_and_parsed_by_routing() -> None:
    a = read_profiles()
    assert read_profiles(PROFILES_FILE) is a  # cached by path
    assert a.source == str(PROFILES_FILE)
    assert load_profile("llama-2-7b-hf@h100") == a.model("llama-2-7b-hf@h100")
    assert profile_record("LLAMA-2-7b-hf@H100") == a.record("llama-2-7b-hf@h100")


def test_profiles_for_reads_only_when_a_model_needs_one(tmp_path: Path) -> None:
    coeffs = {"c0_ms": 1.0, "c1_ms_per_token": 0.0, "c2_ms_per_ctx_token": 0.0,
              "c3_ms_per_attn_unit": 0.0}  # fmt: skip
    absent = tmp_path / "absent.json"
    assert profiles_for(_cluster(step_time=coeffs), absent) is None
    assert profiles_for(_cluster(profile="x@y", step_time=coeffs), absent) is None
    with pytest.raises(FileNotFoundError, match="switchyard profiles build"):
        profiles_for(_cluster(profile="x@y"), absent)


def test_a_rewritten_file_is_read_again_after_clear_cache(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    rec = profile_record("llama-2-7b-hf@h100")
    path.write_text(json.dumps({"profiles": {"a@cpu": rec}}), encoding="utf-8")
    assert read_profiles(path).names() == ["a@cpu"]
    path.write_text(json.dumps({"profiles": {"b@cpu": rec}}), encoding="utf-8")
    assert read_profiles(path).names() == ["a@cpu"]  # cached
    clear_cache()
    assert read_profiles(path).names() == ["b@cpu"]
