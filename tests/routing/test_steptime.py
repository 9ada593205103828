"""Eq. 9 step-time model, its NNLS fit, and the shipped profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loaders.profiles import list_profiles, load_profile, profile_record
from routing.profiles import Profiles, Table
from routing.steptime import StepTimeModel, attn_units, features, fit_nnls
from schemas import StepTimeCoefficients

M = StepTimeModel(5.0, 0.02, 1e-4, 2e-6)


def test_step_ms_known_answer() -> None:
    # 5 + 0.02*600 + 1e-4*3000 + 2e-6 * 500*(250+100)
    got = M.step_ms(600, 3000, float(attn_units(500, 100)))
    assert float(got) == pytest.approx(5 + 12 + 0.3 + 2e-6 * 500 * 350)


def test_step_ms_is_vectorised() -> None:
    n = np.array([1, 10, 100])
    got = M.step_ms(n, np.array([0, 10, 100]), 0.0)
    assert got.shape == (3,)
    assert got[2] == pytest.approx(5 + 2 + 0.01)


def test_attn_units_telescopes_over_chunks() -> None:
    # chunking a prompt never changes the total causal attention work: P^2 / 2
    chunks = [512, 512, 176]
    ctx = np.cumsum([0] + chunks[:-1])
    assert float(attn_units(np.array(chunks), ctx).sum()) == pytest.approx(1200**2 / 2)


def test_coefficients_round_trip() -> None:
    c = StepTimeCoefficients(
        c0_ms=1.0, c1_ms_per_token=0.1, c2_ms_per_ctx_token=0.01, c3_ms_per_attn_unit=1e-6
    )
    m = StepTimeModel.from_coefficients(c)
    assert m.to_coefficients() == c
    assert m.prefill_ms(100) == pytest.approx(1.0 + 10.0 + 1e-6 * 5000)


def test_negative_coefficient_is_rejected() -> None:
    with pytest.raises(ValueError, match="c2_ms_per_ctx_token must be a finite number >= 0"):
        StepTimeModel(1.0, 0.1, -1.0, 0.0)


def test_fit_nnls_recovers_exact_coefficients() -> None:
    rng = np.random.default_rng(0)
    n = rng.integers(1, 4096, 200)
    d = rng.integers(0, 200_000, 200)
    a = rng.uniform(0, 5e6, 200)
    X = features(n, d, a)
    rep = fit_nnls(X, M.step_ms(n, d, a))
    np.testing.assert_allclose(rep.model.coef, M.coef, rtol=1e-6)
    assert rep.mape < 1e-9


def test_fit_nnls_keeps_coefficients_non_negative() -> None:
    rng = np.random.default_rng(1)
    n = rng.integers(1, 100, 50)
    X = features(n, 0.0, 0.0)
    t = 10.0 - 0.01 * n  # a negative slope cannot be represented
    rep = fit_nnls(X, t)
    assert (rep.model.coef >= 0).all()


def test_fit_nnls_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"X must have shape \(n, 4\)"):
        fit_nnls(np.ones((5, 3)), np.ones(5))
    with pytest.raises(ValueError, match="step times must be > 0 ms"):
        fit_nnls(features(np.arange(1, 6), 0, 0), np.array([1.0, 2.0, 0.0, 1.0, 1.0]))


def test_at_least_three_h100_tiers_are_shipped() -> None:
    names = list_profiles()
    for tier in ("llama-2-7b-hf@h100", "codellama-34b-instruct-hf@h100", "llama-2-70b-hf@h100"):
        assert tier in names
    assert all(n == n.lower() and "@" in n for n in names)


def test_load_profile_is_case_insensitive_and_errors_list_known() -> None:
    m = load_profile("CodeLlama-34b-Instruct-hf@H100")
    assert m.c0_ms > 0 and m.c1_ms_per_token > 0
    with pytest.raises(KeyError, match="known:"):
        load_profile("no-such-model@h100")


def test_profiles_record_their_fit_error() -> None:
    for name in list_profiles():
        rec = profile_record(name)
        fit = rec["fit"]
        if "provenance" in rec:  # measured by `switchyard profile-vllm`: Eq. 9 vs real steps
            assert 0 <= fit["mape"] < 0.25, name  # a shared 2-core machine: +-40% step noise
            assert set(fit["eq9"]["by_kind"]) == {"decode", "prefill", "mixed"}, name
            continue
        assert 0 <= fit["mape"] < 0.10, name  # Eq. 9 vs the measured table
        real = fit.get("real") or {}
        if real:
            assert real["table_mape"] < 0.10, name  # the table vs real timings


def test_profiles_are_built_from_a_document_without_a_file() -> None:
    rec = profile_record("llama-2-7b-hf@h100")
    book = Profiles.from_json(json.dumps({"profiles": {"Toy@CPU": rec}}), source="inline")
    assert book.names() == ["toy@cpu"]
    assert book.model("TOY@cpu") == load_profile("llama-2-7b-hf@h100")
    np.testing.assert_array_equal(book.table("toy@cpu").dense_ms, Table.from_record(rec).dense_ms)
    with pytest.raises(KeyError, match=r"known: \['toy@cpu'\]"):
        book.record("llama-2-7b-hf@h100")
    with pytest.raises(ValueError, match="inline has no 'profiles' object"):
        Profiles.from_document({"tables": {}}, source="inline")


def test_profile_table_is_not_the_linear_model() -> None:
    rec = profile_record("llama-2-7b-hf@h100")
    tb = Table.from_record(rec)
    m = load_profile("llama-2-7b-hf@h100")
    n = np.array([1.0, 64.0, 512.0, 2048.0])
    table = tb.step_ms(n, n, n, n * 1000, 0.0)
    linear = m.step_ms(n, n * 1000, 0.0)
    assert not np.allclose(table, linear, rtol=1e-3)
    np.testing.assert_allclose(table, linear, rtol=0.35)
