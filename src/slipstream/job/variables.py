"""Variable references in a job spec's ``command``, ``args`` and ``env``: Kubernetes' rule, on every target.

Kubernetes expands ``$(NAME)`` in a container's command, args and env values
(the kubelet, ``third_party/forked/golang/expansion``): ``$(NAME)`` becomes the
value of ``NAME`` when the container defines it (an env value sees only the
entries before it), and stays the literal text ``$(NAME)`` when it does not;
``$$`` is one literal ``$`` (so ``$$(NAME)`` is the text ``$(NAME)``). Nothing
else is special: ``${HOME}``, ``$HOME``, backticks, quotes, ``$(cmd args)``,
newlines reach the program as written. :func:`expand` is that rule; the local
runner applies it, the Slurm renderer writes it as shell words
(:func:`shell_word`), and the Kubernetes manifests carry the spec's strings
unchanged for the kubelet to expand. So one spec gives the program the same
bytes everywhere.

The variables a reference may name are the same on every target: the spec's
``env`` and the ``SLIPSTREAM_*`` variables the spec itself sets
(``JobSpec.worker_env()``). :func:`reference_problems` refuses what would not
mean the same everywhere: a reference to any other variable-like name (a
platform may define it: ``$(JOB_COMPLETION_INDEX)`` on an Indexed Job,
``$(KUBERNETES_SERVICE_HOST)`` through service links; write ``$$(NAME)`` for the
literal text), an env value naming a variable defined after it, ``$`` right
before a non-ASCII character (the kubelet's expansion splits that character's
bytes), and text no process can receive (NUL, lone surrogates).

Example::

    expand("--out=$(OUT)/x $(UNSET) $$(OUT) ${HOME} $(touch /tmp/x)", {"OUT": "/data"})
    # '--out=/data/x $(UNSET) $(OUT) ${HOME} $(touch /tmp/x)'
    shell_word("--out=$(OUT)/x; rm", {"OUT"})     # the shell word  --out="${OUT}"'/x; rm'
"""

from __future__ import annotations

import re
import shlex
from typing import Collection, Iterable, Iterator, Mapping

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A name a platform could define as an environment variable (and the shell can expand)."""


def pieces(text: str, defined: Collection[str]) -> Iterator[tuple[bool, str]]:
    """``text`` as (is_reference, piece) in order, by Kubernetes' rule: a reference piece is the
    name of a ``defined`` variable; a literal piece is text as the program receives it (``$$``
    already one ``$``, references to names not ``defined`` already their literal text)."""
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:  # a final "$" is literal
            literal.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":  # "$$": one literal "$"
            literal.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:  # "$(" with no ")": literal, and scanning goes on after the "("
                literal.append("$(")
                i += 2
                continue
            name = text[i + 2:close]
            if name in defined:
                if literal:
                    yield False, "".join(literal)
                    literal = []
                yield True, name
            else:
                literal.append(text[i:close + 1])
            i = close + 1
        else:  # "$" before any other character: both literal
            literal.append(c + nxt)
            i += 2
    if literal:
        yield False, "".join(literal)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``text`` with the variables ``env`` (see the module's example)."""
    return "".join(env[p] if ref else p for ref, p in pieces(text, env))


def references(text: str) -> list[str]:
    """Every name ``text`` references as ``$(NAME)`` (what would expand were it defined)."""
    return [p for ref, p in pieces(text, _Everything()) if ref]


def expand_env(env: Iterable[tuple[str, str]], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Env values expanded in order, each with the entries before it (and ``base``), as the kubelet does."""
    out: dict[str, str] = {}
    for name, value in env:
        out[name] = expand(value, {**(base or {}), **out})
    return out


def shell_word(text: str, defined: Collection[str]) -> str:
    """One shell word that gives the program what :func:`expand` would: literal pieces
    single-quoted (:func:`shlex.quote`), references to ``defined`` variables as ``"${NAME}"``.
    The shell must have those variables set to their expanded values."""
    words = [f'"${{{p}}}"' if ref else shlex.quote(p) for ref, p in pieces(text, defined)]
    return "".join(words) or "''"


def reference_problems(
    env: Iterable[tuple[str, str, str]], argv: Iterable[tuple[str, str]], mount_fields: Collection[str] = (),
) -> list[tuple[str, str]]:
    """What would not reach the program with one meaning on every target, as (field, message).

    ``env``: (field, name, value) in the order the variables are set (``env.X`` or the spec key a
    generated ``SLIPSTREAM_*`` variable comes from); ``argv``: (field, word) of the command line.
    ``mount_fields``: fields Kubernetes also uses unexpanded (a volume's mount path), where no
    reference may expand.
    """
    problems: list[tuple[str, str]] = []
    env = list(env)
    names = {name for _, name, _ in env}
    seen: set[str] = set()
    for field, name, value in env:
        problems += _text_problems(field, value, seen, names, mount=field in mount_fields, in_env=True)
        seen.add(name)
    for field, word in argv:
        problems += _text_problems(field, word, names, names, mount=False, in_env=False)
    return problems


def _text_problems(field: str, text: str, defined: Collection[str], names: Collection[str], *, mount: bool,
                   in_env: bool) -> list[tuple[str, str]]:
    shown = _show(text)
    if "\0" in text:
        return [(field, f"must not contain a NUL character (no program can receive one), got {shown}")]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return [(field, f"must be valid Unicode text (a lone surrogate cannot be passed on), got {shown}")]
    out: list[tuple[str, str]] = []
    if _dollar_before_non_ascii(text):
        out.append((field, "must not put '$' right before a non-ASCII character (Kubernetes' expansion "
                           f"splits that character's bytes); write '$$' for a literal '$', got {shown}"))
    for name in references(text):
        if name in defined:
            if mount:
                out.append((field, f"must not reference $({name}): Kubernetes mounts the volume at the path "
                                   f"as written; write $$({name}) for the literal text, got {shown}"))
        elif NAME_RE.match(name):
            where = ("is set after it (an env value sees only the entries before it)" if in_env and name in names
                     else "is not set by the spec (only its env and the SLIPSTREAM_* variables it sets may be "
                          "referenced: a platform may define other names)")
            out.append((field, f"references $({name}), which {where}; write $$({name}) for the literal "
                               f"text, got {shown}"))
    return out


def _dollar_before_non_ascii(text: str) -> bool:
    """A ``$`` the kubelet reads as "operator, then one byte" right before a non-ASCII character: it
    writes that byte back as a code point of its own (Go's ``string(input[0])``), splitting the character."""
    i, n = 0, len(text)
    while i < n - 1:
        if text[i] != "$":
            i += 1
        elif text[i + 1] == "$":
            i += 2
        elif text[i + 1] == "(":
            close = text.find(")", i + 2)
            i = close + 1 if close >= 0 else i + 2
        elif ord(text[i + 1]) > 0x7F:
            return True
        else:
            i += 2
    return False


def _show(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:77] + "..."


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


__all__ = ["expand", "expand_env", "pieces", "references", "shell_word", "reference_problems", "NAME_RE"]
