"""Manifest YAML decoded the way the Kubernetes API server decodes it, with limits on what a small file can make it
do, into plain JSON values (the CRD's schema semantics; nothing is coerced later), and written back so that it reads
the same. The manifest loader (`trainingrun.api.manifest`) and `trainingrun validate` (`trainingrun.api.validate`)
read every manifest through `parse_yaml`; what a decoded document must hold is `trainingrun.api.checks`.

* **Limits** (`Limits`): at most 3 MiB of text (the API server's request limit), 100 levels of nesting, 100,000
  values and 8 MiB of scalar text *after* alias expansion (a 1 KB "billion laughs" alias bomb is refused at once,
  not expanded), and at most 64 documents in one file. The parser works from the event stream without recursion,
  so a 5,000-deep nesting is an error line, not a RecursionError.
* **Duplicate keys** in a mapping are an error naming both lines (YAML forbids them; PyYAML keeps the last).
* **Scalars** resolve as in the API server's YAML decoder (YAML 1.1 core types): `true/false/yes/no/on/off/y/n`
  (any case variant the decoder knows) are booleans, `~`/`null`/empty is null, integers are decimal, `0x`, `0o`,
  `0b` or a leading-zero octal (underscores allowed), floats include the exponent form `3e-4`; timestamps stay
  strings. Non-finite numbers (`.inf`, `.nan`, `1e309`) and integers outside int64 are refused: JSON cannot carry
  them. Only the core tags (`!!str`, `!!int`, `!!float`, `!!bool`, `!!null`, `!!map`, `!!seq`) are allowed.
  Merge keys (`<<: *base`) are applied; keys that are not strings become strings as the API server makes them.
* **Positions**: each decoded `Document` knows the line and column of every field, so an error names where the
  offending field is (`FILE:LINE:COL`).

Errors are `ManifestError`s with one line each (`FILE:LINE:COL: message`). `dump_yaml` writes YAML that `parse_yaml`
reads back to the same values (PyYAML's own dumper leaves strings such as `y` or `1e3` unquoted, which a
Kubernetes-style decoder reads as a boolean and a float).
"""

from __future__ import annotations

import copy
import math
import os
import re
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml import events
from yaml.resolver import BaseResolver

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ManifestError(ValueError):
    """A manifest that cannot be used; `lines` are the one-line errors (`FILE:LINE:COL: FIELD: message`)."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines) or ["invalid manifest"]
        super().__init__("\n".join(self.lines))


@dataclass(frozen=True)
class Limits:
    """What one manifest may make the decoder do (defaults: see the module docstring)."""

    max_bytes: int = 3 * 1024 * 1024
    max_depth: int = 100
    max_nodes: int = 100_000
    max_scalar_bytes: int = 8 * 1024 * 1024
    max_documents: int = 64


LIMITS = Limits()


# ------------------------------------------------------------------------------------------------ scalar resolution
_BOOL_TRUE = {"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_BOOL_FALSE = {"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_NULL = {"", "~", "null", "Null", "NULL"}
_INT_RE = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+|0[0-7_]+|0b[01_]+)$")
_FLOAT_RE = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?$")
_SPECIAL_FLOAT_RE = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")

TAG_PREFIX = "tag:yaml.org,2002:"
_CORE_TAGS = {f"{TAG_PREFIX}{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")}


class Resolver(BaseResolver):
    """Implicit tags of plain scalars, as the Kubernetes YAML decoder resolves them (used by loader and dumper)."""

    yaml_implicit_resolvers: dict = {}


Resolver.add_implicit_resolver(
    f"{TAG_PREFIX}bool", re.compile("^(?:" + "|".join(sorted(_BOOL_TRUE | _BOOL_FALSE)) + ")$"),
    list("yYnNtTfFoO"),
)
Resolver.add_implicit_resolver(f"{TAG_PREFIX}null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
Resolver.add_implicit_resolver(f"{TAG_PREFIX}int", _INT_RE, list("-+0123456789"))
Resolver.add_implicit_resolver(f"{TAG_PREFIX}float", _FLOAT_RE, list("-+0123456789."))
Resolver.add_implicit_resolver(f"{TAG_PREFIX}float", _SPECIAL_FLOAT_RE, list("-+."))
Resolver.add_implicit_resolver(f"{TAG_PREFIX}merge", re.compile(r"^<<$"), ["<"])


def _scalar_tag(value: str, implicit: tuple[bool, bool], tag: str | None) -> str:
    """The resolved tag of a scalar event: untagged plain scalars by the resolver, quoted or `!` ones are strings."""
    if tag is None and implicit[0]:
        return _RESOLVER.resolve(yaml.ScalarNode, value, (True, False))
    if tag is None or tag == "!":
        return f"{TAG_PREFIX}str"
    return TAG_PREFIX + tag[2:] if tag.startswith("!!") else tag


_RESOLVER = Resolver()


def _construct_scalar(value: str, tag: str) -> Any:
    """The JSON value of a scalar with its resolved tag; ValueError with what is wrong."""
    kind = tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else tag
    if kind == "str":
        return value
    if kind == "null":
        if value not in _NULL:
            raise ValueError(f"{value!r} is not a null")
        return None
    if kind == "bool":
        if value in _BOOL_TRUE:
            return True
        if value in _BOOL_FALSE:
            return False
        raise ValueError(f"{value!r} is not a boolean")
    if kind == "int":
        if not _INT_RE.match(value):
            raise ValueError(f"{value!r} is not an integer")
        text = value.replace("_", "")
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        if digits.startswith(("0x", "0o", "0b")):
            number = int(digits[2:], {"x": 16, "o": 8, "b": 2}[digits[1]])
        elif len(digits) > 1 and digits.startswith("0"):
            number = int(digits[1:], 8)
        else:
            number = int(digits)
        number *= sign
        if not INT64_MIN <= number <= INT64_MAX:
            raise ValueError(f"integer {value} is out of range (allowed: -2^63 .. 2^63-1)")
        return number
    if kind == "float":
        if _SPECIAL_FLOAT_RE.match(value):
            raise ValueError(f"{value} is not allowed: numbers must be finite (JSON has no infinity or NaN)")
        if not (_FLOAT_RE.match(value) or _INT_RE.match(value)):
            raise ValueError(f"{value!r} is not a number")
        number = float(value.replace("_", ""))
        if not math.isfinite(number):
            raise ValueError(f"{value} is too large: it overflows to infinity (numbers must be finite)")
        return number
    if kind == "merge":
        return _MERGE
    raise ValueError(f"tag {tag!r} is not allowed (allowed: the core tags !!str, !!int, !!float, !!bool, !!null)")


class _MergeKey:
    def __repr__(self) -> str:
        return "<<"


_MERGE = _MergeKey()


def _key_string(key: Any) -> str:
    """A mapping key as the API server's YAML-to-JSON conversion writes it."""
    if isinstance(key, str):
        return key
    if key is None:
        return "null"
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, float) and key.is_integer():
        return str(int(key))
    return str(key)


# ------------------------------------------------------------------------------------------------------ documents
Path_ = tuple[str | int, ...]


@dataclass
class Document:
    """One decoded YAML document: its value (plain JSON types), where each field is, and where it came from."""

    value: Any
    source: str
    index: int  # 1-based position in the stream
    count: int = 1  # documents in the stream
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)  # path -> (line, column), 1-based

    def position(self, path: Iterable[str | int]) -> tuple[int, int] | None:
        """(line, column) of `path`, or of its nearest ancestor that has one."""
        parts = tuple(path)
        while True:
            if parts in self.positions:
                return self.positions[parts]
            if not parts:
                return None
            parts = parts[:-1]

    def where(self, path: Iterable[str | int] = ()) -> str:
        """`FILE:LINE:COL` of a field (`FILE#N` when it has no position in a stream of several documents)."""
        pos = self.position(path)
        if pos is not None:
            return f"{self.source}:{pos[0]}:{pos[1]}"
        return f"{self.source}#{self.index}" if self.count > 1 else self.source


class _Node:
    """A collection being built: its value, its path, and the keys seen (mappings)."""

    __slots__ = ("value", "path", "keys", "merges", "pending_key", "anchor", "start_nodes", "start_bytes", "mark")

    def __init__(self, value: Any, path: Path_, anchor: str | None, nodes: int, nbytes: int, mark: Any):
        self.value = value
        self.path = path
        self.keys: dict[str, int] = {}  # key -> line (mappings)
        self.merges: list[Any] = []
        self.pending_key: Any = None  # mapping: the key whose value comes next (None: expecting a key)
        self.anchor = anchor
        self.start_nodes = nodes
        self.start_bytes = nbytes
        self.mark = mark


_NO_KEY = object()


class _Builder:
    """Builds plain values from PyYAML's event stream (no recursion, no PyYAML constructors), enforcing limits."""

    def __init__(self, source: str, limits: Limits):
        self.source = source
        self.limits = limits

    def error(self, mark: Any, message: str) -> ManifestError:
        where = f"{self.source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self.source
        return ManifestError([f"{where}: {message}"])

    def documents(self, text: str) -> list[Document]:
        loader_cls = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        try:
            return self._documents(yaml.parse(text, Loader=loader_cls))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = exc.problem or exc.context or str(exc).splitlines()[0]
            raise self.error(mark, f"invalid YAML: {problem}") from None
        except yaml.YAMLError as exc:
            raise ManifestError([f"{self.source}: invalid YAML: {str(exc).splitlines()[0]}"]) from None

    def _documents(self, stream: Iterable[events.Event]) -> list[Document]:
        docs: list[Document] = []
        stack: list[_Node] = []
        anchors: dict[str, tuple[Any, int, int, Any]] = {}  # name -> (value, nodes, scalar bytes, mark)
        positions: dict[Path_, tuple[int, int]] = {}
        nodes = nbytes = 0
        root: Any = _NO_KEY
        lim = self.limits

        def place(value: Any, mark: Any, size: tuple[int, int] = (1, 0)) -> None:
            """Put a finished value into the collection on top of the stack (or make it the root)."""
            nonlocal root
            if not stack:
                root = value
                return
            parent = stack[-1]
            if isinstance(parent.value, list):
                parent.value.append(value)
                return
            if parent.pending_key is None:  # this value is a key
                if isinstance(value, (dict, list)):
                    raise self.error(mark, f"{dotted(parent.path) or 'document'}: a mapping key must be a scalar, "
                                           f"got a {'mapping' if isinstance(value, dict) else 'sequence'}")
                if value is _MERGE:
                    parent.pending_key = _MERGE
                    return
                key = _key_string(value)
                if key in parent.keys:
                    raise self.error(mark, f"{dotted(parent.path + (key,))}: duplicate key {key!r} (first at line "
                                           f"{parent.keys[key]}); each key may appear once in a mapping")
                parent.keys[key] = mark.line + 1
                parent.pending_key = key
                positions[parent.path + (key,)] = (mark.line + 1, mark.column + 1)
                return
            key = parent.pending_key
            parent.pending_key = None
            if key is _MERGE:
                sources = value if isinstance(value, list) else [value]
                if not all(isinstance(s, dict) for s in sources):
                    raise self.error(mark, f"{dotted(parent.path) or 'document'}: a merge key (<<) needs a mapping "
                                           "or a list of mappings")
                parent.merges.extend(sources)
                return
            parent.value[key] = value

        def child_path(mark: Any) -> Path_:
            if not stack:
                return ()
            parent = stack[-1]
            if isinstance(parent.value, list):
                path = parent.path + (len(parent.value),)
                positions[path] = (mark.line + 1, mark.column + 1)
                return path
            if parent.pending_key is _MERGE:
                return parent.path  # the fields of a merged mapping land in this one
            if parent.pending_key is None:
                return parent.path + ("<key>",)
            return parent.path + (parent.pending_key,)

        def count(n: int, b: int, mark: Any) -> None:
            nonlocal nodes, nbytes
            nodes += n
            nbytes += b
            if nodes > lim.max_nodes:
                raise self.error(mark, f"the document expands to more than {lim.max_nodes} values (through aliases "
                                       "or sheer size); refused")
            if nbytes > lim.max_scalar_bytes:
                raise self.error(mark, f"the document expands to more than {lim.max_scalar_bytes} bytes of text "
                                       "(through aliases or sheer size); refused")

        def remember(anchor: str | None, value: Any, n: int, b: int, mark: Any) -> None:
            if anchor is not None:
                anchors[anchor] = (value, n, b, mark)

        for event in stream:
            if isinstance(event, events.DocumentStartEvent):
                stack, anchors, positions, root = [], {}, {}, _NO_KEY
                nodes = nbytes = 0
                if len(docs) >= lim.max_documents:
                    raise self.error(event.start_mark, f"more than {lim.max_documents} documents in one file")
            elif isinstance(event, events.DocumentEndEvent):
                value = None if root is _NO_KEY else root
                docs.append(Document(value=value, source=self.source, index=len(docs) + 1, positions=positions))
            elif isinstance(event, events.ScalarEvent):
                mark = event.start_mark
                path = child_path(mark)
                tag = _scalar_tag(event.value, event.implicit, event.tag)
                if tag not in _CORE_TAGS and tag != f"{TAG_PREFIX}merge":
                    raise self.error(mark, f"{dotted(path) or 'value'}: tag {event.tag!r} is not allowed (allowed: "
                                           "the core tags !!str, !!int, !!float, !!bool, !!null, !!map, !!seq)")
                try:
                    value = _construct_scalar(event.value, tag)
                except ValueError as exc:
                    raise self.error(mark, f"{dotted(path) or 'value'}: {exc}") from None
                count(1, len(event.value), mark)
                remember(event.anchor, value, 1, len(event.value), mark)
                place(value, mark)
            elif isinstance(event, (events.MappingStartEvent, events.SequenceStartEvent)):
                mark = event.start_mark
                is_map = isinstance(event, events.MappingStartEvent)
                expected = f"{TAG_PREFIX}{'map' if is_map else 'seq'}"
                tag = event.tag
                if tag is not None and tag != "!" and (TAG_PREFIX + tag[2:] if tag.startswith("!!") else tag) != expected:
                    raise self.error(mark, f"{dotted(child_path(mark)) or 'value'}: tag {tag!r} is not allowed here "
                                           f"(allowed: {'!!map' if is_map else '!!seq'})")
                if len(stack) >= lim.max_depth:
                    raise self.error(mark, f"{dotted(child_path(mark)) or 'value'}: nested more than "
                                           f"{lim.max_depth} levels deep; refused")
                path = child_path(mark)
                count(1, 0, mark)
                stack.append(_Node({} if is_map else [], path, event.anchor, nodes, nbytes, mark))
            elif isinstance(event, (events.MappingEndEvent, events.SequenceEndEvent)):
                node = stack.pop()
                if isinstance(node.value, dict) and node.merges:
                    merged: dict[str, Any] = {}
                    for source in reversed(node.merges):  # earlier sources win over later ones
                        merged.update(source)
                    merged.update(node.value)  # explicit keys win
                    node.value = merged
                remember(node.anchor, node.value, nodes - node.start_nodes + 1, nbytes - node.start_bytes, node.mark)
                place(node.value, node.mark)
            elif isinstance(event, events.AliasEvent):
                mark = event.start_mark
                if event.anchor not in anchors:
                    open_anchor = any(n.anchor == event.anchor for n in stack)
                    raise self.error(mark, f"alias *{event.anchor} " + (
                        "refers to a collection that contains it (recursive alias); refused" if open_anchor
                        else "names no anchor defined before it"))
                value, n, b, _ = anchors[event.anchor]
                count(n, b, mark)  # the expansion counts in full: this is what stops alias bombs
                child_path(mark)
                place(copy.deepcopy(value), mark)
        return docs


def dotted(path: Iterable[str | int]) -> str:
    """A field path as text: spec.trainer.replicas, spec.podTemplate.volumes[0]."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# --------------------------------------------------------------------------------------------------------- parsing
def parse_yaml(text: str | bytes, source: str = "<stdin>", *, limits: Limits = LIMITS) -> list[Document]:
    """Every document of a YAML stream as plain values with field positions; ManifestError (one line) when the
    text is not YAML, exceeds a limit, repeats a key, or holds a value JSON cannot carry."""
    if isinstance(text, bytes):
        if len(text) > limits.max_bytes:
            raise ManifestError([f"{source}: {len(text)} bytes is larger than the {limits.max_bytes} bytes a "
                                 "manifest may have"])
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError([f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason})"]) from None
    if len(text) > limits.max_bytes:
        raise ManifestError([f"{source}: {len(text)} characters is larger than the {limits.max_bytes} a manifest "
                             "may have"])
    docs = _Builder(source, limits).documents(text)
    docs = [d for d in docs if d.value is not None]
    for i, d in enumerate(docs, start=1):
        d.index, d.count = i, len(docs)
    return docs


def read_text(path: str | Path, *, limits: Limits = LIMITS) -> str:
    """The text of a manifest file ('-' is standard input), refusing files over the size limit before reading them
    whole and anything that is not a regular file; ManifestError naming the file."""
    name = str(path)
    if name == "-":
        data = sys.stdin.buffer.read(limits.max_bytes + 1)
    else:
        try:
            # O_NONBLOCK: a FIFO or device at the path must not block the open; it is refused just below.
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise ManifestError([f"{name}: cannot read: {exc.strerror or exc}"]) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError([f"{name}: cannot read: not a regular file"])
            if st.st_size > limits.max_bytes:
                raise ManifestError([f"{name}: {st.st_size} bytes is larger than the {limits.max_bytes} bytes a "
                                     "manifest may have"])
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(limits.max_bytes + 1)
        except OSError as exc:
            raise ManifestError([f"{name}: cannot read: {exc.strerror or exc}"]) from None
        finally:
            os.close(fd)
    if len(data) > limits.max_bytes:
        raise ManifestError([f"{name}: larger than the {limits.max_bytes} bytes a manifest may have"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError([f"{name}: not UTF-8 text (byte {exc.start}: {exc.reason})"]) from None


# --------------------------------------------------------------------------------------------------------- dumping
class Dumper(yaml.emitter.Emitter, yaml.serializer.Serializer, yaml.representer.SafeRepresenter, Resolver):
    """PyYAML's safe dumper with this module's resolver: a string is quoted whenever this loader would read the
    plain form as something else (`"y"`, `"1e3"`, `"0o17"`)."""

    def __init__(self, stream, **kwargs):
        yaml.emitter.Emitter.__init__(self, stream, **{k: kwargs.pop(k) for k in list(kwargs)
                                                       if k in ("canonical", "indent", "width", "allow_unicode",
                                                                "line_break")})
        yaml.serializer.Serializer.__init__(self, **{k: kwargs.pop(k) for k in list(kwargs)
                                                     if k in ("encoding", "explicit_start", "explicit_end",
                                                              "version", "tags")})
        yaml.representer.SafeRepresenter.__init__(self, default_style=kwargs.pop("default_style", None),
                                                  default_flow_style=kwargs.pop("default_flow_style", False),
                                                  sort_keys=kwargs.pop("sort_keys", True))
        Resolver.__init__(self)


def dump_yaml(value: Any, **kwargs: Any) -> str:
    """YAML text that `parse_yaml` reads back as `value` (keyword arguments as for `yaml.dump`)."""
    return yaml.dump(value, Dumper=Dumper, **kwargs)
