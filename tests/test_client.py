"""trainer_client pieces: request building, the weight-piece stream received by the server's
receiver (state dicts of every floating dtype, pieces of large tensors cut anywhere, casts,
safetensors files and directories, refusals at a tensor's first piece), table assembly; and,
against a real server, the trainer-side replay: the batch's model inputs through transformers'
model, its output logits and `masked_logprobs` reproduce the returned `token_logprobs` (sampled
with masks, temperature 1 without, greedy)."""

from __future__ import annotations

import dataclasses
import json
import re

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.grammar import GrammarSpec
from rollout.engine.weight_specs import WeightSpecs, tensor_specs
from rollout.errors import InvalidArgument
from rollout.schema import ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.arena import HostArena
from rollout.server.weights import WeightUpload
from rollout.weight_wire import decode_chunk, encode_piece
from trainer_client import RolloutClient, masked_logprobs, to_torch
from trainer_client import client as client_module
from trainer_client.client import build_request, to_table
from trainer_client.weights import encoded_ahead, weight_pieces


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


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.mark.parametrize("grammar, kind, value", [
    (SCHEMA, "json_schema", json.dumps(SCHEMA)),  # a dict is a JSON schema
    (json.dumps(SCHEMA), "json_schema", json.dumps(SCHEMA)),  # so is a JSON object string
    (("json_schema", SCHEMA), "json_schema", json.dumps(SCHEMA)),
    ({"kind": "json_schema", "value": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    (["regex", "[0-9]+"], "regex", "[0-9]+"),
    ({"kind": "ebnf", "value": "root ::= 'a'"}, "ebnf", "root ::= 'a'"),
    (GrammarSpec("regex", "a|b"), "regex", "a|b"),
])  # fmt: skip
def test_grammar_forms(grammar, kind, value):
    request = build_request("x", 1, None, None, grammar, None)
    assert (request.grammar.kind, request.grammar.value) == (kind, value)


@pytest.mark.parametrize("grammar, message", [
    ("[0-9]+", "JSON schema object"),  # a bare regex is not guessed
    ('["a"]', "JSON schema object"),
    (3, "got int"),
    (("regex", 5), "must be a string"),
    (("lark", "x"), "kind must be one of"),
    ({"kind": "regex", "value": ""}, "non-empty"),
    (("regex", "a", "b"), "got tuple"),
])  # fmt: skip
def test_other_grammars_are_refused_naming_grammar(grammar, message):
    with pytest.raises(InvalidArgument, match=f"^grammar: .*{message}"):
        build_request("x", 1, None, None, grammar, None)


def test_stop_strings_and_text_on_the_wire():
    request = build_request("x", 1, dict(stop="\n\n"), None, None, None, return_text=True)
    assert list(request.sampling.stop) == ["\n\n"] and request.return_text
    assert list(build_request("x", 1, dict(stop=["a", "b"]), None, None, None).sampling.stop) == ["a", "b"]
    with pytest.raises(InvalidArgument, match="sampling"):
        build_request("x", 1, dict(stop=[3]), None, None, None)


def test_decode_a_table_with_a_tokenizer_its_file_or_its_directory():
    from tokenizers import Tokenizer

    from rollout.engine.config import DEFAULT_MODEL
    from rollout.outputs import SampleOutput
    from rollout.schema import to_record_batch
    from trainer_client import decode

    rows = [SampleOutput("r", 0, 0, prompt_token_ids=list(b"p:"), token_ids=[*"héllo".encode(), 256]),
            SampleOutput("r", 0, 1, prompt_token_ids=[259], token_ids=[])]  # fmt: skip
    table = pa.Table.from_batches([to_record_batch(rows)])
    for tokenizer in (DEFAULT_MODEL, DEFAULT_MODEL / "tokenizer.json", str(DEFAULT_MODEL),
                      Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))):  # fmt: skip
        assert decode(table, tokenizer) == ["héllo", ""]  # EOS left out, as in the text column
    assert decode(table, DEFAULT_MODEL, column="prompt_token_ids", skip_special_tokens=False) == ["p:", "<|im_start|>"]
    with pytest.raises(InvalidArgument, match="^tokenizer: .*does not exist"):
        decode(table, "/nonexistent")
    with pytest.raises(InvalidArgument, match="^column"):
        decode(table, DEFAULT_MODEL, column="nope")


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


def _receive(pieces, specs: WeightSpecs) -> dict[tuple[bool, str], torch.Tensor]:
    """The server's side of an UpdateWeights stream: each piece serialised, decoded and written into
    an arena; the tensors read back from it, by (drafter?, name)."""
    arena = HostArena()
    arena.reserve(specs.budget())
    upload = WeightUpload(specs, arena, "token")
    for piece in pieces:
        upload.add(decode_chunk(encode_piece(piece)))
    tables = {False: specs.target, True: specs.draft}
    out = {}
    for t in upload.finish().tensors:
        spec = tables[t.draft][t.key]
        out[(t.draft, t.name)] = arena.view(t.offset, spec.nbytes).view(getattr(torch, t.dtype)).view(spec.shape)
    return out


def test_weight_pieces_round_trip_through_the_server_receiver():
    torch.manual_seed(0)
    state = {
        "big": torch.randn(40, 30),
        "half": torch.randn(7, 3).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "strided": torch.randn(6, 5).t(),
        "empty": torch.zeros(0, 4),
        "cast": torch.randn(9, 7, dtype=torch.float64),  # lands as the spec's bfloat16, pieces cut mid-element
    }
    draft = {"d": torch.randn(3, 4)}
    specs = WeightSpecs(tensor_specs({**state, "cast": state["cast"].bfloat16()}), tensor_specs(draft))
    pieces = list(weight_pieces(state, draft_weights=draft, piece_bytes=1001))
    assert sum(b"\x0a\x03big" in p.head for p in pieces) == 5  # 4800 bytes in pieces of 1001
    got = _receive(pieces, specs)
    assert set(got) == {(False, n) for n in state} | {(True, "d")}
    for (is_draft, name), back in got.items():
        want = (draft if is_draft else state)[name]
        want = want.bfloat16() if name == "cast" else want
        assert back.dtype == want.dtype and back.shape == want.shape and torch.equal(back, want)


def test_encoded_ahead_builds_messages_in_order_one_piece_ahead_and_raises_errors_in_place():
    state = {"a": torch.randn(10, 10), "b": torch.randn(7).to(torch.bfloat16)}
    pieces = list(weight_pieces(state, piece_bytes=64))
    assert list(encoded_ahead(pieces)) == [encode_piece(p) for p in pieces]
    pulled: list = []

    def source():
        for piece in pieces:
            pulled.append(piece)
            yield piece
        raise InvalidArgument("weights", "broken source")

    messages = encoded_ahead(source())
    assert next(messages) == encode_piece(pieces[0])
    messages.close()  # gRPC stopped asking (the server refused early): the worker stops too
    assert len(pulled) <= 2
    with pytest.raises(InvalidArgument, match="broken source"):
        list(encoded_ahead(source()))


def test_weight_pieces_from_safetensors_file_and_directory(tmp_path):
    a, b = {"a": torch.randn(5, 5), "z": torch.zeros(0)}, {"b": torch.randn(3).to(torch.bfloat16)}
    save_file(a, tmp_path / "model-00001.safetensors")
    save_file(b, tmp_path / "model-00002.safetensors")
    specs = WeightSpecs(tensor_specs({**a, **b}), tensor_specs(a))
    got = _receive(weight_pieces(tmp_path, piece_bytes=7), specs)
    assert torch.equal(got[(False, "a")], a["a"]) and torch.equal(got[(False, "b")], b["b"])
    got = _receive(weight_pieces(tmp_path / "model-00001.safetensors", draft=True, piece_bytes=64), specs)
    assert set(got) == {(True, "a"), (True, "z")} and torch.equal(got[(True, "a")], a["a"])
    with pytest.raises(InvalidArgument, match="weights"):
        weight_pieces(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda p: dataclasses.replace(p, head=p.head.replace(b"\x1a\x02\x02\x02", b"\x1a\x02\x03\x02")),
     "has shape (3, 2), expected (2, 2)"),
    (lambda p: dataclasses.replace(p, head=p.head.replace(b"float32", b"int32\x00\x00")), "must be a floating"),
    (lambda p: dataclasses.replace(p, head=p.head.replace(b"\x0a\x01w", b"\x0a\x01v")), "unknown tensor 'v'"),
])
def test_receiver_refuses_a_tensor_at_its_first_piece(edit, message):
    specs = WeightSpecs(tensor_specs({"w": torch.zeros(2, 2)}))
    pieces = list(weight_pieces({"w": torch.zeros(2, 2)}, piece_bytes=4))
    arena = HostArena()
    arena.reserve(specs.budget())
    upload = WeightUpload(specs, arena, "token")
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        upload.add(decode_chunk(encode_piece(edit(pieces[0]))))
    assert arena.used == 0  # refused before any space was taken for it


def test_receiver_refuses_incomplete_duplicate_and_empty_updates():
    specs = WeightSpecs(tensor_specs({"w": torch.zeros(2, 2), "v": torch.zeros(3)}))
    with pytest.raises(InvalidArgument, match="do not fill"):
        _receive(list(weight_pieces({"w": torch.zeros(2, 2)}, piece_bytes=4))[:-1], specs)
    with pytest.raises(InvalidArgument, match="sent twice"):
        _receive(weight_pieces({"w": torch.zeros(2, 2), "model.w": torch.zeros(2, 2)}), specs)
    with pytest.raises(InvalidArgument, match="more than the 16 bytes"):
        _receive([*weight_pieces({"w": torch.zeros(2, 2)})] * 2, specs)
    with pytest.raises(InvalidArgument, match="no tensors"):
        _receive([], specs)


@pytest.mark.parametrize("sampling, mask", [
    (dict(temperature=0.8, top_k=16, top_p=0.9), "support"),
    (dict(temperature=1.0), None),  # no masks: the plain log-softmax
    (dict(temperature=0.0), "selected"),  # greedy: singleton supports
])  # fmt: skip
def test_the_trainer_path_through_the_batch_helpers_reproduces_token_logprobs(served_tiny, sampling, mask):
    """`model(**batch.model_inputs())`, `batch.output_logits`, `masked_logprobs` at each row's own
    temperature (no argument): transformers' float32 model gives the rollout's own log-probs."""
    model, address = served_tiny
    with RolloutClient(address, timeout=120) as client:
        table = client.generate([[7, 8, 9, 10], "x = "], n=2, sampling=dict(sampling, max_tokens=10, seed=5),
                                mask=mask)  # fmt: skip
    batch = to_torch(table)
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits  # [B, T, V]
    out_logits = batch.output_logits(logits)  # [B, L, V]
    replay = masked_logprobs(out_logits, batch)
    served = batch.token_logprobs
    assert torch.allclose(replay[batch.loss_mask], served[batch.loss_mask], atol=2e-4)
    if sampling["temperature"] == 0.0:  # the helpers' alignment, not only 0 == 0
        assert torch.equal(out_logits.argmax(-1)[batch.loss_mask], batch.token_ids[batch.loss_mask])
    else:
        assert (served[batch.loss_mask] < -1e-3).any()


@pytest.fixture(scope="module")
def served_tiny(tiny_random_qwen3):
    """transformers' float32 model of tiny_random_qwen3 and the address of a float32 server of it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_random_qwen3, dtype=torch.float32).eval()
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=128)
    with BackgroundServer(lambda: build_engine(config), ServeConfig(port=0, engine_process=False)) as server:
        yield model, server.address
