"""The Lua scripts as Redis gets them: shared code inlined (``state.redis_core.script_text``)."""

from __future__ import annotations

from state.redis_core import SCRIPTS, script_text


def test_included_lua_is_inlined_into_the_window_scripts() -> None:
    for name in SCRIPTS:
        lines = script_text(name).splitlines()
        assert not any(line.startswith("--! include ") for line in lines), name
    for name in ("dedupe", "mark_intent", "mark_routed"):
        text = script_text(name)
        assert text.count("local function window_keys(joined)") == 1, name
        assert text.index("local function window_keys") < text.index("window_keys(ARGV"), name
