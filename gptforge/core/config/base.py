"""The schema's building blocks: a field (`Setting`), a section, the fields a fingerprint hashes, sizes, and the
algorithm names the preference section takes (the stages gptforge.core.declarations declares with its section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gptforge.core.declarations import ALGORITHMS, ONLINE_ALGORITHMS  # noqa: F401 (preference.algorithm's names)

Algorithm = Literal[ALGORITHMS]  # each a stage declared in gptforge.core.declarations


def Setting(default: Any = ..., *, same_result: bool = False, **kw) -> Any:
    """A config field; `same_result=True` marks one that cannot change a stage's output."""
    return Field(default, json_schema_extra={"same_result": True} if same_result else None, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def result_fields(section: Section, leave_out: tuple[str, ...] = ()) -> dict:
    """The fields of a section that can change a result (what a fingerprint hashes), nested sections included."""
    out = {}
    for name, field in type(section).model_fields.items():
        if name in leave_out or (field.json_schema_extra or {}).get("same_result"):
            continue
        value = getattr(section, name)
        out[name] = result_fields(value) if isinstance(value, Section) else section.model_dump(
            mode="json", include={name})[name]
    return out



UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(size: str | int) -> int:
    """'5GB' -> 5_000_000_000 (also KB, MB, TB and the binary KiB ... TiB; a bare number is bytes)."""
    text = str(size).strip().upper()
    number = text.rstrip("KMGTIB ")
    unit = text[len(number):].strip()
    try:
        value = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{size!r} is not a size (bytes, or a number with KB, MB, GB, TB, KiB, MiB, GiB, "
                         "TiB)") from None
    if value < 1:
        raise ValueError(f"{size!r} is not a positive size")
    return int(value)

