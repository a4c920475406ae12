"""The server against careless or hostile clients, with the fake engine (tests/fake_engine.py):
bytes that are not a request message, prompts that cannot fit the context, messages over the size
bound, an admission that takes long, request ids reused right after a cancel, and the instance id
that tells one server from another."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from fake_engine import BYTE_TOKENIZER, MAX_LEN, TOTAL_BLOCKS, FakeEngine
from tokenizers import Tokenizer, normalizers

from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.admission import Admission, longest_token_bytes
from rollout.server.app import BackgroundServer
from rollout.server.config import MIN_REQUEST_BYTES, ServeConfig
from trainer_client import RolloutClient
from trainer_client.client import WEIGHT_PIECE_BYTES

LONGEST_TOKEN = len("<|reserved_0|>")  # the byte tokenizer's longest token, in bytes


class GatedTokenizer:
    """The fake's byte tokenizer, except that tokenising a text longer than 500 bytes waits until
    `gate` is set; records what it was asked to tokenise."""

    normalizer = None

    def __init__(self, inner: Tokenizer):
        self.inner, self.gate, self.entered, self.texts = inner, threading.Event(), threading.Event(), []

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return self.inner.get_vocab(with_added_tokens=with_added_tokens)

    def encode_batch(self, texts: list[str]):
        self._wait(texts)
        return self.inner.encode_batch(texts)

    def encode(self, text: str):  # (the engine thread tokenised with it before admission moved out)
        self._wait([text])
        return self.inner.encode(text)

    def _wait(self, texts: list[str]) -> None:
        self.texts += texts
        if any(len(t) > 500 for t in texts):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"


def _gated_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer = GatedTokenizer(engine.tokenizer)
    return engine


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(_gated_engine, ServeConfig(port=0, engine_process=False,
                                                     max_request_bytes=MIN_REQUEST_BYTES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server.address, timeout=30) as c:
        yield c


def _tokenizer(server) -> GatedTokenizer:
    return server.engine_call(lambda engine: engine.tokenizer)


@pytest.mark.parametrize("method", ["Generate", "Abort", "GetServerInfo"])
def test_bytes_that_are_not_a_request_are_invalid_argument(server, client, method):
    """(grpc's deserializer raised before the handler: UNKNOWN "Unexpected DecodeError".)"""
    with grpc.insecure_channel(server.address) as channel:
        path = f"/rollout.v1.Rollout/{method}"
        with pytest.raises(grpc.RpcError) as err:
            if method == "Generate":
                list(channel.unary_stream(path)(b"\xff\xff\xff", timeout=10))
            else:
                channel.unary_unary(path)(b"\x0a\x05ab", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request: is not a valid rollout.v1.")
    assert client.generate([[1]], sampling=dict(max_tokens=2)).num_rows == 1


def test_prompts_that_cannot_fit_are_refused_before_tokenising(server, client):
    """Text whose bytes need more tokens than the context (at most L bytes a token) and token ids
    longer than the context are refused by name at once; the tokenizer never sees that text.
    (The engine thread tokenised any text first: a 20 MB prompt took 24 s to be refused.)"""
    tokenizer = _tokenizer(server)
    too_long = "x" * (MAX_LEN * LONGEST_TOKEN + 1)
    with pytest.raises(grpc.RpcError) as err:
        client.generate([[1, 2], too_long])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (f"prompts[1].text: {len(too_long)} bytes need at least {MAX_LEN + 1} tokens "
                                   f"(at most {LONGEST_TOKEN} bytes a token), more than the context of "
                                   f"{MAX_LEN} tokens")
    with pytest.raises(grpc.RpcError) as err:
        client.generate([[1] * (MAX_LEN + 1)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"prompts[0].token_ids: {MAX_LEN + 1} tokens exceed the context")
    assert too_long not in tokenizer.texts


def test_a_slow_admission_does_not_hold_other_requests(server, client):
    """Text that may fit is tokenised off the engine thread: while a long text is being tokenised
    (the gated tokenizer holds it), a token-id request and a short text finish; then the long one is
    refused by its token count."""
    tokenizer = _tokenizer(server)
    long_text = "y" * (MAX_LEN * LONGEST_TOKEN - 1)  # 895 bytes could be 64 tokens; it is 895
    outcome = {}

    def send_long():
        try:
            client.generate([long_text], sampling=dict(max_tokens=2))
        except grpc.RpcError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=send_long)
    worker.start()
    try:
        assert tokenizer.entered.wait(30)
        assert client.generate([[1, 2]], sampling=dict(max_tokens=4), timeout=10).num_rows == 1
        short = client.generate(["hi"], sampling=dict(max_tokens=4), timeout=10)
        assert short.column("prompt_token_ids").to_pylist() == [[104, 105]]
    finally:
        tokenizer.gate.set()
        worker.join(30)
    assert outcome["error"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome["error"].details() == (f"prompts[0].text: {len(long_text)} tokens exceed the context of "
                                          f"{MAX_LEN} tokens")


def test_a_message_over_the_size_bound_is_refused_and_weight_chunks_fit_under_it(client):
    """--max-request-bytes bounds each message (the server ran with the smallest allowed, 16 MiB):
    a larger request is RESOURCE_EXHAUSTED before it is read; an UpdateWeights stream of a tensor
    larger than the bound passes, cut in trainer_client's pieces (the fake then refuses its name)."""
    with pytest.raises(grpc.RpcError) as err:
        client.generate(["z" * MIN_REQUEST_BYTES])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert WEIGHT_PIECE_BYTES <= MIN_REQUEST_BYTES // 2
    with pytest.raises(grpc.RpcError) as err:
        client.update_weights({"big": torch.zeros(MIN_REQUEST_BYTES // 4 + 1)})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tensor big" in err.value.details()
    with pytest.raises(InvalidArgument, match="^max_request_bytes: must be in"):
        ServeConfig(max_request_bytes=MIN_REQUEST_BYTES - 1)


def test_every_server_reports_its_own_instance_id_in_info_and_in_every_batch(client):
    info = client.server_info()
    assert len(info["instance_id"]) == 32
    table = client.generate([[1]], n=2, sampling=dict(max_tokens=2))
    assert table.schema.metadata[b"instance_id"] == info["instance_id"].encode()
    assert table.schema.metadata[b"policy_version"] == str(info["policy_version"]).encode()
    with BackgroundServer(FakeEngine) as other, RolloutClient(other.address, timeout=30) as other_client:
        assert other_client.server_info()["instance_id"] != info["instance_id"]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_a_request_id_is_free_once_its_cancel_is_handled_and_refused_retryably_before(engine_process):
    """Right after a cancel, the same id is either admitted or refused with ABORTED (retryable);
    once the server has handled the cancel, it is admitted. (The server refused it with
    INVALID_ARGUMENT for ~20 ms after a cancel: the engine process's parent kept the id.)"""
    with BackgroundServer(FakeEngine, ServeConfig(port=0, engine_process=engine_process)) as server:
        with RolloutClient(server.address, timeout=30) as client:
            for _ in range(8):
                stream = client.stream([[1]], sampling=dict(max_tokens=60), request_id="again")
                _wait_for(lambda: client.server_info()["kv_blocks_free"] < TOTAL_BLOCKS)
                stream.close()
                table = _generate_retrying_aborted(client, "again")
                assert table.column("request_id").to_pylist() == ["again"]
            stream = client.stream([[1]], sampling=dict(max_tokens=60), request_id="again")
            _wait_for(lambda: client.server_info()["kv_blocks_free"] < TOTAL_BLOCKS)
            stream.close()
            _wait_for(lambda: client.server_info()["kv_blocks_free"] == TOTAL_BLOCKS)  # the cancel is handled
            assert client.generate([[2]], sampling=dict(max_tokens=2), request_id="again").num_rows == 1


def _generate_retrying_aborted(client: RolloutClient, request_id: str):
    for _ in range(200):
        try:
            return client.generate([[2]], sampling=dict(max_tokens=2), request_id=request_id)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED, exc.details()
            time.sleep(0.005)
    raise AssertionError(f"{request_id} was still refused after 200 tries")


def test_the_bytes_per_token_bound_and_a_model_without_tokenizer():
    """L is the longest token's bytes, times 3 behind a normalizer (composition shrinks text); a
    model without tokenizer refuses text by name."""
    tokenizer = Tokenizer.from_file(str(BYTE_TOKENIZER))
    assert longest_token_bytes(tokenizer) == LONGEST_TOKEN
    tokenizer.normalizer = normalizers.NFC()
    assert longest_token_bytes(tokenizer) == 3 * LONGEST_TOKEN
    request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=[1])), pb.Prompt(text="hi")])
    with pytest.raises(InvalidArgument, match=r"^prompts\[1\]\.text: the model has no tokenizer"):
        Admission(None, 8).parse(request)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)
