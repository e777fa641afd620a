"""Titan / Titan-Next as the testbed sees it: the ``testbed titan`` command group.

How it fits: pyproject's ``testbed.extensions`` entry point names ``EXTENSION``; the
``testbed`` command mounts ``cli.app`` as ``testbed titan study | emulate | backbone``.
Titan is no training run: it has no experiment section and no run hooks.
"""

from __future__ import annotations

from testbed.extension import Extension

EXTENSION = Extension(name="titan", commands={"titan": "agents.titan.cli:app"})
