"""Request bodies whose strings must be valid Unicode.

JSON may carry a lone surrogate ("\\udfff"); Python's json keeps it in the str, and the tokenizer,
the chat template or a UTF-8 encoder then fail deep inside a request. Models deriving from
`ValidText` refuse such a string up front, as a pydantic error of pydantic's own type for bad
Unicode (`string_unicode`), which the error handler answers with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, field_validator
from pydantic_core import PydanticCustomError

UNICODE_ERROR = "string_unicode"


def find_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (relative to value, e.g. "[0].content") of the first string that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f".{_printable(key)}"
            found = path + name if not _is_valid(key) else find_invalid_text(item, path + name)
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if type(item) is int:
                continue  # token ids: the common long list
            found = find_invalid_text(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_all_valid(value: Any) -> bool:
    """One pass in C over every string of value (the walk above, in Python, only runs to find a bad one)."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_valid(key: object) -> bool:
    return not isinstance(key, str) or find_invalid_text(key) is None


def _printable(key: object) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class ValidText(BaseModel):
    """A body model whose every string, nested ones included, is valid Unicode (checked before parsing)."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _is_all_valid(value):
            return value
        path = find_invalid_text(value)
        if path is not None:
            raise PydanticCustomError(
                UNICODE_ERROR,
                "not valid Unicode (a lone surrogate such as \\udfff): send UTF-8 text",
                {"path": path},
            )
        return value
