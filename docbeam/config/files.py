"""Config files that extend another: ``extends: local.yaml`` shares one base between job profiles.

A profile states only what differs from its base, so the Dataflow profiles cannot drift from the local
job they were tested as. Sections merge key by key; a list or a scalar replaces the base's. Relative paths
are resolved against the folder of the file that sets them, before merging, so a base in another folder
keeps meaning what it meant there. Refused, naming the file and the key: a base that does not exist, a
cycle, a key that neither the base nor the schema knows (a typo that would otherwise merge silently), and a
section replaced by a scalar or the reverse.
"""

from __future__ import annotations

import datetime
import json
import os
import re

import yaml

from docbeam.errors import ConfigError, readable  # noqa: F401  (config_files.ConfigError for callers)
from docbeam.pipeline.store.paths import is_remote

EXTENDS = "extends"
PATH_KEYS = (
    ("input", "path"),
    ("input", "reuse_from"),
    ("output", "path"),
    ("model", "path"),
    ("runner", "compilation_cache"),
)
# Mappings whose keys are free: Beam's option names (checked against Beam later), worker environment
# variables, and per-backend attention options (checked against the registry later).
OPEN_SECTIONS = (("runner", "options"), ("runner", "worker_env"), ("attention",))


def resolve_path(path: str, base_dir: str) -> str:
    """Relative paths are relative to the config file's folder, so a config works from any cwd."""
    if is_remote(path) or path.startswith("pkg:") or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


class ConfigLoader(yaml.SafeLoader):
    """YAML as a config means it, not as YAML 1.1 guesses: only true and false are booleans (``precision_gate:
    off`` stays the string "off", as every option whose values include off, on, yes or no needs); a key given
    twice in one mapping is refused (the second would silently win); an alias to its own ancestor (a recursive
    anchor) and more than ``MAX_ALIASES`` aliases (a "billion laughs" file, whose shared references expand
    exponentially when the config is walked) are refused. Dates are refused after loading (``no_dates``)."""

    MAX_ALIASES = 64

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0
        self._open_anchors: list[str | None] = []

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if event.anchor in self._open_anchors:
                raise yaml.composer.ComposerError(
                    None, None, f"alias *{event.anchor} refers to a node that contains it", event.start_mark
                )
            if self._aliases > self.MAX_ALIASES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {self.MAX_ALIASES} aliases; a config needs few", event.start_mark
                )
            return super().compose_node(parent, index)
        self._open_anchors.append(getattr(event, "anchor", None))
        try:
            return super().compose_node(parent, index)
        finally:
            self._open_anchors.pop()

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice in one mapping (lines {seen[key] + 1} and "
                        f"{key_node.start_mark.line + 1}); keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text):
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506  ConfigLoader is a SafeLoader


def no_dates(tree, source: str, _key: tuple[str, ...] = ()):
    """``tree`` as it is, refused where YAML read a date (an unquoted 2026-12-06): no config key takes one."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            no_dates(value, source, (*_key, str(key)))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            no_dates(value, source, (*_key, str(i)))
    elif isinstance(tree, (datetime.date, datetime.datetime)):
        raise ConfigError(
            f"{source}: {'.'.join(_key)}: YAML reads {tree.isoformat()} as a date; quote it ('{tree.isoformat()}') "
            "if it is a string"
        )
    return tree


def read_yaml(path: str):
    try:
        with open(path) as f:
            return no_dates(parse_yaml(f), path)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found; try configs/local.yaml") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load_layers(path: str, schema, _chain: tuple[str, ...] = ()) -> dict:
    """The raw tree of ``path`` merged over its ``extends`` chain, paths resolved per file. ``schema`` (the
    pydantic model of the whole config) says which keys a profile may add that its base lacks."""
    path = os.path.abspath(path)
    if path in _chain:
        cycle = " -> ".join(os.path.relpath(p) for p in (*_chain, path))
        raise ConfigError(
            f"{_chain[-1]}: extends forms a cycle ({cycle}); a profile must end at a file "
            "without `extends`, e.g. configs/local.yaml"
        )
    raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (input, output, model, ...), got {raw!r}")
    raw = resolve_paths(raw, os.path.dirname(path))
    base_name = raw.pop(EXTENDS, None)
    if base_name is None:
        return raw
    if not isinstance(base_name, str) or not base_name.strip():
        raise ConfigError(
            f"{path}: extends: expected the path of a base config file, e.g. local.yaml (got {base_name!r})"
        )
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), os.path.expanduser(base_name)))
    if not os.path.isfile(base_path):
        raise ConfigError(
            f"{path}: extends: {base_name!r} is not a file (looked for {base_path}); the path is "
            "relative to the file that names it"
        )
    base = load_layers(base_path, schema, (*_chain, path))
    return merge(base, raw, schema, source=path, base_source=base_path)


def merge(base: dict, child: dict, schema, *, source: str, base_source: str, _key: tuple[str, ...] = ()) -> dict:
    merged = dict(base)
    for key, value in child.items():
        dotted = ".".join((*_key, str(key)))
        if key not in base:
            if not _schema_knows(schema, (*_key, str(key))):
                raise ConfigError(
                    f"{source}: {dotted}: unknown key (its base {base_source} does not have it and "
                    f"it is no config key{_known_hint(schema, _key)})"
                )
            merged[key] = value
            continue
        old = base[key]
        if isinstance(old, dict) and isinstance(value, dict):
            merged[key] = merge(old, value, schema, source=source, base_source=base_source, _key=(*_key, str(key)))
        elif isinstance(old, dict) != isinstance(value, dict) and old is not None and value is not None:
            kind = "a section" if isinstance(old, dict) else f"the value {old!r}"
            raise ConfigError(
                f"{source}: {dotted}: {value!r} would replace {kind} from {base_source}; "
                f"set the keys inside {dotted} instead"
            )
        else:
            merged[key] = value
    return merged


def _section_model(schema, key: tuple[str, ...]):
    """The pydantic model of the section at ``key``, or None when ``key`` is not a section."""
    model = schema
    for part in key:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if field is None or not isinstance(annotation, type) or not hasattr(annotation, "model_fields"):
            return None
        model = annotation
    return model


def _schema_knows(schema, key: tuple[str, ...]) -> bool:
    if any(key[: len(open_key)] == open_key and len(key) > len(open_key) for open_key in OPEN_SECTIONS):
        return True
    model = _section_model(schema, key[:-1])
    return model is not None and key[-1] in model.model_fields


def _known_hint(schema, key: tuple[str, ...]) -> str:
    model = _section_model(schema, key)
    return f"; keys of {'.'.join(key) or 'the top level'}: {', '.join(model.model_fields)}" if model else ""


def resolve_paths(raw: dict, base_dir: str) -> dict:
    """Relative paths under PATH_KEYS made absolute against ``base_dir`` (the folder of the file); each entry
    of a comma-separated input.path on its own."""
    out = dict(raw)
    for section, key in PATH_KEYS:
        values = out.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        # "~" alone (the home folder) is left for the output check to refuse, not resolved past it.
        if isinstance(value, str) and value.strip().rstrip("/") not in ("", "~"):
            parts = [p.strip() for p in value.split(",")] if (section, key) == ("input", "path") else [value]
            out[section] = {**values, key: ",".join(resolve_path(p, base_dir) if p else p for p in parts)}
    return out


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``--set a.b=value`` on the raw YAML tree; the value is parsed as YAML (so 2, true, [1,2] work), and
    a relative path is made absolute against the current folder."""
    raw = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set attention.backend=flash")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is {child!r}, not a section")
            node = child
        # A path is a string whatever YAML would make of it (`~` is not null, `2026-11-30` not a date), and a
        # relative one is relative to the folder the command runs in, as a shell user expects (the file's own
        # paths stay relative to the file).
        if tuple(key.split(".")) in PATH_KEYS:
            node[leaf] = resolve_paths({parents[0]: {leaf: value}}, os.getcwd())[parents[0]][leaf]
        else:
            node[leaf] = _parse_value(item, value)
    return raw


def _parse_value(item: str, value: str):
    """YAML scalars and lists (2, true, [64, 128], null); anything YAML would turn into another type
    (a date, say) or cannot parse (a glob like *.jsonl) stays the string that was typed."""
    try:
        parsed = parse_yaml(value)
    except yaml.YAMLError:
        return value
    if parsed is None and value.strip() not in ("null", "~", ""):
        return value
    return parsed if isinstance(parsed, (str, int, float, bool, list, dict, type(None))) else value
