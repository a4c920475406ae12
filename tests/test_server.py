"""The real server end to end: the engine on a tiny random Qwen3 (tests/conftest.py) with random
DFlash / DSpark drafters, served on 127.0.0.1 by grpc.aio in this process, reached through
trainer_client. Round trips for every spec and mask mode (schema, validator, lossless greedy),
200 concurrent streams with half cancelled (KV blocks come back), the malformed-request matrix,
and weight updates (outputs change, versions never mix, a wrong shape changes nothing)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from metrics_helpers import scrape, scrape_until, value
from safetensors.torch import load_file

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.errors import InvalidArgument
from rollout.masks.check import check_table
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.schema import ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.spec.draft_loader import load_drafter, random_drafter, save_drafter
from trainer_client import AsyncRolloutClient, RolloutClient

PROMPTS = ["import os\n", [40, 41, 42, 43, 44]]
SAMPLING = dict(temperature=1.0, top_k=16, top_p=0.9, max_tokens=12, seed=3)


@pytest.fixture(scope="module")
def drafters(tiny_random_qwen3, tmp_path_factory):
    target = load_model(tiny_random_qwen3, "cpu")
    root = tmp_path_factory.mktemp("drafters")
    for kind in ("dflash", "dspark"):
        save_drafter(random_drafter(target, kind, block_size=4, seed=1), root / kind)
    return root


def _server_pool(model, drafters, engine_process: bool, build=build_engine):
    """get(spec, **engine_overrides) -> a BackgroundServer, started once per configuration, and
    the servers started. `build(config)` makes the engine (a module-level function: it may run in
    the engine process)."""
    started: dict[tuple, BackgroundServer] = {}

    def get(spec: str = "none", **overrides) -> BackgroundServer:
        key = (spec, *sorted(overrides.items()))
        if key not in started:
            draft = None if spec == "none" else str(drafters / spec)
            config = EngineConfig(model=str(model), draft=draft, spec=spec, **overrides)
            serve = ServeConfig(port=0, engine_process=engine_process, metrics_port=0)
            started[key] = BackgroundServer(functools.partial(build, config), serve).__enter__()
        return started[key]

    return get, started


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def servers(request, tiny_random_qwen3, drafters):
    """Every test of the module against both front ends: the engine on a thread of the server's
    process, and in its own process (what `rollout serve` runs)."""
    get, started = _server_pool(tiny_random_qwen3, drafters, request.param == "engine-process")
    yield get
    _close_all(started.values())


@pytest.fixture(scope="module")
def thread_servers(tiny_random_qwen3, drafters):
    get, started = _server_pool(tiny_random_qwen3, drafters, False)
    yield get
    _close_all(started.values())


def _close_all(servers) -> None:
    """Closes the servers side by side (an engine process takes ~2 s to stop)."""
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda server: server.close(), servers))


@pytest.mark.parametrize("spec", ["none", "dflash", "dspark"])
def test_round_trip_every_mask_mode(servers, spec):
    with RolloutClient(servers(spec).address, timeout=120) as client:
        for mask in (None, "selected", "support"):
            table = client.generate(PROMPTS, n=3, sampling=SAMPLING, mask=mask, request_id=f"{spec}-{mask}")
            assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
            meta = table.schema.metadata
            assert meta[b"spec_method"] == spec.encode() and meta[b"mask_mode"] == (mask or "none").encode()
            assert meta.get(b"mask_top_k") == (str(SAMPLING["top_k"]).encode() if mask else None)
            assert table.num_rows == 6 and set(table.column("request_id").to_pylist()) == {f"{spec}-{mask}"}
            assert table.column("prompt_token_ids").to_pylist()[0] == list(b"import os\n")
            assert all(1 <= len(t) <= 12 for t in table.column("token_ids").to_pylist())
            assert table.column("support_ids").null_count == (6 if mask is None else 0)
            assert table.column("support_logprobs").null_count == (0 if mask == "support" else 6)
            report = check_table(table, max_width=16)
            assert report.ok and report.vocab_size == 264, report.violations[:3]  # ids checked against it


def test_metrics_count_samples_and_tokens_per_verify_step(servers):
    """With a drafter, in both front ends (from an engine process the counters cross the pipe). Full
    blocks: the adaptive budget may price the random drafter's drafts out."""
    server = servers("dflash", spec_adaptive=False)
    url = server.running.metrics_address
    before = scrape(url)
    with RolloutClient(server.address, timeout=120) as client:
        table = client.generate(PROMPTS, n=3, sampling=SAMPLING)
    verify_steps = sum(len(a) for a in table.column("accept_lengths").to_pylist())
    tokens = sum(len(t) for t in table.column("token_ids").to_pylist())
    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    after = scrape_until(url, lambda m: value(m, "rollout_verify_steps_total") - value(
        before, "rollout_verify_steps_total") == verify_steps)
    assert verify_steps < tokens  # a block of 4 has its drafts accepted now and then
    assert sum(delta("rollout_samples_total", finish_reason=r) for r in ("stop", "length")) == 6
    assert delta("rollout_generated_tokens_total") == tokens
    assert delta("rollout_tokens_per_verify_step_count") == 6  # one observation per sample: its mean
    assert delta("rollout_tokens_per_verify_step_sum") == pytest.approx(
        sum(len(t) / len(a) for t, a in zip(table.column("token_ids").to_pylist(),
                                            table.column("accept_lengths").to_pylist())))
    assert value(after, "rollout_requests_total", rpc="Generate", code="OK") >= 1


def test_server_info_says_what_bounds_the_context(servers):
    with RolloutClient(servers("dflash").address, timeout=60) as client:
        info = client.server_info()
    limits = info["limits"]
    assert limits["max_model_len_by_model"] == 512  # the model's max_position_embeddings
    assert limits["max_model_len_by_drafter"] == 512 - 4 + 2  # its last draft block (of 4) must fit
    assert info["max_model_len"] == limits["max_model_len"] == min(
        v for k, v in limits.items() if k.startswith("max_model_len_by_"))


def test_greedy_is_identical_across_spec_methods(servers):
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for spec in ("none", "dflash", "dspark"):
        with RolloutClient(servers(spec).address, timeout=120) as client:
            table = client.generate(PROMPTS, n=2, sampling=greedy, mask="support")
            outputs[spec] = table.column("token_ids").to_pylist()
            assert check_table(table).ok
    assert outputs["none"] == outputs["dflash"] == outputs["dspark"]
    assert all(len(t) == 16 for t in outputs["none"])


def test_200_concurrent_streams_with_half_cancelled_return_kv_blocks(servers):
    server = servers("dflash", num_kv_blocks=2048)

    async def main():
        async with AsyncRolloutClient(server.address, timeout=300) as client:
            free0 = (await client.server_info())["kv_blocks_free"]
            long = dict(SAMPLING, max_tokens=400, ignore_eos=True)
            short = dict(SAMPLING, max_tokens=6, ignore_eos=True)
            doomed = [client.stream([[i % 200 + 1, 7, 9]], sampling=long) for i in range(100)]
            kept = [client.generate([[i % 200 + 1, 8]], n=1, sampling=short) for i in range(100)]
            tables = await asyncio.gather(*kept)
            assert all(t.num_rows == 1 and len(t.column("token_ids")[0]) == 6 for t in tables)
            assert (await client.server_info())["kv_blocks_free"] < free0  # the long ones hold blocks
            for stream in doomed:
                stream.close()
            await _until(lambda: _free(client), lambda free: free == free0)

    asyncio.run(main())


@pytest.mark.parametrize(
    "kwargs, code, field",
    [
        (dict(sampling=dict(temperature=-0.5)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(sampling=dict(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        # finite as doubles on the wire, not computable in the engine's float32: refused with the range
        (dict(sampling=dict(temperature=1e-39)), grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be 0 (greedy)"),
        (dict(sampling=dict(top_p=1e-46)), grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]"),
        (dict(sampling=dict(repetition_penalty=1e-38)), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty: must"),
        (dict(sampling=dict(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(mask="everything"), grpc.StatusCode.INVALID_ARGUMENT, "mask"),
        (
            dict(mask="support", sampling=dict(temperature=1.0, top_k=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_k",
        ),
        (dict(mask="support", sampling=dict(top_k=100)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(prompts=[[1, 2, 100000]]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompts=[[5] * 600]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompts=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompts"),
        (dict(n=0), grpc.StatusCode.INVALID_ARGUMENT, "n"),
        (dict(grammar=("regex", "(unclosed")), grpc.StatusCode.INVALID_ARGUMENT, "grammar"),
        (dict(prompts=[[1, 2]] * 40, n=2), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
)
def test_malformed_requests_name_the_field_and_the_server_keeps_serving(servers, kwargs, code, field):
    server = servers("none", max_mask_tokens=64, max_queued_samples=64)
    args = dict(prompts=[[1, 2, 3]], sampling=dict(max_tokens=4)) | kwargs
    with RolloutClient(server.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**args)
        assert err.value.code() == code, err.value.details()
        assert field in err.value.details()
        assert client.generate([[1, 2, 3]], n=2, sampling=dict(max_tokens=3)).num_rows == 2
        assert client.server_info()["kv_blocks_free"] == client.server_info()["kv_blocks_total"]


def test_an_unknown_grammar_kind_is_refused_by_the_client_and_by_the_server(servers):
    server = servers("none", max_mask_tokens=64, max_queued_samples=64)
    with RolloutClient(server.address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="^grammar: kind must be one of"):
            client.generate([[1, 2]], grammar=("yaml", "a: 1"))
        request = pb.GenerateRequest(prompts=[pb.Prompt(text="x")], grammar=pb.Grammar(kind="yaml", value="a: 1"))
        with pytest.raises(grpc.RpcError) as err:
            list(client._stub.Generate(request))  # what another client could send
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in err.value.details()


def test_update_weights_changes_outputs_never_mixes_versions_and_refuses_bad_shapes(servers, tiny_random_qwen3):
    server = servers("dflash", enable_prefix_caching=True, max_num_seqs=64)
    greedy = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    original = load_file(str(tiny_random_qwen3 / "model.safetensors"))
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * v.std() * torch.randn_like(v) for k, v in original.items()}
    with RolloutClient(server.address, timeout=120) as client:
        v0 = client.server_info()["policy_version"]
        before = client.generate(PROMPTS, n=4, sampling=greedy)  # the running request's batch shape
        name = next(iter(original))
        with pytest.raises(grpc.RpcError) as err:
            client.update_weights({name: torch.zeros(3, 3)})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
        assert client.server_info()["policy_version"] == v0
        assert client.generate(PROMPTS, n=4, sampling=greedy).column("token_ids") == before.column("token_ids")

        running = {}
        worker = threading.Thread(target=lambda: running.update(t=client.generate(PROMPTS, n=4, sampling=greedy)))
        worker.start()
        _wait_for(lambda: client.server_info()["kv_blocks_free"] < client.server_info()["kv_blocks_total"])
        assert client.update_weights(perturbed) == v0 + 1
        worker.join()
        assert running["t"].column("policy_version").to_pylist() == [v0] * 8  # drained on the old weights
        after = client.generate(PROMPTS, n=4, sampling=greedy)
        assert after.column("policy_version").to_pylist() == [v0 + 1] * 8
        assert after.column("token_ids") != before.column("token_ids")
        _assert_each_sample_is_one_version(running["t"], {v0: before, v0 + 1: after})
        assert client.update_weights(original) == v0 + 2
        restored = client.generate(PROMPTS, n=4, sampling=greedy)
        assert restored.column("token_ids") == before.column("token_ids")


def _assert_each_sample_is_one_version(table, references) -> None:
    """A greedy sample tagged with version v equals the greedy output of weights v."""
    for row in table.to_pylist():
        ref = references[row["policy_version"]].to_pylist()[4 * row["prompt_index"] + row["sample_index"]]
        assert row["token_ids"] == ref["token_ids"], f"sample mixes versions: {row['policy_version']}"


def _wait_for(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


async def _free(client: AsyncRolloutClient) -> int:
    return (await client.server_info())["kv_blocks_free"]


async def _until(get, ok, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while not ok(value := await get()):
        assert time.monotonic() < end, f"last value {value}"
        await asyncio.sleep(0.05)
    return value


def test_update_weights_replaces_the_drafter_in_the_same_call_losslessly(servers, drafters, tiny_random_qwen3):
    server = servers("dflash", max_num_seqs=32)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    target = load_file(str(tiny_random_qwen3 / "model.safetensors"))
    draft = load_file(str(drafters / "dflash" / "model.safetensors"))
    torch.manual_seed(1)
    noisy_draft = {k: v + v.std() * torch.randn_like(v) for k, v in draft.items()}
    with RolloutClient(server.address, timeout=120) as client:
        v0 = client.server_info()["policy_version"]
        before = client.generate(PROMPTS, n=2, sampling=greedy)
        assert client.update_weights(target, draft_weights=noisy_draft) == v0 + 1
        after = client.generate(PROMPTS, n=2, sampling=greedy)
        assert after.column("token_ids") == before.column("token_ids")  # a drafter never changes outputs
        assert after.column("policy_version").to_pylist() == [v0 + 1] * 4
        with pytest.raises(grpc.RpcError) as err:
            client.update_weights(target, draft_weights={"fc.weight": torch.zeros(2, 2)})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fc.weight" in err.value.details()
        assert client.server_info()["policy_version"] == v0 + 1


def test_drafter_weights_fetch_the_refreshed_drafter(servers, drafters, tiny_random_qwen3, tmp_path):
    """GetDrafterWeights after idle refresh: ServerInfo.drafter_stats counts the training; the fetched
    state dict differs from the loaded drafter, loads through the draft loader from the written
    directory, and goes back with update_weights(draft=True) without changing outputs."""
    server = servers("dspark", drafter_refresh="idle", drafter_refresh_lr=1e-3)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    original = load_file(str(drafters / "dspark" / "model.safetensors"))
    with RolloutClient(server.address, timeout=120) as client:
        before = client.generate(PROMPTS, n=2, sampling=greedy)
        deadline = time.monotonic() + 60
        while client.server_info()["drafter_stats"].get("refresh_steps", 0) < 1:
            assert time.monotonic() < deadline, "no refresh step while idle"
            time.sleep(0.05)
        state = client.drafter_weights(path=tmp_path / "fetched")
        assert state.keys() == original.keys()
        assert any(not torch.equal(state[k], original[k]) for k in original)  # refreshed
        loaded = load_drafter(tmp_path / "fetched", load_model(tiny_random_qwen3, "cpu"))
        assert loaded.config.kind == "dspark"
        fetched = asyncio.run(_fetch_async(server.address))
        assert fetched.keys() == state.keys()
        version = client.update_weights(state, draft=True)
        after = client.generate(PROMPTS, n=2, sampling=greedy)
        assert after.column("token_ids") == before.column("token_ids")
        assert after.column("policy_version").to_pylist() == [version] * 4
        assert client.server_info()["drafter_stats"]["refresh_version"] == version
    with RolloutClient(servers("none").address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.drafter_weights()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "drafter" in err.value.details()


async def _fetch_async(address: str) -> dict[str, torch.Tensor]:
    async with AsyncRolloutClient(address, timeout=120) as client:
        return await client.drafter_weights()


def _engine_with_mask_bound_2(config: EngineConfig) -> LLMEngine:
    """An engine process whose mask capture pretends the bound is 2 (runs in the child only)."""
    import rollout.engine.capture as capture_mod

    capture_mod.mask_width = lambda entries: 2
    return build_engine(config)


@pytest.mark.parametrize("engine", ["engine-thread", "engine-process"])
def test_mask_overflow_during_generation_is_failed_precondition(thread_servers, tiny_random_qwen3, drafters,
                                                                monkeypatch, engine):
    """A support that exceeds its bound fails that request with FAILED_PRECONDITION (no partial
    masks); a concurrent request on the same engine finishes normally."""
    import rollout.engine.capture as capture_mod

    if engine == "engine-thread":
        server = thread_servers("none", num_kv_blocks=512)
        monkeypatch.setattr(capture_mod, "mask_width", lambda entries: 2)  # pretend the bound is 2
        _check_overflow_fails_one_request(server)
        return
    get, _ = _server_pool(tiny_random_qwen3, drafters, True, build=_engine_with_mask_bound_2)
    server = get("none", num_kv_blocks=512)
    try:
        _check_overflow_fails_one_request(server)
    finally:
        server.close()


def _check_overflow_fails_one_request(server) -> None:
    wide = dict(temperature=1.5, top_k=64, max_tokens=8, seed=1)
    with RolloutClient(server.address, timeout=120) as client:
        stream = client.stream([[40, 41, 42]], sampling=wide, mask="support", request_id="wide")
        plain = client.generate([[40, 41, 42]], n=2, sampling=SAMPLING, request_id="plain")
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "bound" in err.value.details()
        assert plain.num_rows == 2
