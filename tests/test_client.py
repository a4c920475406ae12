"""trainer_client pieces: request building, the weight-chunk stream reassembled by the server's
assembler (state dicts of every dtype, pieces of large tensors, safetensors files and
directories), table assembly; and, against a real server, the trainer-side replay:
`masked_logprobs` on the model's own logits reproduces the returned `token_logprobs`."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.errors import InvalidArgument
from rollout.schema import ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.weights import assemble
from trainer_client import RolloutClient, masked_logprobs, to_torch
from trainer_client import client as client_module
from trainer_client.client import build_request, to_table, weight_chunks


def test_build_request_prompts_sampling_and_grammar():
    req = build_request("one", 2, dict(temperature=0.0, top_k=None, logit_bias={3: 1.0}), "support",
                        {"kind": "regex", "value": "[0-9]+"}, "rid")  # fmt: skip
    assert [p.text for p in req.prompts] == ["one"] and req.n == 2 and req.mask == "support"
    assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_k")
    assert (req.grammar.kind, req.grammar.value, req.request_id) == ("regex", "[0-9]+", "rid")
    req = build_request([torch.tensor([1, 2]), [3]], 1, None, None, ("ebnf", "root ::= 'a'"), None)
    assert [list(p.token_ids.ids) for p in req.prompts] == [[1, 2], [3]] and req.request_id == ""
    with pytest.raises(InvalidArgument, match="temprature"):
        build_request("x", 1, dict(temprature=1.0), None, None, None)


def test_empty_stream_is_an_empty_table_in_the_rollout_schema():
    assert to_table([]).schema == ROLLOUT_SCHEMA and to_table([]).num_rows == 0


def test_to_table_orders_the_streamed_rows_by_prompt_then_sample():
    """Rows arrive in finishing order over several batches; the table is what Arrow's sort_by gives
    (to_table moves runs of rows instead of taking the nested columns row by row)."""
    import random

    import numpy as np

    from rollout.masks.pack import Supports
    from rollout.outputs import SampleOutput
    from rollout.schema import schema_with_metadata, to_record_batch

    rng = random.Random(0)
    samples = []
    for p in range(5):
        for s in range(3):
            lens = np.array([rng.randint(1, 4) for _ in range(p + s + 1)], np.int32)
            ids = np.arange(int(lens.sum()), dtype=np.int32) + 100 * p + 10 * s
            samples.append(SampleOutput(
                request_id="r", prompt_index=p, sample_index=s, prompt_token_ids=[p], token_ids=[s] * len(lens),
                token_logprobs=[-1.0] * len(lens), finish_reason="length", accept_lengths=[1] * len(lens),
                supports=Supports(ids, lens, -ids.astype(np.float32)), policy_version=0))
    tail = samples[9:]
    rng.shuffle(tail)
    order = samples[3:7] + samples[:3] + samples[7:9] + tail  # a run out of place, a shuffled tail
    schema = schema_with_metadata("m", "", "none", "support", 4)
    batches = [to_record_batch(order[i:i + 4], schema) for i in range(0, len(order), 4)]
    table = to_table(batches)
    assert table.equals(pa.Table.from_batches(batches).sort_by(client_module.SORT_KEYS))
    assert table.column("prompt_index").to_pylist() == [p for p in range(5) for _ in range(3)]
    assert table.column("sample_index").to_pylist() == [0, 1, 2] * 5
    assert table.schema.metadata == schema.metadata


def test_weight_chunks_round_trip_through_the_server_assembler(monkeypatch):
    monkeypatch.setattr(client_module, "WEIGHT_PIECE_BYTES", 1000)
    torch.manual_seed(0)
    state = {
        "big": torch.randn(40, 30),
        "half": torch.randn(7, 3).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "flags": torch.tensor([True, False, True]),
        "strided": torch.randn(6, 5).t(),
        "empty": torch.zeros(0, 4),
    }
    draft = {"d": torch.arange(12, dtype=torch.int64).reshape(3, 4)}
    chunks = list(weight_chunks(state, draft_weights=draft))
    assert sum(c.tensor.name == "big" for c in chunks) == 5  # 4800 bytes in pieces of 1000
    got, got_draft = assemble(chunks)
    assert set(got) == set(state) and set(got_draft) == {"d"}
    for name, tensor in {**state, **draft}.items():
        back = {**got, **got_draft}[name]
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_weight_chunks_from_safetensors_file_and_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "WEIGHT_PIECE_BYTES", 64)
    a, b = {"a": torch.randn(5, 5)}, {"b": torch.randn(3).to(torch.bfloat16)}
    save_file(a, tmp_path / "model-00001.safetensors")
    save_file(b, tmp_path / "model-00002.safetensors")
    state, draft = assemble(weight_chunks(tmp_path))
    assert draft is None and torch.equal(state["a"], a["a"]) and torch.equal(state["b"], b["b"])
    state, draft = assemble(weight_chunks(tmp_path / "model-00001.safetensors", draft=True))
    assert state == {} and torch.equal(draft["a"], a["a"])
    with pytest.raises(InvalidArgument, match="weights"):
        weight_chunks(tmp_path / "missing.safetensors")


def test_assembler_refuses_malformed_pieces():
    chunks = list(weight_chunks({"w": torch.zeros(2, 2)}))
    chunks[0].tensor.shape[:] = [3, 2]
    with pytest.raises(InvalidArgument, match="tensor w"):
        assemble(chunks)
    with pytest.raises(InvalidArgument, match="weights"):
        assemble([])
    chunks = list(weight_chunks({"w": torch.zeros(2)}))
    chunks[0].tensor.dtype = "complex32"
    with pytest.raises(InvalidArgument, match="dtype"):
        assemble(chunks)


def test_masked_logprobs_on_the_models_own_logits_reproduce_token_logprobs(tiny_random_qwen3):
    import transformers

    temperature = 0.8
    sampling = dict(temperature=temperature, top_k=16, top_p=0.9, max_tokens=10, seed=5)
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=128)
    with BackgroundServer(lambda: build_engine(config), ServeConfig(port=0, engine_process=False)) as server:
        with RolloutClient(server.address, timeout=120) as client:
            table = client.generate([[7, 8, 9, 10], "x = "], n=2, sampling=sampling, mask="support")
    batch = to_torch(table)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_random_qwen3, dtype=torch.float32).eval()
    length = batch.token_ids.shape[1]
    logits = torch.zeros(len(table), length, model.config.vocab_size)  # [B, L, V]
    for b in range(len(table)):
        prompt = batch.prompt_ids[b, : batch.prompt_lens[b]]
        n_out = int(batch.loss_mask[b].sum())
        ids = torch.cat([prompt, batch.token_ids[b, :n_out]])[None]  # [1, P + n_out]
        with torch.no_grad():
            out = model(ids).logits[0]  # [P + n_out, V]
        logits[b, :n_out] = out[len(prompt) - 1 : len(prompt) - 1 + n_out]
    replay = masked_logprobs(logits, batch, temperature=temperature)
    served = batch.token_logprobs
    assert torch.allclose(replay[batch.loss_mask], served[batch.loss_mask], atol=2e-4)
