"""The operator's incident file (``incident.yaml``): what the audit cannot know.

Who reports (organisation, contact point, DPO), when the incident was detected, declared, mitigated
and fixed, what was done about it, the likely consequences, which accounts to exclude and why, and
optional display names of tenants. ``docs/incident.example.yaml`` shows every field. Errors name the
file and the field: ``incident.yaml: field 'detected_at': not an ISO 8601 UTC time``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from kvtrail.errors import KvtrailError
from kvtrail.forensics.analysis import Exclusions
from kvtrail.timeutil import format_utc, utc_ns

TIME_FIELDS = ("detected_at", "declared_at", "mitigated_at", "fixed_at")
_TEXT = ("organisation", "incident_id", "title", "detection", "likely_consequences")
_LISTS = ("measures_taken", "remediation", "data_categories")
_KNOWN = set(TIME_FIELDS) | set(_TEXT) | set(_LISTS) | {"contact", "dpo", "timeline", "exclusions", "tenant_names"}
_EXCLUSION_KINDS = ("tenants", "api_key_ids", "request_ids")
MAX_FILE_BYTES = 1 << 20  # an incident file is a page or two of text: anything bigger is a mistake or an attack
_MAX_DEPTH = 16
_PLAIN_TAGS = (None, "tag:yaml.org,2002:str")  # what a plain or `!!str` value carries; every other tag is refused


@dataclass(frozen=True)
class Contact:
    """A contact point: at least a name, an e-mail address or a phone number."""

    name: str | None = None
    email: str | None = None
    phone: str | None = None

    def __str__(self) -> str:
        return ", ".join(x for x in (self.name, self.email, self.phone) if x)


@dataclass(frozen=True)
class IncidentContext:
    """Everything the operator supplies for a disclosure report (times in UTC ns)."""

    organisation: str
    contact: Contact
    dpo: Contact | None = None
    incident_id: str | None = None
    title: str | None = None
    detected_at: int | None = None
    declared_at: int | None = None
    mitigated_at: int | None = None
    fixed_at: int | None = None
    detection: str | None = None
    timeline: tuple[tuple[int, str], ...] = ()
    measures_taken: tuple[str, ...] = ()
    remediation: tuple[str, ...] = ()
    likely_consequences: str | None = None
    data_categories: tuple[str, ...] = ()
    exclusions: Exclusions = field(default_factory=Exclusions)
    tenant_names: tuple[tuple[str, str], ...] = ()

    def display_name(self, tenant: str) -> str:
        names = dict(self.tenant_names)
        return f"{names[tenant]} ({tenant})" if tenant in names else tenant

    def to_dict(self) -> dict:
        """JSON-ready form for the report manifest (times as UTC strings)."""
        out = {}
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if name in TIME_FIELDS:
                v = format_utc(v) if v is not None else None
            elif isinstance(v, Contact):
                v = {"name": v.name, "email": v.email, "phone": v.phone}
            elif name == "timeline":
                v = [{"at": format_utc(t), "what": w} for t, w in v]
            elif name == "exclusions":
                v = v.to_dict()
            elif name == "tenant_names":
                v = dict(v)
            elif isinstance(v, tuple):
                v = list(v)
            out[name] = v
        return out


def _err(source: str, name: str, reason: str) -> KvtrailError:
    # field names can be the file's own keys: keep the message one short line whatever they hold
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in name)
    return KvtrailError(f"{source}: field '{shown[:80] + '...' if len(shown) > 80 else shown}': {reason}")


def _time(value, source: str, name: str) -> int:
    """A UTC instant: an ISO 8601 time with an explicit offset (``Z`` or ``+00:00``)."""
    bad = _err(source, name, "not an ISO 8601 UTC time (e.g. 2026-09-08T23:11:00Z)")
    if isinstance(value, datetime):  # YAML itself parses unquoted timestamps
        dt = value
    elif isinstance(value, str):
        raw = value.strip()
        try:
            dt = datetime.fromisoformat(raw[:-1] + "+00:00" if raw.endswith("Z") else raw)
        except ValueError:
            raise bad from None
    else:
        raise bad
    if dt.tzinfo is None:  # a local time is ambiguous in a legal document: insist on the offset
        raise bad
    return utc_ns(dt, field=f"{source}: field '{name}'")


def _text(value, source: str, name: str) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not str(value).strip():
        raise _err(source, name, "must be a non-empty string")
    return str(value).strip()


def _texts(value, source: str, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _err(source, name, "must be a list of strings")
    return tuple(_text(v, source, f"{name}[{i}]") for i, v in enumerate(value))


def _contact(value, source: str, name: str) -> Contact:
    if isinstance(value, str):
        return Contact(name=_text(value, source, name))
    if not isinstance(value, dict):
        raise _err(source, name, "must be a mapping with name, email and/or phone")
    extra = set(value) - {"name", "email", "phone"}
    if extra:
        raise _err(source, f"{name}.{sorted(extra)[0]}", "unknown field (known: name, email, phone)")
    c = Contact(**{k: _text(v, source, f"{name}.{k}") for k, v in value.items() if v is not None})
    if c.email is not None and "@" not in c.email:
        raise _err(source, f"{name}.email", f"{c.email!r} is not an e-mail address")
    if not (c.name or c.email or c.phone):
        raise _err(source, name, "needs a name, email or phone")
    return c


def exclusions_from_mapping(data, source: str, prefix: str = "") -> Exclusions:
    """``{tenants: [{id, reason}], api_key_ids: [...], request_ids: [...]}`` as :class:`Exclusions`."""
    if data is None:
        return Exclusions()
    if not isinstance(data, dict):
        raise _err(source, prefix.rstrip(".") or "exclusions", f"must be a mapping with {', '.join(_EXCLUSION_KINDS)}")
    extra = set(data) - set(_EXCLUSION_KINDS)
    if extra:
        raise _err(source, f"{prefix}{sorted(extra)[0]}", f"unknown field (known: {', '.join(_EXCLUSION_KINDS)})")
    parts, sources = [], []
    for kind in _EXCLUSION_KINDS:
        entries = data.get(kind) or []
        if not isinstance(entries, list):
            raise _err(source, f"{prefix}{kind}", "must be a list of {id, reason}")
        out = []
        for i, e in enumerate(entries):
            where = f"{prefix}{kind}[{i}]"
            if not isinstance(e, dict) or set(e) - {"id", "reason"} or "id" not in e:
                raise _err(source, where, "must be a mapping with 'id' and 'reason'")
            if "reason" not in e:  # every exclusion changes the counts a regulator reads: say why
                raise _err(source, f"{where}.reason", "required: say why this is excluded")
            out.append((_text(e["id"], source, f"{where}.id"), _text(e["reason"], source, f"{where}.reason")))
            if kind == "tenants":
                sources.append((out[-1][0], f"{source}: {where}"))
        parts.append(tuple(sorted(dict(out).items())))
    tenants, keys, requests = parts
    return Exclusions(tenants, keys, requests, sources=tuple(sorted(dict(reversed(sources)).items())))


class _StrictLoader(yaml.SafeLoader):
    """``safe_load`` without anchors and aliases (one alias chain expands a 10 KB file into gigabytes), explicit
    tags or deep nesting; it tracks the field being read so that each refusal names it."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self.path: list[str] = []

    def _refuse(self, reason: str) -> KvtrailError:
        where = "".join(self.path).lstrip(".")
        mark = self.peek_event().start_mark
        return (
            _err(self.source, where, reason)
            if where
            else KvtrailError(f"{self.source}: line {mark.line + 1}: {reason}")
        )

    def compose_node(self, parent, index):
        event = self.peek_event()
        step = (
            f".{index.value}" if isinstance(index, yaml.ScalarNode) else f"[{index}]" if isinstance(index, int) else ""
        )
        self.path.append(step)
        try:
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise self._refuse("YAML anchors and aliases (&name, *name) are not supported")
            tag = getattr(event, "tag", None)
            if tag not in _PLAIN_TAGS:
                shown = str(tag).replace("tag:yaml.org,2002:", "!!")
                raise self._refuse(f"unsupported YAML tag {shown[:60]!r} (only plain values, lists and mappings)")
            if len(self.path) > _MAX_DEPTH:
                raise self._refuse(f"nested deeper than {_MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.path.pop()

    def _at(self, node, reason: str) -> KvtrailError:
        return KvtrailError(f"{self.source}: line {node.start_mark.line + 1}: {reason}")

    def construct_mapping(self, node, deep=False):
        """A mapping that names a key twice is refused (YAML would keep the last value silently)."""
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise self._at(key_node, "a mapping key must be a plain value") from None
                if key in seen:
                    raise self._at(key_node, f"duplicate key {str(key)[:60]!r}")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_bounded_int(self, node):
        """An integer beyond Python's conversion limit (thousands of digits) is refused, not a traceback."""
        try:
            return self.construct_yaml_int(node)
        except ValueError:
            raise self._at(node, f"an integer of {len(str(node.value))} characters is too long") from None

    def construct_lenient_timestamp(self, node):
        """A timestamp-shaped value that is no valid date (2026-02-30) stays a string, for the field to refuse."""
        try:
            return self.construct_yaml_timestamp(node)
        except ValueError:
            return self.construct_scalar(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", _StrictLoader.construct_lenient_timestamp)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_bounded_int)


def _load_yaml(path: str | Path):
    p = Path(path)
    if not p.is_file():
        raise KvtrailError(f"{p.name}: file not found: {path}")
    with p.open("rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise KvtrailError(f"{p.name}: larger than the limit of {MAX_FILE_BYTES // (1 << 20)} MiB")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise KvtrailError(f"{p.name}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    loader = _StrictLoader(text, p.name)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise KvtrailError(f"{p.name}: not valid YAML{where}") from None
    finally:
        loader.dispose()


def load_exclusions(path: str | Path) -> Exclusions:
    """An exclusion file: the ``exclusions`` mapping of incident.yaml on its own."""
    return exclusions_from_mapping(_load_yaml(path) or {}, Path(path).name)


def parse_context(data, source: str = "incident.yaml") -> IncidentContext:
    """Validate a parsed incident file; errors name the field."""
    if not isinstance(data, dict):
        raise KvtrailError(f"{source}: must be a mapping of fields (organisation, contact, ...)")
    extra = sorted(set(data) - _KNOWN)
    if extra:
        raise _err(source, extra[0], f"unknown field (known: {', '.join(sorted(_KNOWN))})")
    for required in ("organisation", "contact"):
        if data.get(required) is None:
            raise _err(source, required, "required")
    kw: dict = {
        "organisation": _text(data["organisation"], source, "organisation"),
        "contact": _contact(data["contact"], source, "contact"),
    }
    if data.get("dpo") is not None:
        kw["dpo"] = _contact(data["dpo"], source, "dpo")
    for name in _TEXT[1:]:
        if data.get(name) is not None:
            kw[name] = _text(data[name], source, name)
    for name in TIME_FIELDS:
        if data.get(name) is not None:
            kw[name] = _time(data[name], source, name)
    for name in _LISTS:
        if data.get(name) is not None:
            kw[name] = _texts(data[name], source, name)
    timeline = data.get("timeline") or []
    if not isinstance(timeline, list):
        raise _err(source, "timeline", "must be a list of {at, what}")
    entries = []
    for i, e in enumerate(timeline):
        if not isinstance(e, dict) or set(e) != {"at", "what"}:
            raise _err(source, f"timeline[{i}]", "must be a mapping with 'at' and 'what'")
        entries.append((_time(e["at"], source, f"timeline[{i}].at"), _text(e["what"], source, f"timeline[{i}].what")))
    kw["timeline"] = tuple(sorted(entries))
    kw["exclusions"] = exclusions_from_mapping(data.get("exclusions"), source, "exclusions.")
    names = data.get("tenant_names") or {}
    if not isinstance(names, dict):
        raise _err(source, "tenant_names", "must be a mapping of tenant id to display name")
    kw["tenant_names"] = tuple(sorted((str(k), _text(v, source, f"tenant_names.{k}")) for k, v in names.items()))
    return IncidentContext(**kw)


def load_context(path: str | Path) -> IncidentContext:
    """Read and validate an incident file (YAML, loaded with ``safe_load``)."""
    return parse_context(_load_yaml(path), Path(path).name)
