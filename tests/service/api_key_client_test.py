#!/usr/bin/python3
"""API keys on tpserve's gRPC API from Python (Debian's python3-grpcio): calls without a key or
with a wrong one end UNAUTHENTICATED with a message, the right key in `authorization: Bearer`
metadata is served, health needs no key.
Usage: api_key_client_test.py --server HOST:PORT --proto-dir proto --key KEY
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_client_test import import_stubs  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args()

    import grpc  # Debian's python3-grpcio

    tmp = tempfile.mkdtemp(prefix="tpserve_py_")
    stubs = import_stubs(args.proto_dir, tmp)
    pb, pb_grpc = stubs.pb, stubs.pb_grpc
    health_pb, health_grpc = stubs.health_pb, stubs.health_grpc

    channel = grpc.insecure_channel(args.server)
    grpc.channel_ready_future(channel).result(timeout=10)
    health = health_grpc.HealthStub(channel)
    status = health.Check(health_pb.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb.HealthCheckResponse.SERVING, status
    print("health without a key: SERVING")

    stub = pb_grpc.InferenceStub(channel)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                             stopping=pb.StoppingOptions(max_new_tokens=3, ignore_eos=True))
    for name, metadata in [("no key", None),
                           ("a wrong key", [("authorization", "Bearer wrong")]),
                           ("no Bearer", [("authorization", args.key)])]:
        for call in (lambda md: stub.Generate(req, timeout=30, metadata=md),
                     lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                                  metadata=md)):
            try:
                call(metadata)
                raise AssertionError("a call with %s was served" % name)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (name, e.code(), e.details())
                assert "authorization: Bearer" in e.details(), e.details()
        print("%s: UNAUTHENTICATED" % name)

    good = [("authorization", "Bearer " + args.key)]
    resp = stub.Generate(req, timeout=60, metadata=good)
    assert len(resp.token_ids) == 3, resp
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=good)
    assert info.vocab_size > 0, info
    print("the right key: served %d tokens" % len(resp.token_ids))


if __name__ == "__main__":
    main()
