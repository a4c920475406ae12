"""gRPC's own receive ceiling in Python (issue 15): how many bytes a bare server takes per second.

A server whose client-streaming handler only counts the bytes of raw messages (no protobuf, no
copy into an arena) receives --gb GB in 16 MiB messages from --streams parallel calls, each from
its own client process and connection; a grpc.aio server (as `rollout serve` runs) and a thread
pool server side by side. What UpdateWeights can reach over loopback is bounded by this: the
received bytes are turned into a Python bytes object on the thread that handles the call.

    python benchmarks/bench_grpc_receive.py --gb 1             # CPU check
    python benchmarks/bench_grpc_receive.py --gb 4 --streams 1,2,4
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

MESSAGE = 16 << 20
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
COLUMNS = ["server", "streams", "gb", "seconds", "gb_per_s"]


def _count(messages) -> bytes:
    return sum(len(m) for m in messages).to_bytes(8, "little")


async def _count_async(messages, context) -> bytes:
    total = 0
    async for m in messages:
        total += len(m)
    return total.to_bytes(8, "little")


def _handler(fn) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("bench.Receive", {"Up": grpc.stream_unary_rpc_method_handler(fn)})


async def _serve_aio(ports: mp.Queue) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((_handler(_count_async),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def serve(kind: str, ports: mp.Queue) -> None:
    if kind == "aio":
        asyncio.run(_serve_aio(ports))
        return
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
    server.add_generic_rpc_handlers((_handler(lambda messages, context: _count(messages)),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def send(port: int, nbytes: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        message = bytes(MESSAGE)
        channel.stream_unary("/bench.Receive/Up")(iter([message] * (nbytes // MESSAGE)))


def run(kind: str, streams: list[int], nbytes: int) -> list[dict]:
    ports: mp.Queue = mp.Queue()
    server = mp.Process(target=serve, args=(kind, ports), daemon=True)
    server.start()
    port, rows = ports.get(timeout=60), []
    try:
        for n in streams:
            clients = [mp.Process(target=send, args=(port, nbytes // n)) for _ in range(n)]
            start = time.perf_counter()
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            seconds = time.perf_counter() - start
            sent = n * (nbytes // n // MESSAGE) * MESSAGE
            rows.append(dict(server=kind, streams=n, gb=sent / 1e9, seconds=seconds, gb_per_s=sent / 1e9 / seconds))
    finally:
        server.kill()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="GiB received per row")
    p.add_argument("--streams", default="1,2,4", help="comma-separated: parallel calls per row")
    p.add_argument("--servers", default="aio,sync", help="comma-separated: grpc.aio and/or thread pool server")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_grpc_receive.json"))
    args = p.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    rows = [row for kind in args.servers.split(",") for row in run(kind, streams, int(args.gb * (1 << 30)))]
    print_table("bare gRPC receive over loopback, 16 MiB messages", rows, COLUMNS)
    write_json(args.out, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
