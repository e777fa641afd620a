"""Topology specs: what a user writes in ``topologies/*.yaml``, validated by pydantic.

How it fits: ``load_topology`` turns a YAML file into a ``Topology``; ``network.py`` builds
that topology out of namespaces, bridges and shaped WAN links; ``fidelity.py`` measures it
against the numbers here.  Nothing is created until a spec has passed validation, and a
bad file raises ``SpecError`` whose message is one line: the file, the field, the problem.

A WAN link joins two DCs.  Its parameters (one-way delay, jitter, loss, rate, queue) apply
to the direction ``a -> b``; ``reverse`` overrides any of them for ``b -> a`` (asymmetric
links), otherwise ``b -> a`` is the same.  ``delay_ms`` is always one-way: a link built from
a measured round trip (the AWS matrix) carries half of it each way and records the measured
figure as ``source_rtt_ms``, which ``testbed fidelity`` and every run's WAN check compare
against.

Files are read strictly: a value of the wrong type is an error, not coerced (``hosts: "2"``,
``cpus: true``), as are infinities and NaN, a key given twice, a file that is not UTF-8 or
nests or expands (YAML aliases) beyond reason.  Specs built in code (benchmarks, sweeps)
are validated the same way, except that numbers may be coerced.
"""

from __future__ import annotations

import difflib
import heapq
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, PrivateAttr, field_validator, model_validator

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
MAX_DCS = 250
MAX_HOSTS_PER_DC = 250
MAX_FILE_BYTES = 4 << 20  # a spec file is a few KB; more is a mistake (or an attack)
MAX_VALUES = 200_000  # values a file may hold once its YAML aliases are expanded
MAX_DEPTH = 64


class SpecError(ValueError):
    """A spec that cannot be used; ``str()`` is one line naming the file and the field (a
    file with several mistakes: one such line per mistake, ``SpecErrors``)."""


class SpecErrors(SpecError):
    """Several mistakes in one file, each a line of ``str()``: ``FILE:LINE: field: problem``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class HostResources(_Strict):
    """What one worker host stands for: a share of this machine's CPUs, or one GPU."""

    cpus: float = Field(0.0, ge=0.0, description="CPU cores for this host's container; 0 = unlimited")
    gpus: int = Field(0, ge=0, le=16)


class DataCenter(_Strict):
    name: str
    hosts: int = Field(ge=1, le=MAX_HOSTS_PER_DC)
    host: HostResources = HostResources()

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be lower-case letters, digits or '-', starting with a letter, at most 24 characters")
        return v


class Direction(_Strict):
    """Shaping of one direction of a WAN link."""

    delay_ms: float = Field(ge=0.0, le=10_000.0, description="one-way delay")
    jitter_ms: float = Field(0.0, ge=0.0)
    loss: float = Field(0.0, ge=0.0, lt=1.0, description="fraction of packets dropped at random")
    rate_mbps: float = Field(gt=0.0, le=100_000.0)
    queue_bytes: int | None = Field(None, ge=3000, description="bottleneck queue; default rate x max(20 ms, RTT): "
                                                                "one bandwidth-delay product of the path")

    @model_validator(mode="after")
    def _jitter_below_delay(self) -> "Direction":
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms ({self.jitter_ms}) must not exceed delay_ms ({self.delay_ms})")
        return self


class ReverseOverrides(_Strict):
    delay_ms: float | None = Field(None, ge=0.0, le=10_000.0)
    jitter_ms: float | None = Field(None, ge=0.0)
    loss: float | None = Field(None, ge=0.0, lt=1.0)
    rate_mbps: float | None = Field(None, gt=0.0, le=100_000.0)
    queue_bytes: int | None = Field(None, ge=3000)


class WanLink(Direction):
    a: str
    b: str
    reverse: ReverseOverrides | None = None
    source_rtt_ms: float | None = Field(None, gt=0.0, le=20_000.0,
                                        description="the round trip the topology's source measured (reference "
                                                    "only: the emulated delay is delay_ms each way)")

    @model_validator(mode="after")
    def _reverse_is_a_direction(self) -> "WanLink":
        if self.reverse is not None:  # b -> a: the overrides merged with a -> b must make a direction
            try:
                self.backward(validate=True)
            except ValidationError as exc:
                raise ValueError(f"reverse: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self

    def forward(self) -> Direction:
        return self._direction(False)

    def backward(self, validate: bool = False) -> Direction:
        return self._direction(True, validate)

    def _direction(self, reverse: bool, validate: bool = False) -> Direction:
        """a -> b (or b -> a, the overrides merged).  Built without validating again: this link
        was validated as a whole, the reverse merge included (``validate=True`` checks it); the
        network builder asks for directions thousands of times on a large topology."""
        values = {k: getattr(self, k) for k in Direction.model_fields}
        if reverse and self.reverse is not None:
            for k in ReverseOverrides.model_fields:
                v = getattr(self.reverse, k)
                if v is not None:
                    values[k] = v
        return Direction(**values) if validate else Direction.model_construct(**values)


class IntraDC(_Strict):
    rate_mbps: float = Field(0.0, ge=0.0, description="host <-> switch link speed; 0 = unshaped")


class Topology(_Strict):
    name: str
    description: str = ""
    source: str = ""
    dcs: list[DataCenter] = Field(min_length=1, max_length=MAX_DCS)
    wan: list[WanLink] = Field([], max_length=MAX_DCS * (MAX_DCS - 1) // 2)
    intra_dc: IntraDC = IntraDC()
    _hops: dict = PrivateAttr(default_factory=dict)  # next_hops by source DC, for the delays in _hops_key
    _hops_key: tuple = PrivateAttr(())

    @model_validator(mode="after")
    def _check_graph(self) -> "Topology":
        names = [dc.name for dc in self.dcs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dcs: duplicate DC name {dupes[0]!r}")
        seen: set[frozenset[str]] = set()
        for i, link in enumerate(self.wan):
            for end in (link.a, link.b):
                if end not in names:
                    raise ValueError(f"wan[{i}]: unknown DC {end!r} (known: {', '.join(names)})")
            if link.a == link.b:
                raise ValueError(f"wan[{i}]: a link needs two different DCs, got {link.a!r} twice")
            pair = frozenset((link.a, link.b))
            if pair in seen:
                raise ValueError(f"wan[{i}]: a second link between {link.a!r} and {link.b!r}")
            seen.add(pair)
        unreachable = set(names) - set(self._shortest_first_hops(names[0]))
        if unreachable:
            raise ValueError(f"wan: DC {sorted(unreachable)[0]!r} cannot be reached from {names[0]!r}")
        return self

    # -- queries the network builder and the tools share ------------------------------
    def dc(self, name: str) -> DataCenter:
        for dc in self.dcs:
            if dc.name == name:
                return dc
        raise KeyError(name)

    def directions(self) -> list[tuple[str, str, Direction]]:
        """Every shaped WAN direction as (src DC, dst DC, parameters)."""
        out = []
        for link in self.wan:
            out.append((link.a, link.b, link.forward()))
            out.append((link.b, link.a, link.backward()))
        return out

    def direction(self, src: str, dst: str) -> Direction:
        for link in self.wan:
            if (link.a, link.b) == (src, dst):
                return link.forward()
            if (link.b, link.a) == (src, dst):
                return link.backward()
        raise KeyError(f"no WAN link {src} -> {dst}")

    def next_hops(self, src: str) -> dict[str, str]:
        """For each reachable DC, the neighbour to send through.

        A DC with a direct link is reached over that link (traffic between two DCs crosses
        exactly their link, even where a detour would be faster); others over the
        shortest-delay path.  Kept for the links' delays as they are now (a large network's
        build asks for paths thousands of times; a changed delay computes them afresh).
        """
        key = tuple((link.a, link.b, link.delay_ms, link.reverse.delay_ms if link.reverse else None)
                    for link in self.wan)
        if self._hops_key != key:
            self._hops, self._hops_key = {}, key
        if src not in self._hops:
            first = self._shortest_first_hops(src)
            for s, d, _ in self.directions():
                if s == src:
                    first[d] = d
            self._hops[src] = first
        return dict(self._hops[src])

    def _shortest_first_hops(self, src: str) -> dict[str, str]:
        adj: dict[str, list[tuple[float, str]]] = {dc.name: [] for dc in self.dcs}
        for s, d, params in self.directions():
            adj[s].append((params.delay_ms, d))
        best: dict[str, float] = {src: 0.0}
        first: dict[str, str] = {src: src}
        heap: list[tuple[float, str, str]] = [(0.0, src, src)]
        while heap:
            cost, node, hop = heapq.heappop(heap)
            if cost > best.get(node, float("inf")):
                continue
            for w, nxt in sorted(adj[node]):
                c = cost + w
                if c < best.get(nxt, float("inf")):
                    best[nxt] = c
                    first[nxt] = nxt if node == src else hop
                    heapq.heappush(heap, (c, nxt, first[nxt]))
        return first

    def path(self, src: str, dst: str) -> list[str]:
        """DCs crossed from src to dst, both included."""
        path = [src]
        while path[-1] != dst:
            path.append(self.next_hops(path[-1])[dst])
        return path

    def one_way_delay_ms(self, src: str, dst: str) -> float:
        hops = self.path(src, dst)
        return sum(self.direction(a, b).delay_ms for a, b in zip(hops, hops[1:]))

    def rtt_ms(self, src: str, dst: str) -> float:
        """The configured round trip between two DCs (out and back along their paths)."""
        return self.one_way_delay_ms(src, dst) + self.one_way_delay_ms(dst, src)

    def source_rtt_ms(self, src: str, dst: str) -> float | None:
        """The round trip the topology's source measured for the link src-dst, if it says."""
        for link in self.wan:
            if {link.a, link.b} == {src, dst}:
                return link.source_rtt_ms
        return None


def default_queue_bytes(params: Direction, rtt_ms: float) -> int:
    """The bottleneck queue: one bandwidth-delay product of the path, rate x max(20 ms, RTT),
    at least two GSO packets.

    That is the classical sizing of a WAN router's buffer (Villamizar and Song's rate x RTT):
    a single loss-based flow halves (Reno) or cuts to 0.7 (CUBIC) its window at a drop, and a
    queue of about one BDP keeps the link busy while the window grows back, whatever the
    congestion control.  The earlier default was half a BDP.  (The 0.73-0.76 of the rate that
    ``testbed fidelity`` once reported for Ohio-Oregon at a 98 ms round trip was not the
    queue: it measured too soon after slow start.  In steady state that half-BDP queue gave
    0.988; see ``fidelity.steady_state_seconds``.)  ``queue_bytes`` overrides it."""
    if params.queue_bytes is not None:
        return params.queue_bytes
    rate_bytes = params.rate_mbps * 1e6 / 8
    return int(max(131072, rate_bytes * max(0.020, rtt_ms / 1000.0)))


def key_text(key: Any) -> str:
    """A key the user wrote, as a field name: plain when it is plain, else quoted on one line."""
    text = str(key)
    plain = text and text.isprintable() and not any(c.isspace() or c in "'\"" for c in text)
    return text if plain else repr(text)


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + key_text(part)
    return out or "(top level)"


def one_line(text: str) -> str:
    """``text`` as one line: newlines a user's value may carry are shown escaped."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


MAX_REPORTED = 20  # mistakes listed at once


def validation_error(exc: ValidationError, origin: str, model: type[BaseModel] | None = None) -> SpecError:
    """Every complaint of pydantic's, one line each: origin (with the line, where ``origin`` is
    a file), field path, problem, and for a misspelt key the closest the schema knows."""
    lines_of = _key_lines(origin)
    schema = _schema_of(model)
    out = []
    for err in exc.errors()[:MAX_REPORTED]:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        line = next((lines_of[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines_of), None)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and loc and schema is not None:
            close = difflib.get_close_matches(str(loc[-1]), _keys_at(schema, loc[:-1]), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        out.append(one_line(f"{origin}{f':{line}' if line else ''}: {_where(loc)}: {msg}"))
    if len(out) == 1:
        return SpecError(out[0])
    return SpecErrors("\n".join(out))


def _key_lines(origin: str) -> dict[tuple, int]:
    """Where each key and list item of the YAML file ``origin`` starts (1-based lines); empty
    where ``origin`` is not a readable file."""
    try:
        path = Path(origin)
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return {}
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        return {}
    out: dict[tuple, int] = {}
    stack = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = prefix + (key.value,)
                out.setdefault(here, key.start_mark.line + 1)
                stack.append((value, here))
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                out.setdefault(prefix + (i,), value.start_mark.line + 1)
                stack.append((value, prefix + (i,)))
    return out


def _schema_of(model: type[BaseModel] | None) -> dict | None:
    try:
        return model.model_json_schema() if model is not None else None
    except Exception:  # a schema pydantic cannot write only costs the suggestion
        return None


def _keys_at(schema: dict, loc: tuple) -> list[str]:
    """The keys the JSON schema allows in the mapping at ``loc``."""
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        for _ in range(8):
            if "$ref" in node:
                node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
            elif "properties" not in node and ("anyOf" in node or "allOf" in node):
                options = [resolve(o) for o in node.get("anyOf", node.get("allOf", []))]
                node = next((o for o in options if "properties" in o or "items" in o
                             or isinstance(o.get("additionalProperties"), dict)), {})
            else:
                break
        return node

    node = resolve(schema)
    for part in loc:
        if isinstance(part, int):
            node = resolve(node.get("items", {}))
        elif part in node.get("properties", {}):
            node = resolve(node["properties"][part])
        elif isinstance(node.get("additionalProperties"), dict):
            node = resolve(node["additionalProperties"])
        else:
            return []
    return list(node.get("properties", {}))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last one silently: a second ``dcs:`` would replace the first)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r}", key_node.start_mark)
                    seen.add(key)
                except TypeError:
                    pass  # an unhashable key: the base class says so
        return super().construct_mapping(node, deep)


def _check_size(data: Any, origin: str) -> None:
    """Reject data that nests deeper than MAX_DEPTH or holds more than MAX_VALUES values once
    aliases are expanded (a few lines of YAML anchors can stand for billions), or refers to
    itself."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(obj: Any, depth: int) -> int:
        if not isinstance(obj, (list, dict)):
            return 1
        key = id(obj)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise SpecError(f"{origin}: a YAML alias refers to the node that holds it")
        if depth > MAX_DEPTH:
            raise SpecError(f"{origin}: nested more than {MAX_DEPTH} levels deep")
        active.add(key)
        items = list(obj.keys()) + list(obj.values()) if isinstance(obj, dict) else obj
        total = 1
        for item in items:
            total += size(item, depth + 1)
            if total > MAX_VALUES:
                raise SpecError(f"{origin}: more than {MAX_VALUES:,} values once YAML aliases are expanded")
        active.discard(key)
        sizes[key] = total
        return total

    size(data, 0)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content, or SpecError naming the file and the line."""
    path = Path(path)
    if "\0" in str(path):
        raise SpecError(one_line(f"{key_text(str(path))}: cannot read: a file name has no NUL byte"))
    try:
        if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or a device: may block or never end
            raise OSError(0, "not a regular file")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(one_line(f"{path}: cannot read: {exc.strerror}")) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(one_line(f"{path}: more than {MAX_FILE_BYTES:,} bytes; a spec file is a few KB"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(one_line(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})")) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(one_line(f"{path}: invalid YAML at {where}: {problem}")) from None
    except RecursionError:
        raise SpecError(one_line(f"{path}: nested more than {MAX_DEPTH} levels deep")) from None
    _check_size(data, one_line(str(path)))
    return data


def parse_topology(data: Any, origin: str = "<topology>", strict: bool = False) -> Topology:
    """Validate already-parsed YAML; raise SpecError with a one-line message.  ``strict``: no
    coercion of types (what a file gets)."""
    if not isinstance(data, dict):
        raise SpecError(one_line(f"{origin}: expected a mapping at the top level, got {type(data).__name__}"))
    try:
        return Topology.model_validate(data, strict=strict)
    except ValidationError as exc:
        raise validation_error(exc, origin, Topology) from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    return parse_topology(read_yaml(path), str(path), strict=True)


def path_exists(path: Path) -> bool:
    """``path.exists()``, False for a path the OS cannot even look up (a NUL byte, a name too long)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def resolve_topology(name_or_path: str | Path, near: Path | None = None) -> Path:
    """A topology given by path, or by name: from ``topologies/`` beside ``near`` (an
    experiment file's folder), in the working directory, or the shipped ones (``shipped.py``)."""
    from testbed.spec.shipped import shipped_folders

    p = Path(name_or_path)
    if path_exists(p):
        return p
    folders = []
    if near is not None:
        folders += [near, near.parent / "topologies"]
    folders += [Path.cwd() / "topologies", *shipped_folders("topologies")]
    for folder in folders:
        for candidate in (folder / f"{name_or_path}.yaml", folder / str(name_or_path)):
            if path_exists(candidate):
                return candidate
    looked = ", ".join(dict.fromkeys(f"{f}/" for f in folders))
    raise SpecError(one_line(f"{key_text(name_or_path)}: no such topology file (looked in ./, {looked})"))


def dilated(topo: Topology, k: float) -> Topology:
    """``topo`` as the wire carries it under time dilation ``k`` (the emulated world runs k
    times slower than the wall clock): every WAN delay and jitter (and the source's round
    trip) k times longer, every rate, the intra-DC one too, k times lower.  Queues stay in
    bytes, and so does every bandwidth-delay product.  ``k`` = 1 returns ``topo`` itself."""
    if k == 1:
        return topo

    def scale(values: dict) -> dict:
        out = dict(values)
        for key in ("delay_ms", "jitter_ms", "source_rtt_ms"):
            if out.get(key) is not None:
                out[key] = out[key] * k
        if out.get("rate_mbps") is not None:
            out["rate_mbps"] = out["rate_mbps"] / k
        return out

    wan = []
    for link in topo.wan:
        values = scale({name: getattr(link, name) for name in WanLink.model_fields if name != "reverse"})
        # a default queue is rate x max(20 ms, RTT): the 20 ms floor is wall-clock there, so the
        # emulated default is written out in bytes, as every other queue stays
        values["queue_bytes"] = link.queue_bytes or default_queue_bytes(link.forward(), topo.rtt_ms(link.a, link.b))
        back = {name: getattr(link.reverse, name) for name in ReverseOverrides.model_fields} if link.reverse else {}
        back["queue_bytes"] = back.get("queue_bytes") or default_queue_bytes(link.backward(), topo.rtt_ms(link.b, link.a))
        values["reverse"] = ReverseOverrides.model_construct(**scale({k2: back.get(k2) for k2 in ReverseOverrides.model_fields}))
        wan.append(WanLink.model_construct(**values))
    intra = IntraDC.model_construct(rate_mbps=topo.intra_dc.rate_mbps / k)
    return topo.model_copy(update={"wan": wan, "intra_dc": intra,
                                   "description": f"{topo.description} (time dilation {k:g})".strip()})
