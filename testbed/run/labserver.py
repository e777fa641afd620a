"""Labs that stay up: the detached process that holds one ``Lab``, and how others reach it.

How it fits: ``testbed up`` calls ``start_detached``, which starts ``python -m
testbed.run.labserver`` in a session of its own.  That process builds the ``lab.Lab`` (the
network and its WAN self-check; the registry lock is its for as long as the lab is up),
records itself in the registry (so ``testbed clean`` ends it after a crash of anything),
writes the lab's description to ``<registry dir>/labs/NAME.json`` (hosts, links and their
settings, the WAN check; rewritten when a link changes), answers on the control socket
``labs/NAME.sock`` and reports ``READY`` (or ``ERROR <one line>``) on its stdout, the pipe
``start_detached`` reads; then its output goes to ``labs/NAME.log``.

The control socket is a Unix stream socket: one JSON request line, one JSON answer line
(``{"ok": false, "error": ..}`` when refused).  Requests: ``counters`` (every WAN
direction's counters), ``set`` (change a link in place: ``src``, ``dst``, ``changes``),
``down`` (answer, remove everything, exit).  SIGTERM and SIGINT also take the lab down.
``LabClient`` is the other end: it reads the description file (hosts, links) and asks the
socket for the rest, so ``testbed status``, ``exec``, ``link``, ``record`` and ``torchrun
--lab`` work on a lab held here just as on a ``Lab`` in their own process.  A lab whose
process died shows as ``gone``; ``testbed down NAME`` (or ``testbed clean``) removes what it
left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from testbed.registry import STATE_DIR, Registry, clean, process_running, process_start_time
from testbed.run.lab import Lab, LabError, pick_host, pick_link, start_in
from testbed.run.procs import python_env

LABS = "labs"
_UP_TIMEOUT_S = 300.0
_DOWN_TIMEOUT_S = 60.0


def labs_dir(state_dir: Path = STATE_DIR) -> Path:
    return state_dir / LABS


def _alive(info: dict) -> bool:
    return process_running(info["pid"], info.get("start"))


def read_labs(state_dir: Path = STATE_DIR) -> list[dict]:
    """Every lab's description, with ``state``: "up", or "gone" when its process died."""
    out = []
    d = labs_dir(state_dir)
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        info["state"] = "up" if _alive(info) else "gone"
        out.append(info)
    return out


def find_lab(name: str | None, state_dir: Path = STATE_DIR) -> dict:
    """The lab named ``name`` (or the one lab up, without a name); a LabError otherwise."""
    labs = read_labs(state_dir)
    if not labs:
        raise LabError("no lab is up (start one: testbed up TOPOLOGY)")
    if name is None:
        return labs[0]  # one network per machine: at most one lab
    for info in labs:
        if info["name"] == name:
            return info
    raise LabError(f"no lab named {name!r} (up: {', '.join(i['name'] for i in labs)})")


class LabClient:
    """A lab held up by another process (``testbed up``), answered from its description file
    and its control socket."""

    def __init__(self, info: dict, state_dir: Path = STATE_DIR):
        self.info = info
        self.name = info["name"]
        self.state_dir = state_dir
        if info.get("state") == "gone":
            raise LabError(f"lab {self.name}: its process (pid {info['pid']}) is gone; testbed down {self.name} "
                           "removes what it left")

    @classmethod
    def find(cls, name: str | None = None, state_dir: Path = STATE_DIR) -> "LabClient":
        return cls(find_lab(name, state_dir), state_dir)

    def request(self, msg: dict, timeout: float = 30.0) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.info["socket"])
                s.sendall(json.dumps(msg).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError as exc:
                raise LabError(f"lab {self.name} does not answer on {self.info['socket']}: "
                               f"{exc.strerror or exc}") from None
        try:
            reply = json.loads(data)
        except ValueError:
            raise LabError(f"lab {self.name} gave no answer to {msg.get('cmd')!r}") from None
        if not reply.get("ok"):
            raise LabError(reply.get("error") or "refused")
        return reply

    def refresh(self) -> dict:
        self.info = find_lab(self.name, self.state_dir)
        return self.info

    def host_table(self) -> list[dict]:
        return self.info["hosts"]

    def link_table(self) -> list[dict]:
        return self.refresh()["links"]

    def host(self, dc: str, index: int = 0) -> dict:
        return pick_host(self.host_table(), dc, index, self.name)

    def counter_table(self) -> dict[str, dict]:
        return self.request({"cmd": "counters"})["counters"]

    def set_link(self, src: str, dst: str, **changes: float) -> dict:
        pick_link(self.info["links"], src, dst, self.name)
        return self.request({"cmd": "set", "src": src, "dst": dst, "changes": changes})["link"]

    def popen(self, dc: str, index: int, argv: list[str] | str, **kwargs) -> subprocess.Popen:
        h = self.host(dc, index)
        return start_in(Registry(self.state_dir), h, argv, f"lab:{self.name}:{h['name']}", **kwargs)


# -- starting and stopping a lab from the command line ----------------------------------------
def start_detached(topology: Path, name: str, delay_backend: str = "auto",
                   progress=lambda msg: None, state_dir: Path = STATE_DIR) -> dict:
    """Start the lab process and wait until it is up: its description, or a LabError with the
    lab process's one-line reason (it has then removed everything it made)."""
    for info in read_labs(state_dir):
        if info["name"] == name:
            raise LabError(f"a lab named {name!r} is already {'up' if info['state'] == 'up' else 'recorded (gone)'}"
                           f"; testbed down {name} first")
        raise LabError(f"lab {info['name']} is up, and this machine holds one lab at a time "
                       f"(testbed down {info['name']} first)")
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed.run.labserver", str(topology), "--name", name,
         "--delay-backend", delay_backend],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=python_env(GTB_STATE_DIR=str(state_dir)),
    )
    lines = []
    try:
        deadline = time.monotonic() + _UP_TIMEOUT_S
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("PROGRESS "):
                progress(line[9:])
            elif line == "READY":
                return find_lab(name, state_dir)
            elif line.startswith("ERROR "):
                proc.wait(_DOWN_TIMEOUT_S)
                raise LabError(line[6:])
            elif line.strip():
                lines.append(line)
            if time.monotonic() > deadline:
                break
        proc.wait(_DOWN_TIMEOUT_S)
        raise LabError(f"the lab process ended before the lab was up (exit code {proc.returncode}): "
                       f"{lines[-1] if lines else 'no output'}")
    except BaseException:
        if proc.poll() is None:  # Ctrl-C: the lab process removes what it made on SIGTERM
            proc.terminate()
            try:
                proc.wait(_DOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    finally:
        proc.stdout.close()


def stop_lab(name: str | None, state_dir: Path = STATE_DIR) -> dict:
    """Take a lab down and wait until everything it made is gone; what the registry removed
    after a lab process that had died, else {}."""
    info = find_lab(name, state_dir)
    if info["state"] == "up":
        try:
            LabClient(info, state_dir).request({"cmd": "down"})
        except LabError:
            if _alive(info):
                os.kill(info["pid"], signal.SIGTERM)
        deadline = time.monotonic() + _DOWN_TIMEOUT_S
        while _alive(info) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(info):
            os.kill(info["pid"], signal.SIGKILL)
            time.sleep(0.2)
    return clean(state_dir)  # a lab process that died (or was killed) left its pieces


# -- the lab process -----------------------------------------------------------------------
def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _write_description(lab: Lab, path: Path, sock_path: Path) -> None:
    info = lab.status() | {"pid": os.getpid(), "start": process_start_time(os.getpid()), "socket": str(sock_path),
                           "log": str(path.with_suffix(".log"))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)


def _handle(lab: Lab, msg: dict, describe) -> dict:
    cmd = msg.get("cmd")
    if cmd == "counters":
        lab.net.check()
        return {"counters": lab.counter_table()}
    if cmd == "set":
        wd = lab.link(msg["src"], msg["dst"])
        wd.set(**msg.get("changes", {}))
        describe()
        return {"link": next(x for x in lab.link_table() if (x["src"], x["dst"]) == (wd.src, wd.dst))}
    if cmd == "status":
        return {"status": lab.status()}
    raise LabError(f"unknown request {cmd!r}")


def serve(topology: str, name: str, delay_backend: str = "auto") -> int:
    """The lab process: build, check, describe, answer until told to go down."""
    from testbed.cliutil import on_sigterm

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        lab = Lab(topology, name=name, delay_backend=delay_backend, progress=lambda m: _say(f"PROGRESS {m}"))
    except (LabError, ValueError) as exc:
        _say(f"ERROR {exc}")
        return 2
    try:
        lab.up()
    except KeyboardInterrupt:
        _say("ERROR interrupted; everything the testbed made was removed")
        return 130
    except Exception as exc:  # Busy, NetworkError, BackendUnavailable: one line each
        _say(f"ERROR {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}")
        return 2
    try:
        reg = lab.registry
        reg.process(os.getpid(), f"lab:{name}", own_netns=False)  # testbed clean ends this process too
        d = labs_dir(reg.dir)
        d.mkdir(exist_ok=True)
        desc, sock_path, log = d / f"{name}.json", d / f"{name}.sock", d / f"{name}.log"
        for p in (desc, desc.with_suffix(".tmp"), sock_path, log):
            reg.file(p)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(sock_path))
        server.listen(8)
        server.settimeout(1.0)
        describe = lambda: _write_description(lab, desc, sock_path)  # noqa: E731
        describe()
        _say("READY")
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            with conn:
                going_down = _answer(conn, lab, describe)
            if going_down:
                break
    except KeyboardInterrupt:
        pass
    finally:
        lab.down()
    return 0


def _answer(conn: socket.socket, lab: Lab, describe) -> bool:
    conn.settimeout(10.0)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        msg = json.loads(data)
    except (OSError, ValueError):
        return False
    if msg.get("cmd") == "down":
        reply = {"ok": True}
    else:
        try:
            reply = {"ok": True, **_handle(lab, msg, describe)}
        except Exception as exc:
            text = str(exc).strip()
            reply = {"ok": False, "error": text.splitlines()[-1] if text else type(exc).__name__}
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass
    return msg.get("cmd") == "down"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.run.labserver")
    parser.add_argument("topology")
    parser.add_argument("--name", required=True)
    parser.add_argument("--delay-backend", default="auto")
    args = parser.parse_args(argv)
    return serve(args.topology, args.name, args.delay_backend)


if __name__ == "__main__":
    sys.exit(main())

