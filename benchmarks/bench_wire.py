"""Host cost of the service path for one RL-sized Generate call (issue 14): 256 finished samples of
1024 prompt + 512 output tokens with top_k-64 support masks (~66 MB of Arrow), stage by stage, on
CPU, without a model: the engine process sending its deliveries through a real pipe and the
server's reader receiving them (CPU time of each thread: the sender's is taken from the engine
process), the server's Arrow encoding into responses of `--flush-rows` samples, the protobuf
serialisation gRPC does on each side, and the client's decoding into one ordered table. Reports
the median CPU milliseconds of each stage over `--repeats` (CPU time: other processes on a shared
host inflate wall time, not this), prints a table and writes JSON.

    python benchmarks/bench_wire.py
    python benchmarks/bench_wire.py --quick      # a short check of the script
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import threading
import time

import numpy as np
from common import environment, print_table, write_json

from rollout.masks.pack import Supports
from rollout.outputs import SampleOutput
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.schema import schema_with_metadata
from rollout.server.convert import StreamEncoder
from rollout.server.pipe import recv_message, send_message
from trainer_client.client import decode_batch, to_table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--flush-rows", type=int, default=32, help="samples per response (the server's --flush-rows)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/bench_wire.json")
    args = p.parse_args()
    if args.quick:
        args.samples, args.prompt_len, args.output_len, args.repeats = 16, 64, 32, 2
    return args


def samples(args: argparse.Namespace) -> list[SampleOutput]:
    """Finished samples as the engine emits them, in a shuffled finishing order."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(args.samples):
        lens = rng.integers(args.top_k - 4, args.top_k + 1, args.output_len).astype(np.int32)  # flat-ish top_p 0.95
        ids = rng.integers(0, 151936, int(lens.sum())).astype(np.int32)
        logp = -rng.random(int(lens.sum()), dtype=np.float32)
        out.append(SampleOutput(
            request_id="r", prompt_index=i // 8, sample_index=i % 8,
            prompt_token_ids=rng.integers(0, 151936, args.prompt_len).tolist(),
            token_ids=rng.integers(0, 151936, args.output_len).tolist(),
            token_logprobs=(-rng.random(args.output_len)).tolist(), finish_reason="length",
            supports=Supports(ids, lens, logp), accept_lengths=[1] * args.output_len, policy_version=0))
    random.Random(0).shuffle(out)
    return out


def timed(fn) -> tuple[float, object]:
    start = time.thread_time()
    value = fn()
    return (time.thread_time() - start) * 1e3, value


def through_pipe(batch: list[SampleOutput]) -> tuple[float, float, list]:
    """(sender CPU ms, receiver CPU ms, what arrived): the engine process's delivery path."""
    ours, theirs = multiprocessing.Pipe()
    got = {}

    def receive():
        got["ms"], got["batch"] = timed(lambda: recv_message(theirs))

    reader = threading.Thread(target=receive)
    reader.start()
    sent, _ = timed(lambda: send_message(ours, batch))
    reader.join()
    return sent, got["ms"], got["batch"]


def one_call(batch: list[SampleOutput], encoder: StreamEncoder, rows: int) -> dict:
    ms = {}
    ms["send"], ms["receive"], got = through_pipe(batch)
    ms["encode"], responses = timed(lambda: [encoder.encode(got[i:i + rows]) for i in range(0, len(got), rows)])
    ms["serialize"], wire = timed(lambda: [r.SerializeToString() for r in responses])
    ms["parse"], parsed = timed(lambda: [pb.GenerateResponse.FromString(w) for w in wire])
    ms["decode"], table = timed(lambda: to_table([decode_batch(r) for r in parsed]))
    ms["total"] = sum(ms.values())
    ms["wire_mb"] = sum(map(len, wire)) / 1e6
    assert table.num_rows == len(batch)
    return ms


def main() -> None:
    args = parse_args()
    batch = samples(args)
    encoder = StreamEncoder(schema_with_metadata("m", "", "none", "support", args.top_k))
    runs = [one_call(batch, encoder, args.flush_rows) for _ in range(args.repeats)]
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row.update(samples=args.samples, output_len=args.output_len, top_k=args.top_k)
    print_table(f"service path of one call, ms (median of {args.repeats}, CPU)", [row],
                ["samples", "output_len", "top_k", "wire_mb", "send", "receive", "encode", "serialize", "parse",
                 "decode", "total"])
    write_json(args.out, dict(args=vars(args), env=environment("cpu"), row=row, runs=runs))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
