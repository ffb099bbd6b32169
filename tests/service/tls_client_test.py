#!/usr/bin/python3
"""TLS on tpserve's gRPC API from Python (Debian's python3-grpcio, ssl_channel_credentials): the
server's certificate verifies against --ca and a request is served; with --client-cert/--client-key
(mutual TLS) also, and --expect-refused-without-client-cert checks that a client without one is
refused. With --api-key the key travels as gRPC call credentials (access_token_call_credentials:
`authorization: Bearer KEY`, sent only over TLS), unary and streaming calls are served with it
and refused UNAUTHENTICATED without it.
Usage: tls_client_test.py --server HOST:PORT --proto-dir proto --ca PEM [--client-cert PEM
       --client-key PEM [--expect-refused-without-client-cert]] [--api-key KEY]
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_client_test import import_stubs  # noqa: E402


def read(path):
    with open(path, "rb") as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--client-cert")
    parser.add_argument("--client-key")
    parser.add_argument("--expect-refused-without-client-cert", action="store_true")
    parser.add_argument("--api-key")
    args = parser.parse_args()

    import grpc  # Debian's python3-grpcio

    tmp = tempfile.mkdtemp(prefix="tpserve_py_")
    stubs = import_stubs(args.proto_dir, tmp)
    pb, pb_grpc = stubs.pb, stubs.pb_grpc

    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                             stopping=pb.StoppingOptions(max_new_tokens=3, ignore_eos=True))
    client = {}
    if args.client_cert:
        client = {"private_key": read(args.client_key), "certificate_chain": read(args.client_cert)}
    creds = grpc.ssl_channel_credentials(root_certificates=read(args.ca), **client)
    if args.api_key:
        with grpc.secure_channel(args.server, creds) as channel:
            try:
                pb_grpc.InferenceStub(channel).Generate(req, timeout=30)
                raise AssertionError("a TLS call without the API key was served")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
                print("TLS without the API key: UNAUTHENTICATED")
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(args.api_key))
    with grpc.secure_channel(args.server, creds) as channel:
        stub = pb_grpc.InferenceStub(channel)
        resp = stub.Generate(req, timeout=60)
        assert len(resp.token_ids) == 3, resp
        print("TLS: served %d tokens" % len(resp.token_ids))
        if args.api_key:
            streamed = [t for r in stub.GenerateStream(req, timeout=60) for t in r.token_ids]
            assert streamed == list(resp.token_ids), (streamed, resp.token_ids)
            print("TLS with the API key as call credentials: streamed %d tokens" % len(streamed))

    if args.expect_refused_without_client_cert:
        creds = grpc.ssl_channel_credentials(root_certificates=read(args.ca))
        with grpc.secure_channel(args.server, creds) as channel:
            try:
                pb_grpc.InferenceStub(channel).Generate(req, timeout=10)
                raise AssertionError("a client without a certificate was served")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
                print("without a client certificate: refused (%s)" % e.code())

    # A plain-text client gets nothing from a TLS port.
    with grpc.insecure_channel(args.server) as channel:
        try:
            pb_grpc.InferenceStub(channel).Generate(req, timeout=10)
            raise AssertionError("a plain-text client was served")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            print("plain text: refused")


if __name__ == "__main__":
    main()
