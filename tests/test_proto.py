"""The committed gRPC stubs match a fresh generation from proto/rollout/v1/rollout.proto, import
as a package under protobuf 7, and carry the fields the wire contract needs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.proto.rollout.v1 import rollout_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _gen_proto_module():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_fresh_generation(tmp_path):
    gen = _gen_proto_module()
    for fresh in gen.generate(tmp_path):
        committed = ROOT / "rollout" / "proto" / "rollout" / "v1" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{fresh.name} is stale: run scripts/gen_proto.py"


def test_service_methods_and_streaming_kinds():
    service = pb.DESCRIPTOR.services_by_name["Rollout"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "GetServerInfo", "UpdateWeights", "UpdateWeightsShared",
                            "JoinWeightGroup", "LeaveWeightGroup", "UpdateWeightsBroadcast", "ReleaseMemory",
                            "ResumeMemory", "GetDrafterWeights"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert methods["GetDrafterWeights"].server_streaming and not methods["GetDrafterWeights"].client_streaming
    assert methods["UpdateWeights"].client_streaming and not methods["UpdateWeights"].server_streaming
    assert hasattr(rollout_pb2_grpc, "RolloutStub") and hasattr(rollout_pb2_grpc, "RolloutServicer")


def test_sampling_fields_cover_sampling_params_and_presence_is_tracked():
    from dataclasses import fields

    from rollout.engine.params import SamplingParams

    wire = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(SamplingParams)} == wire
    msg = pb.SamplingParams(temperature=0.0, logit_bias={5: -2.5}, stop_token_ids=[1, 2])
    back = pb.SamplingParams.FromString(msg.SerializeToString())
    assert back.HasField("temperature") and back.temperature == 0.0
    assert not back.HasField("top_k")
    assert dict(back.logit_bias) == {5: -2.5} and list(back.stop_token_ids) == [1, 2]


def test_prompt_is_token_ids_or_text():
    ids = pb.Prompt(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    text = pb.Prompt(text="def f():")
    assert ids.WhichOneof("kind") == "token_ids" and text.WhichOneof("kind") == "text"
    req = pb.GenerateRequest(prompts=[ids, text], grammar=pb.Grammar(kind="regex", value="[a-z]+"))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert not back.HasField("n") and back.HasField("grammar") and back.grammar.kind == "regex"
