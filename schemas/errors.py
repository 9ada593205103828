"""Readable validation errors: every message names the field and the rule broken."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_RULES: dict[str, str] = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must have at most {max_length} characters",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
    "string_pattern_mismatch": "must match {pattern}",
}


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "body"


def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fmt(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value


def describe_error(err: Any) -> str:
    """One line for one pydantic error dict: ``ttft_slo_ms must be > 0, got -5``."""
    where = _loc(tuple(err.get("loc", ())))
    kind = err.get("type", "")
    ctx = {k: _fmt(v) for k, v in (err.get("ctx") or {}).items()}
    template = _RULES.get(kind)
    if template is not None:
        try:
            rule = template.format(**ctx)
        except (KeyError, IndexError):
            rule = template
    else:
        rule = str(err.get("msg", kind))
        if rule.startswith("Value error, "):
            rule = rule[len("Value error, ") :]
    if not err.get("loc"):
        return rule
    if kind in ("missing", "extra_forbidden") or "input" not in err:
        return f"{where} {rule}"
    return f"{where} {rule}, got {_got(_fmt(err['input']))}"


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """All errors of one validation failure, joined by '; ', most useful first."""
    lines = [describe_error(e) for e in exc.errors(include_url=False)]
    text = "; ".join(lines[:5])
    if len(lines) > 5:
        text += f"; and {len(lines) - 5} more"
    return f"{prefix}{text}"


def first_field(exc: ValidationError) -> str | None:
    """The dotted path of the first field a validation failure blames (None: the body)."""
    errors = exc.errors(include_url=False)
    if not errors or not errors[0].get("loc"):
        return None
    return _loc(tuple(errors[0]["loc"]))
