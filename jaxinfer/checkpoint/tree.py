"""Nested-dict parameter trees (nnx pure dicts) <-> flat {path tuple: leaf} lists."""

from __future__ import annotations

from typing import Any


def flatten_tree(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """[(path, leaf)] in insertion order; paths are tuples of keys (ints for nnx list indices)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(flatten_tree(value, prefix + (key,)))
        else:
            out.append((prefix + (key,), value))
    return out


def unflatten_tree(items: list[tuple[tuple, Any]]) -> dict:
    root: dict = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root
