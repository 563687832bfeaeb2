"""``output.select.where``: the rows a curation job keeps, as one small expression over a row's columns.

``score >= 3``, ``label in [en, de]``, ``scores[toxic] < 0.1 and num_tokens > 50``, ``not truncated``. The grammar
is Python's expression syntax cut down to comparisons (``== != < <= > >= in``, ``not in``), ``and``, ``or``,
``not``, numbers, quoted or bare words and lists of them; a bare word on the right of a comparison is a string
(``label == en``) as written, character for character (Python's parser would fold ``ﬁne`` into ``fine``: words are
read back from the text), except ``true``, ``false`` and ``null``, which are those values (quote them for the
words); ``scores[name]`` is one label's score. Parsed once at start (no Beam imported: a config is refused fast)
into plain tuples that a worker evaluates, never ``eval``; nested at most ``MAX_DEPTH`` deep.

Logic is SQL's three-valued one: a comparison with a null (a document without the kept field) or with a value of
another type is unknown, ``not`` unknown is unknown, and only a row whose expression is true is selected; so
``not lang == en`` selects what ``lang != en`` does, neither the documents without a lang. ``x == null`` and
``x != null`` ask whether the value is missing, as SQL's IS NULL and IS NOT NULL.
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
LITERALS = {"true": True, "false": False, "null": None}
MAX_DEPTH = 32  # and/or/not nested deeper than a person writes: refused, never a recursion error
MAX_LENGTH = 10_000


class SelectionError(ValueError):
    """An expression output.select.where cannot be: the message names the part and what is allowed."""


def parse(where: str) -> tuple:
    """The expression as nested tuples: ("and"|"or", parts), ("not", part), ("cmp", op, left, right, text),
    ("col", name), ("score_of", label), ("const", value), ("list", values)."""
    if len(where) > MAX_LENGTH:
        raise SelectionError(f"output.select.where is {len(where)} characters, more than {MAX_LENGTH}")
    try:
        tree = ast.parse(where.strip(), mode="eval").body
    except SyntaxError as e:
        shown = where if len(where) <= 120 else where[:100] + f"... ({len(where)} characters)"
        raise SelectionError(f"{shown!r} is not an expression docbeam reads ({e.msg}); {EXAMPLES}") from None
    except (RecursionError, MemoryError):
        raise SelectionError(f"output.select.where is nested deeper than docbeam reads ({MAX_DEPTH} levels)") from None
    return _condition(tree, where.strip(), 0)


def _condition(node, where: str, depth: int) -> tuple:
    if depth > MAX_DEPTH:
        raise SelectionError(f"{where[:80]!r}...: nested deeper than {MAX_DEPTH} levels of and/or/not")
    if isinstance(node, ast.BoolOp):
        return (
            "and" if isinstance(node.op, ast.And) else "or",
            tuple(_condition(v, where, depth + 1) for v in node.values),
        )
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _condition(node.operand, where, depth + 1))
    if isinstance(node, ast.Compare):
        if len(node.ops) != 1:
            raise SelectionError(
                f"{where!r}: one comparison at a time, a column on its left; write a chain as score > 1 and score < 4"
            )
        (op,), (right,) = node.ops, node.comparators
        if type(op) not in COMPARISONS:
            raise SelectionError(f"{where!r}: {type(op).__name__} is not a comparison docbeam reads; {EXAMPLES}")
        value = _value(right, where)
        text = ast.get_source_segment(where, node) or ast.unparse(node)
        if value == ("const", None) and type(op) not in (ast.Eq, ast.NotEq):
            raise SelectionError(f"{where!r}: {text!r}: null is only compared with == or != (is it missing or not)")
        return ("cmp", type(op), _column(node.left, where), value, text)
    if isinstance(node, (ast.Name, ast.Subscript)):  # a boolean column on its own: `truncated`
        return ("cmp", ast.Eq, _column(node, where), ("const", True), ast.get_source_segment(where, node))
    raise SelectionError(f"{where!r}: {ast.unparse(node)!r} is not a condition; {EXAMPLES}")


def _word(node, where: str) -> str:
    """A bare word as the user wrote it: the parser NFKC-folds identifiers, the text does not."""
    return ast.get_source_segment(where, node) or node.id


def _column(node, where: str) -> tuple:
    if isinstance(node, ast.Name):
        return ("col", _word(node, where))
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "scores"
        and isinstance(node.slice, (ast.Name, ast.Constant))
    ):
        label = _word(node.slice, where) if isinstance(node.slice, ast.Name) else node.slice.value
        return ("score_of", str(label))
    raise SelectionError(
        f"{where!r}: the left of a comparison is a column (score, label, num_tokens, a kept "
        f"field) or scores[label], not {ast.unparse(node)!r}"
    )


def _value(node, where: str) -> tuple:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return ("const", node.value)
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return ("const", -node.operand.value)
    if isinstance(node, ast.Name):  # a bare word: `label == en`; true, false and null are those values
        word = _word(node, where)
        return ("const", LITERALS.get(word, word))
    if isinstance(node, (ast.List, ast.Tuple)):
        return ("list", tuple(_value(v, where)[1] for v in node.elts))
    raise SelectionError(f"{where!r}: {ast.unparse(node)!r} is not a value (a number, a word, or a list of them)")


def kind_of(value) -> str:
    """A value's kind as the type check compares them: bool, number, string, null, list or other."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, (list, tuple)) else "other"


def check_types(tree: tuple, kinds: dict[str, str]) -> None:
    """Refuse, naming the clause, a comparison whose value cannot be of its column's kind (``kinds``: column →
    bool|number|string|list|other; a column not in it is not checked): ``num_tokens == eighty``, ``score > high``,
    ``truncated == yes``, ``label in en``."""
    for clause in _clauses(tree):
        _, op, left, right, text = clause
        column = left[1] if left[0] == "col" else f"scores[{left[1]}]"
        kind = "number" if left[0] == "score_of" else kinds.get(left[1])
        if kind in (None, "other", "list") or right == ("const", None):
            continue
        if op in (ast.In, ast.NotIn):
            if right[0] != "list":
                raise SelectionError(f"{text!r}: in takes a list, e.g. {column} in [a, b]")
            values = right[1]
        else:
            values = (right[1],) if right[0] == "const" else None
            if values is None:
                raise SelectionError(f"{text!r}: {column} is compared with one value, not a list")
        wrong = [v for v in values if kind_of(v) != kind]
        if wrong:
            raise SelectionError(
                f"{text!r}: {column} is a {kind} column, {wrong[0]!r} is a {kind_of(wrong[0])}; no row would ever "
                "meet it" + ("; quote a word, or write true or false" if kind == "bool" else "")
            )
        if kind == "bool" and op not in (ast.Eq, ast.NotEq, ast.In, ast.NotIn):
            raise SelectionError(f"{text!r}: {column} is true or false; compare it with == or !=")


def _clauses(tree: tuple):
    if tree[0] in ("and", "or"):
        for part in tree[1]:
            yield from _clauses(part)
    elif tree[0] == "not":
        yield from _clauses(tree[1])
    else:
        yield tree


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
    """Whether ``row`` is selected: its expression is true (not false, not unknown)."""
    return truth(tree, row, labels) is True


def truth(tree: tuple, row: dict, labels: tuple[str, ...] = ()) -> bool | None:
    """The expression's value on ``row`` in three-valued logic: None where it is unknown (a null or another type)."""
    kind = tree[0]
    if kind == "and":
        values = [truth(t, row, labels) for t in tree[1]]
        return False if False in values else None if None in values else True
    if kind == "or":
        values = [truth(t, row, labels) for t in tree[1]]
        return True if True in values else None if None in values else False
    if kind == "not":
        value = truth(tree[1], row, labels)
        return None if value is None else not value
    _, op, left, right, _text = tree
    a, b = _get(left, row, labels), _get(right, row, labels)
    if right == ("const", None):  # x == null / x != null: whether it is missing
        return (a is None) == (op is ast.Eq)
    if a is None or b is None:
        return None
    if op in (ast.In, ast.NotIn):
        if any(kind_of(v) != kind_of(a) for v in b):
            b = [v for v in b if kind_of(v) == kind_of(a)]
        return bool(COMPARISONS[op](a, b))
    if kind_of(a) != kind_of(b):  # a kept field of another type than the value: unknown, never a crash
        return None
    try:
        return bool(COMPARISONS[op](a, b))
    except TypeError:
        return None


def _get(term: tuple, row: dict, labels: tuple[str, ...]):
    kind, value = term
    if kind == "col":
        return row.get(value)
    if kind == "score_of":
        return row["scores"][labels.index(value)]
    return value
