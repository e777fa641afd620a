"""Extensions: the one registry through which everything outside the core plugs in.

How it fits: an extension is a package (``agents/atlas``, ``agents/bubbletea``,
``agents/titan``, or a third party's) that declares one ``Extension`` under the
``testbed.extensions`` entry-point group, as pytest's plugins and pyroute2's tc plugins are
found::

    [project.entry-points."testbed.extensions"]
    myext = "mypkg.plugin:EXTENSION"

The core never names an extension (``tests/test_structure.py`` checks it); it asks this
registry, and each extension owns everything of its own:

* ``section``: the model of its section of an experiment file (``myext: {...}``), a
  ``Section`` (strict pydantic): ``testbed.spec.experiment`` gives the experiment schema one
  field per registered section, so its errors name the file and the field as the core's do;
  ``check(exp, origin)`` checks what needs the whole experiment (its topology, say);
* ``variant_keys``: the shorthands a ``compare:`` arm may set in its section
  (``sharing: temporal`` sets ``atlas.sharing``);
* ``run``: ``"module:Class"`` of its ``testbed.run.hooks.RunExtension``, imported only
  when an experiment uses it;
* ``commands``: ``testbed`` sub-commands, name -> ``"module:attr"``: a typer app (a command
  group, ``testbed titan ...``) or a function (one command, ``testbed plan``);
* ``faults``: what ``testbed chaos`` may inject into a run that uses it (``ProcessFault``:
  SIGKILL one of its processes; the run must end as documented);
* ``predict``: ``"module:func"``, ``func(exp, run_dir) -> dict`` of keyword arguments for
  the simulator (a sharing policy, start offsets) when ``compare:`` predicts a variant run
  with it;
* ``simulate``: ``"module:func"``, ``func(exp) -> dict`` of keyword arguments for the
  simulator when ``testbed sim`` simulates an experiment that uses it (no run to read: what
  the experiment's own figures say, e.g. a sharing policy);
* ``lab``: ``"module:Class"`` of its ``testbed.run.hooks.JobExtension``: what a ``testbed
  torchrun`` job makes when the user passes ``--with NAME=VALUE`` (a user's own job on a lab,
  not the project's trainer; ``job_extension(NAME)`` finds it).

* ``across_machines``: its run hooks use only what ``testbed.run.site`` offers (processes
  placed ``near`` a DC, ``Launcher.socket``/``read``, a link's ``control_path``, ``lane`` and
  ``delay_line_stats``), so ``testbed run --inventory`` may run it (otherwise it is refused
  in one line);
* ``dilates``: its processes' timers read the dilated clock, so an experiment with
  ``time_dilation`` > 1 may use it (otherwise it is refused in one line);
* ``devices``: device kinds, name -> ``"module:Class"`` of a ``DeviceKind``: what an
  experiment's ``device: NAME`` makes of each worker's device.  The core's own (``cpu``,
  ``cuda``, ``emulated``, ``auto``) are declared the same way, by ``testbed.run.devices``.

An ``Extension``'s module is imported whenever the command or an experiment is loaded, so it
must import only light things at the top (pydantic, typer, this module).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

# "Experiment" below is ``testbed.spec.experiment.Experiment``, not imported: that module
# builds its schema from this registry

GROUP = "testbed.extensions"


class ExtensionError(RuntimeError):
    """An extension cannot run as the experiment asks, or cannot be loaded; the message is one line."""


class Section(BaseModel):
    """Base of an extension's experiment-file section: unknown keys and NaN are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def in_use(self) -> bool:
        """Whether an experiment with this section asks for the extension (default: never)."""
        return False


@dataclass(frozen=True)
class ProcessFault:
    """``testbed chaos``: SIGKILL of one of the extension's processes (``targets(exp)`` names
    the candidates, as the extension named them when it started them).  Documented outcome:
    ``documented``; judged by the run's log naming ``"<extension> <target>"`` and
    ``log_says``."""

    documented: str
    targets: Callable[["Experiment"], list[str]]
    log_says: str = "training continues"


class DeviceKind:
    """Base class of a device kind (``device: NAME``): one per run, ``Kind(exp)``.  The run
    calls ``check()`` before it builds anything, ``plan`` once, ``configure`` per worker,
    ``dp_backend`` per data-parallel group and ``describe`` for its record; see
    ``testbed.run.devices`` for the core's kinds.  Raise ``ExtensionError`` (one line) where
    the kind cannot serve the experiment."""

    name: ClassVar[str] = ""
    computes_model: ClassVar[bool] = True  # False: device time only (no losses, no reference)
    profiled: ClassVar[bool] = False  # device times come from ``exp.emulation`` (the simulator draws the same)
    one_machine_only: ClassVar[bool] = False  # refused with ``--inventory``
    dilates: ClassVar[bool] = False  # its op times stretch with ``time_dilation`` (a real device's cannot)

    def __init__(self, exp: "Experiment"):
        self.exp = exp

    def check(self) -> None:
        """Fail before anything is built where the experiment asks what cannot be had."""

    def plan(self, site: Any, count: int, warn: Callable[[str], None]) -> list[str]:
        """One device label per worker (``site.gpus()`` says how many GPUs the site has)."""
        raise NotImplementedError

    def configure(self, run: Any, worker: Any, cfg: Any, env: dict[str, str]) -> float:
        """Set up one worker's device: ``cfg.compute`` (``"module:Class"`` the worker computes
        with) and ``cfg.device``, its environment; returns its CPU quota in cores (0: none)."""
        raise NotImplementedError

    def dp_backend(self, labels: list[str]) -> str:
        """How the replicas of one stage, on these devices, all-reduce."""
        return "gloo"

    def describe(self, run: Any) -> dict:
        """The ``device`` section of the run's record."""
        return {}


@dataclass(frozen=True)
class Extension:
    """What one extension adds to the testbed (see the module docstring)."""

    name: str
    section: type[Section] | None = None
    check: Callable[["Experiment", str], None] | None = None
    variant_keys: dict[str, str] = field(default_factory=dict)
    run: str | None = None
    commands: dict[str, str] = field(default_factory=dict)
    faults: dict[str, ProcessFault] = field(default_factory=dict)
    predict: str | None = None
    simulate: str | None = None
    lab: str | None = None
    devices: dict[str, str] = field(default_factory=dict)
    dilates: bool = False  # its processes read the dilated clock: it may run under ``time_dilation`` > 1
    across_machines: bool = False  # its run uses only the site's protocols: it may run with ``--inventory``

    def load(self, target: str) -> Any:
        """The object behind one of this extension's ``"module:attr"`` targets."""
        module, _, attr = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ExtensionError(f"extension {self.name}: cannot load {target}: {exc}") from None


@lru_cache(maxsize=1)
def extensions() -> dict[str, Extension]:
    """Every registered extension by name, in name order (the order hooks run in)."""
    found: dict[str, Extension] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            ext = ep.load()
        except Exception as exc:  # a broken third-party package: name it, in one line
            raise ExtensionError(f"extension {ep.name} ({ep.value}): cannot load: "
                                 f"{type(exc).__name__}: {exc}".replace("\n", " ")) from None
        if not isinstance(ext, Extension) or ext.name != ep.name:
            raise ExtensionError(f"extension {ep.name} ({ep.value}): not an Extension named {ep.name!r}")
        found.setdefault(ep.name, ext)
    return found


def sections() -> dict[str, type[Section]]:
    """The experiment-file sections extensions add, by section name."""
    return {n: e.section for n, e in extensions().items() if e.section is not None}


def commands() -> dict[str, Callable[[], Any]]:
    """``testbed`` sub-commands extensions add: name -> a loader of the typer app or function."""
    out: dict[str, Callable[[], Any]] = {}
    for ext in extensions().values():
        for name, target in ext.commands.items():
            out[name] = lambda e=ext, t=target: e.load(t)
    return out


def faults() -> dict[str, tuple[Extension, ProcessFault]]:
    """Chaos faults extensions add: fault name -> (its extension, the fault)."""
    return {name: (ext, f) for ext in extensions().values() for name, f in ext.faults.items()}


def device_kinds() -> dict[str, Callable[[], type[DeviceKind]]]:
    """Every device kind extensions declare: name -> a loader of its class."""
    out: dict[str, Callable[[], type[DeviceKind]]] = {}
    for ext in extensions().values():
        for name, target in ext.devices.items():
            out.setdefault(name, lambda e=ext, t=target: e.load(t))
    return out


def device_kind(name: str) -> type[DeviceKind]:
    """The class of device kind ``name``; a one-line ExtensionError naming the known ones otherwise."""
    kinds = device_kinds()
    if name not in kinds:
        raise ExtensionError(f"device: no device kind {name!r} (known: {', '.join(sorted(kinds))})")
    cls = kinds[name]()
    if not (isinstance(cls, type) and issubclass(cls, DeviceKind)):
        raise ExtensionError(f"device kind {name}: not a DeviceKind")
    return cls


def job_extension(name: str) -> Extension:
    """The extension ``name`` that acts on a ``testbed torchrun`` job (``lab``); a one-line
    ExtensionError naming the ones that do otherwise."""
    found = extensions()
    if name in found and found[name].lab is not None:
        return found[name]
    offered = ", ".join(n for n, e in found.items() if e.lab is not None) or "none"
    why = "has no torchrun hook" if name in found else "is not installed"
    raise ExtensionError(f"--with {name}: extension {name!r} {why} (for torchrun jobs: {offered})")


def in_use(exp: "Experiment") -> list[Extension]:
    """The extensions ``exp`` asks for (its section says so), in registry order."""
    out = []
    for name, ext in extensions().items():
        section = getattr(exp, name, None) if ext.section is not None else None
        if isinstance(section, Section) and section.in_use():
            out.append(ext)
    return out


def simulator_options(exp: "Experiment", run_dir: Path | None = None) -> dict:
    """The simulator's keyword arguments from the extensions ``exp`` uses: with a kept run
    (``run_dir``), each one's ``predict`` hook reads what the run recorded; without one, or for
    an extension that has no ``predict``, its ``simulate`` hook reads the experiment alone."""
    options: dict = {}
    for ext in in_use(exp):
        if run_dir is not None and ext.predict is not None:
            options.update(ext.load(ext.predict)(exp, run_dir))
        elif ext.simulate is not None:
            options.update(ext.load(ext.simulate)(exp))
    return options
