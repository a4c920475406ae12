"""Operating a server: the Prometheus endpoint (`--metrics-port`), scraped with urllib on 127.0.0.1
during a rollout and parsed with prometheus_client's own parser; RPCs counted by status code; the
periodic `stats` log line; the engine-side counters; the progress bar of a checkpoint load (on a
terminal only). test_server.py scrapes its servers too, the engine in its own process included."""

from __future__ import annotations

import io
import logging
import socket
import time

import grpc
import pytest
import torch
from metrics_helpers import scrape, scrape_until, value

from rollout import build_engine
from rollout.cli import weights_progress
from rollout.engine.config import EngineConfig
from rollout.engine.loader import read_state_dict
from rollout.errors import InvalidArgument
from rollout.masks.pack import Supports
from rollout.outputs import SampleOutput
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.engine_stats import EngineStats
from trainer_client import RolloutClient

SAMPLING = dict(temperature=1.0, top_k=8, max_tokens=24, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=128, max_num_seqs=2)
    serve = ServeConfig(port=0, engine_process=False, metrics_port=0, stats_interval=0.2)
    with BackgroundServer(lambda: build_engine(config), serve) as srv:
        yield srv


def test_metrics_move_during_a_rollout(server):
    url = server.running.metrics_address
    before = scrape(url)
    assert value(before, "rollout_kv_blocks", state="free") > 0 and value(before, "rollout_running_requests") == 0
    with RolloutClient(server.address, timeout=120) as client:
        long = dict(SAMPLING, max_tokens=300)  # 2 samples at a time: the request runs on after the first two
        with client.stream(["def f(x):"], n=8, sampling=long, mask="support") as stream:
            during = scrape_until(url, lambda m: value(m, "rollout_samples_total", finish_reason="length") >= 1
                                  and value(m, "rollout_kv_blocks", state="used") > 0)  # (not between two waves)
            assert value(during, "rollout_running_requests") == 1  # scraped while the request runs
            assert value(during, "rollout_queued_samples") + value(during, "rollout_running_sequences") >= 1
            assert value(during, "rollout_kv_blocks", state="used") + value(during, "rollout_kv_blocks",
                                                                            state="free") == 128
            assert value(during, "rollout_mask_bytes_total") > 300 * 8  # at least an int32 id per token
            assert ("rollout_output_tokens_in_flight", ()) in during and ("rollout_preemptions_total", ()) in during
            assert next(stream).num_rows >= 1
        # leaving the block cancelled it: the rest of its samples were aborted
        cancelled = scrape_until(url, lambda m: value(m, "rollout_samples_total", finish_reason="abort") + value(
            m, "rollout_samples_total", finish_reason="length") == 8 and not value(m, "rollout_running_requests"))
        assert value(cancelled, "rollout_requests_total", rpc="Generate", code="CANCELLED") == 1
        table = client.generate(["a"], n=4, sampling=SAMPLING)
    after = scrape_until(url, lambda m: value(m, "rollout_requests_total", rpc="Generate", code="OK") == 1 and value(
        m, "rollout_samples_total", finish_reason="length") - value(cancelled, "rollout_samples_total",
                                                                   finish_reason="length") == 4)
    tokens = value(after, "rollout_generated_tokens_total") - value(cancelled, "rollout_generated_tokens_total")
    assert table.num_rows == 4 and tokens == 4 * 24
    steps = value(after, "rollout_step_seconds_count") - value(cancelled, "rollout_step_seconds_count")
    assert steps >= 24 and value(after, "rollout_step_seconds_sum") > 0  # a step per token of a sample
    verify_steps = value(after, "rollout_verify_steps_total") - value(cancelled, "rollout_verify_steps_total")
    assert verify_steps == 4 * 24  # one token per step without a drafter
    assert value(after, "rollout_tokens_per_verify_step_bucket", le="1.0") == value(
        after, "rollout_tokens_per_verify_step_count")  # every sample's mean is 1 (aborted ones too)


def test_rpcs_are_counted_by_status_code_and_weight_updates_by_version(server):
    url = server.running.metrics_address
    with RolloutClient(server.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError):
            client.generate("x", sampling=dict(top_p=2.0))
        embed = server.engine_call(lambda e: e.model.embed_tokens.weight.detach().clone())
        with pytest.raises(grpc.RpcError):  # (on the weight port, as the good one: counted there too)
            client.update_weights({"model.bogus.weight": embed}, streams=1)
        assert client.update_weights({"model.embed_tokens.weight": embed}) == 1
        assert client._weight_address != server.address
        client.server_info()
    after = scrape_until(url, lambda m: value(m, "rollout_policy_version") == 1)
    assert value(after, "rollout_requests_total", rpc="Generate", code="INVALID_ARGUMENT") == 1
    assert value(after, "rollout_requests_total", rpc="UpdateWeights", code="INVALID_ARGUMENT") == 1
    assert value(after, "rollout_requests_total", rpc="UpdateWeights", code="OK") == 1
    assert value(after, "rollout_requests_total", rpc="GetServerInfo", code="OK") >= 1
    assert value(after, "rollout_weight_updates_total") == 1


def test_stats_lines_while_busy_and_none_when_idle(server, caplog):
    caplog.set_level(logging.INFO, logger="rollout.server")
    time.sleep(0.5)  # the line about the earlier tests' work has gone out
    caplog.clear()
    with RolloutClient(server.address, timeout=120) as client:
        client.generate(["a", "b"], n=2, sampling=SAMPLING)
    time.sleep(0.5)
    lines = [r for r in caplog.records if r.getMessage() == "stats"]
    assert lines, "no stats line while the server was busy"
    assert sum(r.fields["samples"] for r in lines) == 4 and sum(r.fields["tokens"] for r in lines) == 4 * 24
    assert {"requests", "queued", "running", "kv_used", "tokens_per_s", "step_ms", "tokens_per_verify_step",
            "preemptions", "policy_version"} <= set(lines[0].fields)
    caplog.clear()
    time.sleep(0.6)  # idle: nothing to say
    assert not [r for r in caplog.records if r.getMessage() == "stats"]


def test_engine_stats_count_steps_samples_and_masks():
    stats = EngineStats()
    for seconds in (0.0005, 0.003, 20.0):
        stats.record_step(seconds)
    supports = Supports.from_lists([[1, 2], [3]], [[-0.5, -1.0], [0.0]])
    stats.record_samples([
        SampleOutput("r", 0, 0, [1, 2, 3], [5, 6, 7], finish_reason="stop", accept_lengths=[1, 2], supports=supports),
        SampleOutput("r", 0, 1, [1, 2, 3], [], finish_reason="abort"),
    ])  # fmt: skip
    counts = stats.counts
    assert counts.steps[0] == 1 and counts.steps[2] == 1 and counts.steps[-1] == 1  # 20 s: the +Inf bucket
    assert counts.samples == {"stop": 1, "abort": 1} and counts.generated_tokens == 3 and counts.prompt_tokens == 6
    assert counts.verify_steps == 2 and counts.acceptance[2] == 1 and counts.acceptance_sum == 1.5  # 3 tokens in 2
    assert counts.mask_bytes == 3 * 4 + 2 * 4 + 3 * 4  # ids, lengths, log-probs


def test_weight_loading_progress_shows_on_a_terminal_only(tiny_random_qwen3, capsys):
    seen = []

    def progress(items, description):
        seen.append((len(items), description))
        return items

    state = read_state_dict(tiny_random_qwen3, progress)
    assert seen == [(len(state), f"loading {tiny_random_qwen3.name}")] and all(
        isinstance(t, torch.Tensor) for t in state.values())

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log_file = Terminal(), io.StringIO()
    assert list(weights_progress(list(range(5)), "loading x", file=terminal)) == list(range(5))
    assert list(weights_progress(list(range(5)), "loading x", file=log_file)) == list(range(5))
    assert "loading x:   0%" in terminal.getvalue() and "0/5" in terminal.getvalue()
    assert log_file.getvalue() == ""  # redirected stderr (a log): no bar


def test_metrics_endpoint_is_off_by_default_and_a_taken_port_is_refused(tiny_random_qwen3):
    assert ServeConfig().metrics_port is None and ServeConfig().metrics_host == "127.0.0.1"
    with pytest.raises(InvalidArgument, match="metrics_port"):
        ServeConfig(metrics_port=70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=16)
        with pytest.raises(InvalidArgument, match=f"metrics_port: cannot listen on 127.0.0.1:{port}: "):
            BackgroundServer(lambda: build_engine(config), ServeConfig(port=0, engine_process=False,
                                                                    metrics_port=port)).__enter__()
