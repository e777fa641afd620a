"""Topology files: what loads, and the one-line errors for what does not."""

from __future__ import annotations


import re
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.spec.awsmatrix import aws_topology, load_pairs
from testbed.spec.topology import SpecError, load_topology, parse_topology

REPO = Path(__file__).resolve().parent.parent
GOOD = {
    "name": "t",
    "dcs": [{"name": "a", "hosts": 2}, {"name": "b", "hosts": 1}],
    "wan": [{"a": "a", "b": "b", "delay_ms": 10, "rate_mbps": 100}],
}


@pytest.mark.parametrize("path", sorted((REPO / "topologies").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_topologies_load(path):
    topo = load_topology(path)
    assert topo.dcs and topo.wan
    for dc in topo.dcs:  # every pair routable
        assert set(topo.next_hops(dc.name)) == {d.name for d in topo.dcs}


def test_aws_topologies_carry_half_the_measured_round_trip_each_way():
    """The matrix's delays are round trips: every shipped topology made from it gives each
    direction half of it, records the matrix's figure, and says so."""
    pairs = load_pairs()
    shipped = sorted((REPO / "topologies").glob("aws-*.yaml"))
    assert len(shipped) >= 5
    for path in shipped:
        topo = load_topology(path)
        assert "round trip" in topo.source and "half" in topo.source, path
        assert "one-way" in path.read_text().splitlines()[1], path  # the generated file's comment
        for link in topo.wan:
            rtt, gbps = pairs[frozenset((link.a.capitalize(), link.b.capitalize()))]
            assert link.source_rtt_ms == rtt
            assert link.delay_ms == rtt / 2
            assert topo.rtt_ms(link.a, link.b) == rtt
    us3 = load_topology(REPO / "topologies" / "aws-us3.yaml")
    assert {d.name for d in us3.dcs} == {"virginia", "ohio", "oregon"}
    assert us3.rtt_ms("virginia", "oregon") == 67.0  # the README's example: 67 ms round trip
    for link in us3.wan:
        _rtt, gbps = pairs[frozenset((link.a.capitalize(), link.b.capitalize()))]
        assert link.rate_mbps == pytest.approx(gbps * 100, rel=1e-3)  # scaled by 10
    assert "factor of 10" in us3.source
    longhaul = load_topology(REPO / "topologies" / "aws-longhaul3.yaml")
    assert max(link.source_rtt_ms for link in longhaul.wan) > 200


def test_reverse_overrides_make_a_link_asymmetric():
    data = dict(GOOD, wan=[dict(GOOD["wan"][0], reverse={"delay_ms": 30})])
    topo = parse_topology(data)
    assert topo.direction("a", "b").delay_ms == 10
    assert topo.direction("b", "a").delay_ms == 30
    assert topo.direction("b", "a").rate_mbps == 100


def test_routes_without_a_direct_link_take_the_shortest_path():
    data = {
        "name": "line",
        "dcs": [{"name": n, "hosts": 1} for n in ("a", "b", "c")],
        "wan": [{"a": "a", "b": "b", "delay_ms": 5, "rate_mbps": 10}, {"a": "b", "b": "c", "delay_ms": 7, "rate_mbps": 10}],
    }
    topo = parse_topology(data)
    assert topo.path("a", "c") == ["a", "b", "c"]
    assert topo.one_way_delay_ms("a", "c") == 12


BROKEN = [
    ("name: [unclosed\n", "invalid YAML at line"),
    ("- just a list\n", "expected a mapping"),
    ({"name": "t", "wan": []}, "dcs: Field required"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], delay_ms=-1)]), "wan[0].delay_ms: Input should be greater than or equal to 0"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], b="nowhere")]), "wan[0]: unknown DC 'nowhere'"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], loss=1.5)]), "wan[0].loss: Input should be less than 1"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], rate_mbps=0)]), "wan[0].rate_mbps: Input should be greater than 0"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], jitter_ms=20)]), "jitter_ms (20.0) must not exceed delay_ms"),
    (dict(GOOD, wan=[GOOD["wan"][0], GOOD["wan"][0]]), "wan[1]: a second link between 'a' and 'b'"),
    (dict(GOOD, wan=[]), "wan: DC 'b' cannot be reached from 'a'"),
    (dict(GOOD, dcs=[{"name": "a", "hosts": 1}, {"name": "a", "hosts": 1}]), "duplicate DC name 'a'"),
    (dict(GOOD, dcs=[{"name": "A b", "hosts": 1}]), "dcs[0].name: must be lower-case"),
    (dict(GOOD, dcs=[{"name": "a", "hosts": 0}, {"name": "b", "hosts": 1}]), "dcs[0].hosts: Input should be greater than or equal to 1"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], bandwidth=5)]), "wan[0].bandwidth: Extra inputs are not permitted"),
    (dict(GOOD, wan=[dict(GOOD["wan"][0], reverse={"delay_ms": "slow"})]), "wan[0].reverse.delay_ms: Input should be a valid number"),
]


@pytest.mark.parametrize(("content", "message"), BROKEN, ids=[m for _, m in BROKEN])
def test_broken_files_get_one_line_naming_file_and_field(tmp_path, content, message):
    import yaml

    path = tmp_path / "broken.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    with pytest.raises(SpecError) as err:
        load_topology(path)
    text = str(err.value)
    assert "\n" not in text
    assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", text), text  # the file, and its line where known
    assert message in text, text


def test_missing_file_is_one_line():
    with pytest.raises(SpecError, match=r"^/nonexistent.yaml: cannot read"):
        load_topology("/nonexistent.yaml")


def test_aws_generator_rejects_unknown_region():
    with pytest.raises(ValueError, match="unknown AWS region 'Mars'"):
        aws_topology("x", ["Virginia", "Mars"])


def test_cli_reports_broken_file_in_one_line_and_creates_nothing(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\ndcs:\n  - {name: a, hosts: 1}\nwan:\n  - {a: a, b: zz, delay_ms: 1, rate_mbps: 1}\n")
    before = set(Path("/sys/class/net").iterdir())
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "fidelity", str(path)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "wan[0]: unknown DC 'zz'" in lines[0]
    assert set(Path("/sys/class/net").iterdir()) == before
