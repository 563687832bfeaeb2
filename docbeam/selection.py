"""``output.select.where``: the rows a curation job keeps, as one small expression over a row's columns.

``score >= 3``, ``label in [en, de]``, ``scores[toxic] < 0.1 and num_tokens > 50``, ``not truncated``. The grammar
is Python's expression syntax cut down to comparisons (``== != < <= > >= in``, ``not in``), ``and``, ``or``,
``not``, numbers, quoted or bare words and lists of them; a bare word on the right of a comparison is a string
(``label == en``), and ``scores[name]`` is one label's score. Parsed once at start (no Beam imported: a config
is refused fast) into plain tuples that a worker evaluates, never ``eval``.
"""

from __future__ import annotations

import ast
import operator

COMPARISONS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
EXAMPLES = "e.g. score >= 3, label in [en, de], scores[toxic] < 0.1 and num_tokens > 50"


class SelectionError(ValueError):
    """An expression output.select.where cannot be: the message names the part and what is allowed."""


def parse(where: str) -> tuple:
    """The expression as nested tuples: ("and"|"or", parts), ("not", part), ("cmp", op, left, right),
    ("col", name), ("score_of", label), ("const", value), ("list", values)."""
    try:
        tree = ast.parse(where.strip(), mode="eval").body
    except SyntaxError as e:
        raise SelectionError(f"{where!r} is not an expression docbeam reads ({e.msg}); {EXAMPLES}") from None
    return _condition(tree, where)


def _condition(node, where: str) -> tuple:
    if isinstance(node, ast.BoolOp):
        return ("and" if isinstance(node.op, ast.And) else "or", tuple(_condition(v, where) for v in node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _condition(node.operand, where))
    if isinstance(node, ast.Compare):
        if len(node.ops) != 1:
            raise SelectionError(
                f"{where!r}: one comparison at a time, a column on its left; write a chain as score > 1 and score < 4"
            )
        (op,), (right,) = node.ops, node.comparators
        if type(op) not in COMPARISONS:
            raise SelectionError(f"{where!r}: {type(op).__name__} is not a comparison docbeam reads; {EXAMPLES}")
        return ("cmp", type(op), _column(node.left, where), _value(right, where))
    if isinstance(node, (ast.Name, ast.Subscript)):  # a boolean column on its own: `truncated`
        return ("cmp", ast.Eq, _column(node, where), ("const", True))
    raise SelectionError(f"{where!r}: {ast.unparse(node)!r} is not a condition; {EXAMPLES}")


def _column(node, where: str) -> tuple:
    if isinstance(node, ast.Name):
        return ("col", node.id)
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "scores"
        and isinstance(node.slice, (ast.Name, ast.Constant))
    ):
        label = node.slice.id if isinstance(node.slice, ast.Name) else node.slice.value
        return ("score_of", str(label))
    raise SelectionError(
        f"{where!r}: the left of a comparison is a column (score, label, num_tokens, a kept "
        f"field) or scores[label], not {ast.unparse(node)!r}"
    )


def _value(node, where: str) -> tuple:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return ("const", node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return ("const", -node.operand.value)
    if isinstance(node, ast.Name):  # a bare word: `label == en`
        return ("const", node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        return ("list", tuple(_value(v, where)[1] for v in node.elts))
    raise SelectionError(f"{where!r}: {ast.unparse(node)!r} is not a value (a number, a word, or a list of them)")


def _terms(tree: tuple):
    """Every column and value term of the expression, in order."""
    kind = tree[0]
    if kind in ("and", "or"):
        for part in tree[1]:
            yield from _terms(part)
    elif kind == "not":
        yield from _terms(tree[1])
    elif kind == "cmp":
        yield tree[2]
        yield tree[3]


def columns_named(tree: tuple) -> set[str]:
    """Every column the expression reads (``scores`` for scores[label])."""
    return {value if kind == "col" else "scores" for kind, value in _terms(tree) if kind in ("col", "score_of")}


def labels_named(tree: tuple) -> set[str]:
    return {value for kind, value in _terms(tree) if kind == "score_of"}


def evaluate(tree: tuple, row: dict, labels: tuple[str, ...] = ()) -> bool:
    """Whether ``row`` is selected. A comparison with a missing (null) value is false, as in SQL, so a document
    without the kept field is not selected by ``lang == en`` nor by ``lang != en``."""
    kind = tree[0]
    if kind == "and":
        return all(evaluate(t, row, labels) for t in tree[1])
    if kind == "or":
        return any(evaluate(t, row, labels) for t in tree[1])
    if kind == "not":
        return not evaluate(tree[1], row, labels)
    _, op, left, right = tree
    a, b = _get(left, row, labels), _get(right, row, labels)
    if a is None or b is None:
        return False
    try:
        return bool(COMPARISONS[op](a, b))
    except TypeError:  # a kept field of another type than the value compared with: not selected
        return False


def _get(term: tuple, row: dict, labels: tuple[str, ...]):
    kind, value = term
    if kind == "col":
        return row.get(value)
    if kind == "score_of":
        return row["scores"][labels.index(value)]
    return value
