"""Reading a YAML config strictly: one line for each way a text fails (its position and problem, an integer
too long to read, an alias nested in itself, a repeated key), where PyYAML would print several or take the
last value of a repeated key silently."""

from __future__ import annotations

import sys

import yaml

from looped_lm.errors import UserError


def yaml_problem(e: yaml.YAMLError) -> str:
    """' at line L, column C: <problem>' on one line (PyYAML's own text spans several)."""
    if isinstance(e, yaml.reader.ReaderError):  # a NUL or control byte: its offset, not PyYAML's two lines
        code = e.character if isinstance(e.character, int) else ord(e.character[:1] or "\0")
        return f": character #x{code:04x} at offset {e.position} is not allowed in YAML ({e.reason})"
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{where}: {problem}"


def safe_load(text: str, what: str):
    """yaml.safe_load, with what it raises besides YAMLError named in one line: an integer too long for
    Python's int-from-text limit (ValueError), or an alias nested in itself (a recursive structure)."""
    try:
        value = yaml.safe_load(text)
    except ValueError:  # int("9" * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise UserError(f"{what}: an integer has more than {sys.get_int_max_str_digits()} digits (Python's limit "
                        "for reading one); no config value needs that many") from None
    _refuse_recursion(value, what)
    return value


def _refuse_recursion(value, what: str, inside: tuple = ()) -> None:
    """`a: &x [*x]` makes a list that contains itself: refused (validation would recurse forever)."""
    if isinstance(value, (list, dict)):
        if any(value is seen for seen in inside):
            raise UserError(f"{what}: a YAML alias refers to a node that contains it (a self-referencing anchor)")
        for item in value.values() if isinstance(value, dict) else value:
            _refuse_recursion(item, what, inside + (value,))


def refuse_duplicate_keys(node, path: str, where: str = "", inside: tuple = ()) -> None:
    """YAML lets a repeated key silently take the last value; a config must not."""
    if any(node is seen for seen in inside):  # an anchor aliased inside itself: safe_load names it
        return
    inside = inside + (node,)
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is not None and key in seen:
                raise UserError(f"config file {path}: key '{where}{key}' appears twice (lines {seen[key]} and "
                                f"{line}); keep one")
            if key is not None:
                seen[key] = line
            refuse_duplicate_keys(value_node, path, f"{where}{key}." if key is not None else where, inside)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            refuse_duplicate_keys(item, path, where, inside)
