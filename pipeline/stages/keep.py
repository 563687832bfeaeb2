"""input.keep_fields: which JSONL fields travel to the output rows, and the Arrow type of each column.

Parquet needs every column's type before the first row is written, while JSON's types vary per record. So the
driver reads a sample (the first SAMPLE_RECORDS documents) and gives each kept field the one Arrow type that
holds every sampled value exactly (``infer_type``), or JSON text where none does. On the workers each record's
value is checked against its column (``value_problem``): a value that does not fit is never converted into
something else; its document is a ``kept_field_type`` rejection naming the field. docs/outputs.md explains it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Iterable

import pyarrow as pa

from docbeam.config import ConfigError, InputConfig
from docbeam.models.heads import KIND_COLUMNS, SHARED_COLUMNS

SAMPLE_RECORDS = 1000  # documents the driver reads to type the kept columns
# Lists and objects a kept value may nest: deeper ones are rejected. Typing, checking and pickling a column's
# type recurse once per level (a struct 450 deep failed the run when Beam pickled the plan); real records nest
# a handful of levels.
MAX_DEPTH = 64
JSON = "json"  # a column of JSON text: what a field gets when no one Arrow type holds every sampled value
EXACT_FLOAT_INT = 2**53  # integers up to this size are exact in a float64 column
# Every column docbeam writes itself (document rows, and chunk rows of output.granularity: chunk), any head's
# columns included; a kept field of one of these names would overwrite one, or be read as one by a sink.
OUTPUT_COLUMNS = (
    *SHARED_COLUMNS,
    *KIND_COLUMNS.values(),
    "document_id",
    "chunk_index",
    "char_start",
    "char_end",
    "chunk_text",
)


@dataclasses.dataclass(frozen=True)
class KeptColumn:
    name: str
    arrow: pa.DataType | None  # None: JSON text (a string column)

    def describe(self) -> str:
        """The type as the manifest records it: ``json``, or Arrow's name (``int64``, ``list<item: string>``)."""
        return JSON if self.arrow is None else str(self.arrow)

    def field(self) -> pa.Field:
        return pa.field(self.name, pa.string() if self.arrow is None else self.arrow)


@dataclasses.dataclass(frozen=True)
class KeptFields:
    """The plan's kept columns, in output order, and how they were chosen; handed to the parser as it is."""

    columns: tuple[KeptColumn, ...] = ()
    sampled: int = 0  # documents the types were inferred from
    every_field: bool = False  # input.keep_fields was "*": the columns are the fields the sample held

    def describe(self) -> dict:
        return {c.name: c.describe() for c in self.columns}

    def fields(self) -> tuple[pa.Field, ...]:
        return tuple(c.field() for c in self.columns)

    def take(self, record: dict) -> tuple[tuple[str, object], ...] | str:
        """``(name, value)`` per column as it is written (JSON text for a JSON column; a missing field and a
        JSON null are null), or why the record's value does not fit its column."""
        taken = []
        for column in self.columns:
            value = record.get(column.name)
            unkept = unkeepable(value)
            if unkept:
                return f"field {column.name!r} (input.keep_fields) {unkept}; the document is not embedded"
            problem = value_problem(value, column.arrow)
            if problem:
                return (
                    f"field {column.name!r} (input.keep_fields) {problem}, but its column is "
                    f"{column.describe()}, typed from the first {self.sampled} documents; it is not changed "
                    "to fit: make the field's type the same in every record"
                )
            if column.arrow is None and value is not None:
                value = json.dumps(value, ensure_ascii=False)
            taken.append((column.name, value))
        return tuple(taken)


@dataclasses.dataclass(frozen=True)
class EveryField:
    """What the driver's sample takes of each record: every field but the id and the text, unchecked."""

    id_field: str
    text_field: str

    def take(self, record: dict) -> tuple[tuple[str, object], ...]:
        return tuple((k, v) for k, v in record.items() if k not in (self.id_field, self.text_field))


def with_kept(row: dict, kept: Iterable[tuple[str, object]]) -> dict:
    """``row`` with a document's kept fields (``Document.kept``) added: every output row is built with this."""
    return {**row, **dict(kept)}


def name_problems(names: Iterable[str], id_field: str, text_field: str) -> list[str]:
    """Why each of ``names`` cannot be a kept column: it would overwrite an output column, or it is the id or
    the text, which the output holds already (as ``id``) or does not hold as a field."""
    problems = []
    for name in names:
        if not name or not name.strip():
            problems.append(f"{name!r}, an empty field name, cannot name a column")
        elif name in OUTPUT_COLUMNS:
            problems.append(
                f"{name!r} is the name of an output column, which it would overwrite (docbeam writes "
                f"{', '.join(OUTPUT_COLUMNS)})"
            )
        elif name == id_field:
            problems.append(f"{name!r} is input.id_field: every row holds it already, as the column id")
        elif name == text_field:
            problems.append(f"{name!r} is input.text_field: the text is embedded, not kept")
    return problems


def infer_type(values: list) -> pa.DataType | None:
    """The Arrow type that holds every one of ``values`` (nulls aside) so that it reads back equal, or None
    (JSON text): no non-null value, or kinds no one type holds (a string and a number, objects whose keys
    differ). Integers mixed with fractions make float64, JSON having one number type (1 reads back 1.0)."""
    present = [v for v in values if v is not None]
    kinds = {_kind(v) for v in present}
    if not kinds:
        return None
    if kinds == {"bool"}:
        return pa.bool_()
    if kinds == {"str"}:
        return pa.string()
    if kinds == {"int"}:
        return pa.int64() if all(-(2**63) <= v < 2**63 for v in present) else None
    if kinds == {"float"}:
        return pa.float64()
    if kinds == {"int", "float"}:
        return pa.float64() if all(isinstance(v, float) or abs(v) <= EXACT_FLOAT_INT for v in present) else None
    if kinds == {"list"}:
        item = infer_type([item for v in present for item in v])
        # Named as Parquet's compliant LIST names it (write.py writes so): the manifest says what a reader gets.
        return None if item is None else pa.list_(pa.field("element", item))
    if kinds == {"dict"}:
        keys = [tuple(v) for v in present]
        if not keys[0] or any(set(k) != set(keys[0]) for k in keys):
            return None  # a key some objects lack would read back as null: not the same object
        types = [(k, infer_type([v[k] for v in present])) for k in keys[0]]
        return None if any(t is None for _, t in types) else pa.struct(types)
    return None


def unkeepable(value) -> str | None:
    """Why ``value`` is kept in no column, or None: it nests lists and objects deeper than MAX_DEPTH, or holds a
    number JSON text cannot hold (``1e400`` parses as infinity, ``NaN`` as itself: Parquet would store either,
    but no JSON reader of the output, and no sink, could take it). Walked level by level, without recursion."""
    depth, level, non_finite = 0, [value], None
    while level:
        non_finite = non_finite or next((v for v in level if isinstance(v, float) and not math.isfinite(v)), None)
        containers = [v for v in level if isinstance(v, (list, dict))]
        depth += bool(containers)
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    if depth > MAX_DEPTH:
        return f"nests {depth} lists or objects deep; a kept field may nest at most {MAX_DEPTH}"
    if non_finite is not None:
        return f"is a number JSON text cannot hold ({json.dumps(non_finite)})"
    return None


def value_problem(value, arrow: pa.DataType | None) -> str | None:
    """Why ``value`` does not read back equal from a column of type ``arrow`` (None: JSON text), or None."""
    bad_text = _lone_surrogate(value)
    if bad_text:
        return bad_text
    if value is None or arrow is None:
        return None
    kind = _kind(value)
    fits = _FITS[kind](value, arrow)
    if fits and kind == "list":
        return next((f"holds an item that {p}" for p in (value_problem(v, arrow.value_type) for v in value) if p), None)
    if fits and kind == "dict":
        names = [arrow.field(i).name for i in range(arrow.num_fields)]
        if set(value) != set(names):
            return f"is an object with the keys {sorted(value)}, not {sorted(names)}"
        problems = ((n, value_problem(value[n], arrow.field(n).type)) for n in names)
        return next((f"holds under {n!r} a value that {p}" for n, p in problems if p), None)
    return None if fits else f"is {_shown(value)}"


_FITS = {  # kind → whether a value of that kind reads back equal from the column (lists and objects: their shape)
    "bool": lambda v, arrow: pa.types.is_boolean(arrow),
    "str": lambda v, arrow: pa.types.is_string(arrow),
    "int": lambda v, arrow: (
        pa.types.is_int64(arrow) and -(2**63) <= v < 2**63 or pa.types.is_float64(arrow) and abs(v) <= EXACT_FLOAT_INT
    ),
    "float": lambda v, arrow: pa.types.is_float64(arrow),
    "list": lambda v, arrow: pa.types.is_list(arrow),
    "dict": lambda v, arrow: pa.types.is_struct(arrow),
}


def _kind(value) -> str:
    # bool before int: JSON's true is not the number 1
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list), ("dict", dict)):
        if isinstance(value, types):
            return kind
    raise TypeError(f"not a JSON value: {type(value).__name__}")


KIND_NAMES = {
    "bool": "a boolean",
    "int": "an integer",
    "float": "a fraction",
    "str": "a string",
    "list": "a list",
    "dict": "an object",
}


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return f"{KIND_NAMES[_kind(value)]} ({text if len(text) <= 40 else text[:37] + '...'})"


def _lone_surrogate(value) -> str | None:
    """A string (or object key) JSON's ``\\ud800`` escapes left without a pair: not text, and Parquet stores
    only UTF-8."""
    texts = [value] if isinstance(value, str) else []
    if isinstance(value, (list, dict)):
        texts = [json.dumps(value, ensure_ascii=False)]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"holds a lone UTF-16 surrogate ({ascii(text[e.start])}), which is not text"
    return None


def plan_columns(config: InputConfig, sample: Callable[[], list[dict]] | None) -> KeptFields:
    """input.keep_fields resolved on the driver: names checked, ``"*"`` expanded and every column typed from
    ``sample()``, the first SAMPLE_RECORDS documents' fields (pipeline/stages/read.py sample_records), read
    only once the names pass. ``sample`` None (a dry run, which reads no input): the listed fields as JSON
    text, none for ``"*"``."""
    wanted = config.keep_fields
    if not wanted:
        return KeptFields()
    if config.format == "text":
        raise ConfigError(
            f"input.keep_fields={_listed(wanted)} with input.format: text: a text file has no "
            "fields to keep; use JSONL input, or remove input.keep_fields"
        )
    every_field = wanted == "*"
    problems = [] if every_field else name_problems(wanted, config.id_field, config.text_field)
    if problems:
        raise ConfigError(
            f"input.keep_fields: {'; '.join(problems)}. Remove it from the list (or rename the field in the input)"
        )
    if sample is None:
        return KeptFields(tuple(KeptColumn(name, None) for name in (() if every_field else wanted)), 0, every_field)
    sample = sample()
    names = list(dict.fromkeys(k for r in sample for k in r)) if every_field else list(wanted)
    problems = name_problems(names, config.id_field, config.text_field)
    if problems:
        raise ConfigError(
            f'input.keep_fields: "*" takes every field of the input, but {"; ".join(problems)}. '
            'List the fields to keep instead of "*"'
        )
    # A value the workers will reject (unkeepable) types nothing: the column is what the kept values need.
    columns = tuple(
        KeptColumn(n, infer_type([v for v in (r.get(n) for r in sample) if not unkeepable(v)])) for n in names
    )
    return KeptFields(columns, len(sample), every_field)


def _listed(wanted) -> str:
    return json.dumps(wanted if wanted == "*" else list(wanted))
