"""Prefill requests: the real Azure LLM inference traces, or a Poisson source.

How it fits: the BubbleTea controller replays a list of ``Request`` in real time from the
moment it starts serving.  The traces (``data/``, CC-BY 4.0, Splitwise ISCA 2024) carry real
arrival times and prompt/output lengths; an experiment scales them to this machine's
compute: ``rate_scale`` multiplies the arrival rate, ``token_scale`` the token counts, and
prompts are capped at ``max_prompt_tokens`` (the inference model's context).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TRACES = {"code": DATA / "AzureLLMInferenceTrace_code.csv", "conv": DATA / "AzureLLMInferenceTrace_conv.csv"}


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float  # since the workload started
    prompt_tokens: int
    output_tokens: int


def _parse_time(text: str) -> float:
    day, clock = text.split(" ")
    whole, _, frac = clock.partition(".")
    t = datetime.strptime(f"{day} {whole}", "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def azure_trace(kind: str = "conv", duration_s: float = 60.0, rate_scale: float = 1.0, token_scale: float = 1.0,
                max_prompt_tokens: int = 512, max_output_tokens: int = 64, offset_s: float = 0.0) -> list[Request]:
    """Requests of the real trace arriving within ``duration_s`` after scaling, from ``offset_s``
    (trace time) on.  Scaling the rate compresses the arrival times: the burstiness stays."""
    if kind not in TRACES:
        raise ValueError(f"trace {kind!r}: choose one of {', '.join(TRACES)}")
    out = []
    with open(TRACES[kind], newline="") as fh:
        rows = csv.DictReader(fh)
        t0 = None
        for row in rows:
            t = _parse_time(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            rel = t - t0 - offset_s
            if rel < 0:
                continue
            arrival = rel / rate_scale
            if arrival > duration_s:
                break
            prompt = max(1, min(max_prompt_tokens, round(int(row["ContextTokens"]) * token_scale)))
            output = max(1, min(max_output_tokens, round(int(row["GeneratedTokens"]) * token_scale)))
            out.append(Request(len(out), arrival, prompt, output))
    return out


def poisson(rate_per_s: float, duration_s: float, prompt_tokens: tuple[int, int] = (32, 512),
            output_tokens: tuple[int, int] = (4, 64), seed: int = 0) -> list[Request]:
    """Exponential inter-arrivals; prompt and output lengths uniform in the given ranges."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t > duration_s:
            return out
        out.append(Request(len(out), t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
