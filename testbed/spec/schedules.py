"""Pipeline schedules as data: the ordered operations each stage performs per iteration.

How it fits: the trainer (``testbed/train``) executes these lists op by op; the simulator
replays the same lists with modelled times.  Nothing here knows about torch or sockets.

A schedule is first a compute order per stage (forward/backward of microbatch i); ``ops``
expands it with the communication each compute step implies:

    forward(i)  on stage s: recv_act(i) from s-1 (if s > 0), forward(i), send_act(i) to s+1 (if s < P-1)
    backward(i) on stage s: recv_grad(i) from s+1 (if s < P-1), backward(i), send_grad(i) to s-1 (if s > 0)

Sends are asynchronous (a stage never waits for its peer to receive), receives block, and
each channel delivers in order; ``check`` replays the lists under exactly these rules and
rejects a schedule that would deadlock before anything starts.

* ``gpipe``: all forwards, then all backwards.  Latency is paid only in fill and drain.
* ``1f1b``: ``P - s - 1`` warm-up forwards, then one forward / one backward, then the
  remaining backwards.  ``extra_warmup`` keeps more microbatches in flight, which hides a
  high-latency boundary (plain 1F1B stalls a round trip per steady-state step there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

FORWARD, BACKWARD = "forward", "backward"
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "recv_act", "send_act", "recv_grad", "send_grad"
COMPUTE_KINDS = (FORWARD, BACKWARD)


class ScheduleError(ValueError):
    """An impossible schedule; the message is one line."""


@dataclass(frozen=True)
class Op:
    kind: str
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}({self.mb})"


def gpipe(stage: int, stages: int, microbatches: int, extra_warmup: int = 0) -> list[Op]:
    return [Op(FORWARD, i) for i in range(microbatches)] + [Op(BACKWARD, i) for i in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int, extra_warmup: int = 0) -> list[Op]:
    warmup = min(stages - stage - 1 + extra_warmup, microbatches)
    order = [Op(FORWARD, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order.append(Op(FORWARD, warmup + i))
        order.append(Op(BACKWARD, i))
    order += [Op(BACKWARD, i) for i in range(microbatches - warmup, microbatches)]
    return order


SCHEDULES: dict[str, Callable[..., list[Op]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def compute_order(schedule: str, stage: int, stages: int, microbatches: int, extra_warmup: int = 0) -> list[Op]:
    try:
        fn = SCHEDULES[schedule]
    except KeyError:
        raise ScheduleError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})") from None
    return fn(stage, stages, microbatches, extra_warmup)


def ops(schedule: str, stage: int, stages: int, microbatches: int, extra_warmup: int = 0) -> list[Op]:
    """The full op list of one stage for one iteration, communication included."""
    out: list[Op] = []
    for op in compute_order(schedule, stage, stages, microbatches, extra_warmup):
        if op.kind == FORWARD:
            if stage > 0:
                out.append(Op(RECV_ACT, op.mb))
            out.append(op)
            if stage < stages - 1:
                out.append(Op(SEND_ACT, op.mb))
        else:
            if stage < stages - 1:
                out.append(Op(RECV_GRAD, op.mb))
            out.append(op)
            if stage > 0:
                out.append(Op(SEND_GRAD, op.mb))
    return out


def check(schedule: str, stages: int, microbatches: int, extra_warmup: int = 0) -> list[list[Op]]:
    """Validate and return every stage's op list; raise ScheduleError on any problem."""
    if stages < 1:
        raise ScheduleError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {microbatches}")
    if extra_warmup < 0:
        raise ScheduleError(f"extra_warmup must be >= 0, got {extra_warmup}")
    programs = [ops(schedule, s, stages, microbatches, extra_warmup) for s in range(stages)]
    for s, prog in enumerate(programs):
        fwd = [op.mb for op in prog if op.kind == FORWARD]
        bwd = [op.mb for op in prog if op.kind == BACKWARD]
        if sorted(fwd) != list(range(microbatches)) or sorted(bwd) != list(range(microbatches)):
            raise ScheduleError(f"{schedule}: stage {s} does not run every microbatch forward and backward once")
        done = set()
        for op in prog:
            if op.kind == BACKWARD and op.mb not in done:
                raise ScheduleError(f"{schedule}: stage {s} runs backward({op.mb}) before forward({op.mb})")
            if op.kind == FORWARD:
                done.add(op.mb)
    _replay(schedule, programs)
    return programs


def _replay(schedule: str, programs: list[list[Op]]) -> None:
    """Run the programs with async sends and blocking in-order receives; detect deadlock."""
    sent: dict[tuple[str, int], list[int]] = {}  # (kind, receiving stage) -> mbs delivered, in order
    taken: dict[tuple[str, int], int] = {}
    pc = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for s, prog in enumerate(programs):
            while pc[s] < len(prog):
                op = prog[pc[s]]
                if op.kind in (RECV_ACT, RECV_GRAD):
                    key = (op.kind, s)
                    queue, k = sent.get(key, []), taken.get(key, 0)
                    if k >= len(queue):
                        break
                    if queue[k] != op.mb:
                        raise ScheduleError(
                            f"{schedule}: stage {s} expects {op.kind}({op.mb}) but the channel delivers mb {queue[k]}"
                        )
                    taken[key] = k + 1
                elif op.kind == SEND_ACT:
                    sent.setdefault((RECV_ACT, s + 1), []).append(op.mb)
                elif op.kind == SEND_GRAD:
                    sent.setdefault((RECV_GRAD, s - 1), []).append(op.mb)
                pc[s] += 1
                progress = True
    stuck = [s for s, prog in enumerate(programs) if pc[s] < len(prog)]
    if stuck:
        s = stuck[0]
        raise ScheduleError(f"{schedule}: deadlock, stage {s} waits forever at {programs[s][pc[s]]!r}")


def ideal_bubble_fraction(stages: int, microbatches: int) -> float:
    """(p-1)/(m+p-1): the fill-and-drain idle share of GPipe and 1F1B with no communication."""
    return (stages - 1) / (microbatches + stages - 1)
