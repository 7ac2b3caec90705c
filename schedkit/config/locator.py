"""YAML with line numbers: the parser that refuses duplicate keys and keeps the node
tree, and the look-ups from a key path to its ``file:line``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from schedkit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ConfigOrigin:
    """Where a :class:`Config` was read from: the file and its YAML node tree (lines)."""

    source: str
    root: yaml.Node | None


def scalars(root: yaml.Node | None) -> Iterator[tuple[tuple[int | str, ...], yaml.ScalarNode]]:
    """Every scalar value of the tree with its key path, in document order."""
    stack: list[tuple[tuple[int | str, ...], yaml.Node]] = [((), root)] if root is not None else []
    seen: set[int] = set()
    while stack:
        loc, node = stack.pop()
        if id(node) in seen:  # an alias met again
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            yield loc, node
        elif isinstance(node, yaml.MappingNode):
            stack.extend(reversed([((*loc, k.value), v) for k, v in node.value]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([((*loc, i), v) for i, v in enumerate(node.value)]))


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, mapping: yaml.MappingNode, key: Any, value: Any, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r}")
        self.mapping, self.key, self.value = mapping, key, value
        self.line, self.first_line = line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (PyYAML would silently
    keep the last). Keys brought in by a ``<<`` merge may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if seen is not key_node:
                    raise _DuplicateKey(node, key, self.construct_object(value_node, deep=True),
                                        key_node.start_mark.line + 1, seen.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


def _path_to(root: yaml.Node | None, target: yaml.Node) -> tuple[int | str, ...]:
    """Key path of ``target`` in the tree (() when it is the root or not found)."""
    stack: list[tuple[tuple[int | str, ...], yaml.Node]] = [((), root)] if root is not None else []
    seen: set[int] = set()
    while stack:
        loc, node = stack.pop()
        if node is target:
            return loc
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack.extend(((*loc, k.value), v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(((*loc, i), v) for i, v in enumerate(node.value))
    return ()


def load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML (safe tags only) into its data and its node tree (for line numbers).

    Raises:
        ConfigError: Not valid YAML, or a key given twice in one mapping (named with its
            path, its second value and ``source:line``).
    """
    loader = _UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _DuplicateKey as e:
        key = ".".join(str(p) for p in (*_path_to(root, e.mapping), e.key))
        raise ConfigError(f"{source}:{e.line}: {key} = {e.value!r}: duplicate key (already set "
                          f"at line {e.first_line}; YAML would keep only the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    finally:
        loader.dispose()
    return data, root


def line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """The line of the key at ``loc`` (of its deepest key the tree has, when the path
    leaves it), or None without a tree."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == key:
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return line
