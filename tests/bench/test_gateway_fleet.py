"""The fleet gateway benchmark's pure parts: Envoy's two modes, the shared rate ladder, the workloads."""

from __future__ import annotations

import itertools
import os
from typing import Any

from bench.gateway import fleet

ENGINES = [("127.0.0.2", 8123), ("127.0.0.3", 8123)]
PORTS = fleet.GatewayPorts(9002, 9003, 9090, 19000, 8081, 8082)


def _listener(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in cfg["static_resources"]["listeners"] if x["name"] == name)


def _cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    conf: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return conf


def test_epp_listener_asks_the_picker_and_goes_where_its_header_says() -> None:
    cfg = fleet.envoy_config(PORTS, ENGINES)
    hcm = _hcm(_listener(cfg, "epp"))
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] == "original_destination_cluster"
    dst = _cluster(cfg, "original_destination_cluster")
    assert dst["type"] == "ORIGINAL_DST"
    assert dst["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"
    ext = _cluster(cfg, "ext_proc")
    # Plaintext HTTP/2 to the EPP's gRPC port (it runs with --secure-serving=false): no TLS socket.
    assert "transport_socket" not in ext
    addr = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr["port_value"] == PORTS.epp_grpc


def test_rr_listener_spreads_over_the_same_engines_without_the_picker() -> None:
    cfg = fleet.envoy_config(PORTS, ENGINES)
    hcm = _hcm(_listener(cfg, "rr"))
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    rr = _cluster(cfg, "engines")
    assert rr["lb_policy"] == "ROUND_ROBIN"
    eps = rr["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addrs = [e["endpoint"]["address"]["socket_address"] for e in eps]
    assert [(a["address"], a["port_value"]) for a in addrs] == ENGINES


def test_ladder_goes_up_while_both_pass_down_while_both_fail() -> None:
    assert fleet.next_rate(10, {"epp": True, "rr": True}) == 15
    assert fleet.next_rate(10, {"epp": False, "rr": False}) == 6
    assert fleet.next_rate(10, {"epp": True, "rr": False}) == 12.5


def test_goodput_is_per_mode_and_needs_every_lower_rate_passed() -> None:
    steps = [
        {"mode": "epp", "rate_rps": 8.0, "passed": True},
        {"mode": "rr", "rate_rps": 8.0, "passed": True},
        {"mode": "epp", "rate_rps": 12.0, "passed": True},
        {"mode": "rr", "rate_rps": 12.0, "passed": False},
        {"mode": "rr", "rate_rps": 15.0, "passed": True},
    ]
    assert fleet.goodput(steps, "epp") == 12.0
    assert fleet.goodput(steps, "rr") == 8.0  # a pass above a failure does not count


def test_each_turn_extends_the_previous_prompt() -> None:
    words = fleet.Words(tokens_per_word=2.0, seed=1)
    work = fleet.conversations(words, 3, 4, 100, 20, 30, 0.5, seed=2)
    for session in work.turns:
        assert len(session) == 4
        for earlier, later in itertools.pairwise(session):
            assert later.text.startswith(earlier.text)  # the prefix cache can reuse the whole earlier prompt
            assert later.tokens > earlier.tokens
    assert work.describe()["session_pool"] == 3


def test_shared_system_prompt_is_the_same_for_every_request() -> None:
    words = fleet.Words(tokens_per_word=1.0, seed=1)
    work = fleet.shared_system(words, 5, 200, 20, seed=3)
    heads = {p.text.split("\n", 1)[0] for p in work.prompts}
    assert len(heads) == 1 and len(next(iter(heads)).split()) == 200
    assert len({p.text for p in work.prompts}) == 5


def test_spread_reports_what_each_engine_served_in_the_run() -> None:
    before = [{"requests": 10.0, "prompt_tokens": 100.0, "prefix_queries": 0.0, "prefix_hits": 0.0}] * 2
    after = [
        {"requests": 20.0, "prompt_tokens": 300.0, "prefix_queries": 200.0, "prefix_hits": 150.0},
        {"requests": 10.0, "prompt_tokens": 100.0, "prefix_queries": 0.0, "prefix_hits": 0.0},
    ]
    assert fleet.spread(before, after) == [
        {"requests": 10, "prompt_tokens": 200, "prefix_hit_pct": 75.0},
        {"requests": 0, "prompt_tokens": 0, "prefix_hit_pct": None},
    ]


def test_proc_sample_reads_this_process() -> None:
    s = fleet.proc_sample(os.getpid())
    assert s is not None and s.cpu_s > 0 and s.rss_kib > 0 and s.hwm_kib >= s.rss_kib
