"""YAML as kvtune reads configuration files: safe, with alias expansion bounded (issue 29).

``yaml.safe_load`` builds a document's aliases as shared references, so a 380-byte "billion
laughs" document loads in microseconds, and then anything that walks or prints it (an error
message quoting the value: 351 million characters, 1.08 GB) expands it. :func:`load` composes the
document, counts the nodes it stands for with every alias expanded (each distinct node once,
memoised), and refuses a document over :data:`MAX_EXPANDED_NODES` (or with a recursive alias)
before building anything. :func:`shown` quotes a value in bounded size for error messages.
"""
from __future__ import annotations

import reprlib
from typing import Any, Final

from kvtune.errors import ConfigError

MAX_EXPANDED_NODES: Final = 100_000
"""Most YAML nodes a configuration file may stand for with its aliases expanded (kvtune's config
files hold tens; a billion-laughs bomb stands for billions)."""
MAX_MESSAGE_CHARS: Final = 500
"""Longest YAML parser message quoted in an error."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple = 2, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def shown(value: Any) -> str:
    """A repr of ``value`` of bounded size (nested and long values abbreviated with ``...``)."""
    return _REPR.repr(value)


def load(text: str, *, source: str) -> Any:
    """The YAML document in ``text`` (None when empty); a :class:`ConfigError` naming ``source``
    when it is not YAML, its aliases expand past :data:`MAX_EXPANDED_NODES`, or one refers to
    itself."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML (expected JSON or YAML): "
                          f"{str(exc)[:MAX_MESSAGE_CHARS]}") from None
    finally:
        loader.dispose()


def _check_expansion(root: Any, source: str) -> None:
    import yaml

    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    # Iterative post-order walk: (node, children visited?)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            total = 1
            for child in _children(node, yaml):
                total += sizes[id(child)]
            if total > MAX_EXPANDED_NODES:
                raise ConfigError(
                    f"{source}: the YAML document's aliases expand to more than "
                    f"{MAX_EXPANDED_NODES} nodes (an alias bomb?); expected a plain "
                    f"configuration file")
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise ConfigError(f"{source}: a YAML alias refers to a node that contains it "
                              f"(recursive); expected a plain configuration file")
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node, yaml):
            if id(child) not in sizes:
                if id(child) in on_path:
                    raise ConfigError(f"{source}: a YAML alias refers to a node that contains "
                                      f"it (recursive); expected a plain configuration file")
                stack.append((child, False))


def _children(node: Any, yaml: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []
