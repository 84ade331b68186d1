"""YAML text of plain data (dicts, lists, strings, numbers, booleans, None), for Kubernetes manifests.

A small emitter instead of a YAML library dependency: block style, two-space indents, keys in the order given.
A string is written plain only when it cannot read as anything else (it starts with a letter or ``/``, holds only
letters, digits and ``_./-``, and is not a YAML 1.1 boolean or null word); any other string is double-quoted with
escapes for what is not printable, and a multi-line string ending in a newline is a literal
block (``|``). So ``"0.9"``, ``"true"``, ``"30000"`` and ``"--port"`` stay strings.
"""

from __future__ import annotations

import re
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z/][A-Za-z0-9_./-]*$")
#: Words YAML 1.1 readers (PyYAML, older kubectl) take for booleans or null.
_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}


def scalar(v: Any) -> str:
    """One scalar as YAML text. Raises TypeError for anything but str, int, float, bool and None."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _float(v)
    if isinstance(v, str):
        if _PLAIN.fullmatch(v) and v.lower() not in _SPECIAL and not v.endswith(("/", ".")):
            return v
        return quote(v)
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


def _float(v: float) -> str:
    """A float as YAML 1.1 readers take it for one: a mantissa with a dot (``1.0e-05``, not ``1e-05``, which PyYAML
    and go-yaml's 1.1 rules read as a string), ``.inf``, ``-.inf``, ``.nan``."""
    if v != v:
        return ".nan"
    if v in (float("inf"), float("-inf")):
        return ".inf" if v > 0 else "-.inf"
    text = repr(v)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def quote(s: str) -> str:
    """``s`` as a YAML double-quoted scalar: printable characters as they are, the rest as ``\\x``, ``\\u`` or
    ``\\U`` escapes (so a character beyond U+FFFF stays one character, not a JSON surrogate pair)."""
    out = ['"']
    for c in s:
        o = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable() and c not in "\u2028\u2029\ufeff":
            out.append(c)
        elif o <= 0xFF:
            out.append(f"\\x{o:02x}")
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


def _block(s: str) -> bool:
    lines = s[:-1].split("\n") if s.endswith("\n") else []
    return (
        len(lines) > 1
        and not s.endswith("\n\n")
        and all(line == line.rstrip() and "\t" not in line and "\r" not in line for line in lines)
        and not lines[0].startswith(" ")
        and all(line.isprintable() for line in lines)
    )


def _lines(v: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(v, dict):
        for key, value in v.items():
            k = scalar(str(key))
            if isinstance(value, (dict, list)) and value:
                out.append(f"{pad}{k}:")
                out += _lines(value, indent + (2 if isinstance(value, dict) else 0))
            elif isinstance(value, str) and _block(value):
                out.append(f"{pad}{k}: |")
                out += [f"{pad}  {line}" if line else "" for line in value[:-1].split("\n")]
            else:
                out.append(f"{pad}{k}: {_inline(value)}")
    elif isinstance(v, list):
        for item in v:
            if isinstance(item, (dict, list)) and item:
                sub = _lines(item, indent + 2)
                out.append(f"{pad}- {sub[0][indent + 2 :]}")
                out += sub[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")
    else:
        out.append(pad + _inline(v))
    return out


def _inline(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return scalar(v)


def dump(data: Any) -> str:
    """One YAML document of ``data`` (no ``---``), ending in a newline."""
    return "\n".join(_lines(data, 0)) + "\n"


def dump_all(docs: list[Any]) -> str:
    """Several documents separated by ``---`` lines."""
    return "---\n".join(dump(d) for d in docs)


__all__ = ["dump", "dump_all", "scalar"]
