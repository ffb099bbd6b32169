#!/usr/bin/python3
"""End-to-end check of tpserve's gRPC API from Python with Debian's python3-grpcio.

Stubs are generated at test time into a temp dir from proto/ (protoc + grpc_python_plugin; the
Debian grpc_tools bundles protoc 3.5, too old for proto3 `optional`, so it is only a fallback).
Usage: python_client_test.py --server HOST:PORT --proto-dir proto
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types


def generate_stubs(proto_dir, out_dir):
    protos = ["tpserve/v1/inference.proto", "grpc/health/v1/health.proto",
              "grpc/reflection/v1alpha/reflection.proto"]
    plugin = shutil.which("grpc_python_plugin")
    protoc = shutil.which("protoc")
    if protoc and plugin:
        cmd = [protoc, "--proto_path=" + proto_dir, "--python_out=" + out_dir,
               "--grpc_python_out=" + out_dir, "--plugin=protoc-gen-grpc_python=" + plugin]
    else:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", "--proto_path=" + proto_dir,
               "--python_out=" + out_dir, "--grpc_python_out=" + out_dir]
    subprocess.run(cmd + protos, check=True, timeout=60)


def import_stubs(proto_dir, tmp):
    """Generates the stubs of proto_dir into tmp and imports them: the public API (pb, pb_grpc)
    and the health service (health_pb, health_grpc)."""
    import grpc  # Debian's python3-grpcio

    generate_stubs(os.path.abspath(proto_dir), tmp)
    # grpc (the real package) is imported already; the generated grpc/health/v1 joins it as a
    # subpackage, tpserve/v1 is a namespace package under tmp.
    grpc.__path__.append(os.path.join(tmp, "grpc"))
    sys.path.append(tmp)
    return types.SimpleNamespace(
        pb=importlib.import_module("tpserve.v1.inference_pb2"),
        pb_grpc=importlib.import_module("tpserve.v1.inference_pb2_grpc"),
        health_pb=importlib.import_module("grpc.health.v1.health_pb2"),
        health_grpc=importlib.import_module("grpc.health.v1.health_pb2_grpc"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto-dir", required=True)
    args = parser.parse_args()

    import grpc  # Debian's python3-grpcio

    tmp = tempfile.mkdtemp(prefix="tpserve_py_")
    try:
        stubs = import_stubs(args.proto_dir, tmp)
        pb, pb_grpc = stubs.pb, stubs.pb_grpc
        health_pb, health_grpc = stubs.health_pb, stubs.health_grpc

        channel = grpc.insecure_channel(args.server)
        grpc.channel_ready_future(channel).result(timeout=10)

        health = health_grpc.HealthStub(channel)
        status = health.Check(health_pb.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb.HealthCheckResponse.SERVING, status

        stub = pb_grpc.InferenceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.tp >= 1 and info.kv.total_blocks > 0, info

        req = pb.GenerateRequest(text="def add(a, b):\n", request_id="py-1")
        req.stopping.max_new_tokens = 12
        req.stopping.ignore_eos = True
        unary = stub.Generate(req, timeout=60)
        assert unary.request_id == "py-1", unary.request_id
        assert unary.output_tokens == 12 and len(unary.token_ids) == 12, unary
        assert unary.finish_reason == pb.FINISH_REASON_LENGTH, unary.finish_reason

        text, ids, last = "", [], None
        for msg in stub.GenerateStream(req, timeout=60):
            text += msg.text
            ids.extend(msg.token_ids)
            last = msg
        assert last is not None and last.finished, last
        assert text == unary.text, (text, unary.text)
        assert ids == list(unary.token_ids), (ids, list(unary.token_ids))

        # logprobs = 3: one entry per token, aligned, 3 alternatives each, unary and streaming.
        lp_req = pb.GenerateRequest()
        lp_req.CopyFrom(req)
        lp_req.sampling.logprobs = 3
        lp = stub.Generate(lp_req, timeout=60)
        assert list(lp.token_ids) == list(unary.token_ids), lp
        assert len(lp.logprobs) == len(lp.token_ids), len(lp.logprobs)
        for tok_id, entry in zip(lp.token_ids, lp.logprobs):
            assert entry.token_id == tok_id and entry.logprob <= 0, entry
            assert len(entry.top_logprobs) == 3, entry
            assert entry.top_logprobs[0].token_id == tok_id, entry  # greedy: the top-1
        streamed = []
        for msg in stub.GenerateStream(lp_req, timeout=60):
            assert len(msg.logprobs) == len(msg.token_ids), msg
            streamed.extend(msg.logprobs)
        assert [e.token_id for e in streamed] == list(lp.token_ids), streamed
        for n in (21, -1):
            bad_lp = pb.GenerateRequest(text="x")
            bad_lp.sampling.logprobs = n
            try:
                stub.Generate(bad_lp, timeout=10)
                raise AssertionError("logprobs = %d was accepted" % n)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
                assert "sampling.logprobs" in e.details(), e.details()

        bad = pb.GenerateRequest(text="x")
        bad.sampling.top_p = 2.0
        try:
            stub.Generate(bad, timeout=10)
            raise AssertionError("top_p = 2 was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
            assert "sampling.top_p" in e.details(), e.details()

        toks = stub.Tokenize(pb.TokenizeRequest(text="print('hi')"), timeout=10)
        back = stub.Detokenize(pb.DetokenizeRequest(token_ids=toks.token_ids), timeout=10)
        assert back.text == "print('hi')", back.text

        # Server reflection (what grpcurl and similar tools use): the services, then the
        # descriptor of the file that defines tpserve.v1.Inference.
        from google.protobuf import descriptor_pb2
        refl_pb = importlib.import_module("grpc.reflection.v1alpha.reflection_pb2")
        refl_grpc = importlib.import_module("grpc.reflection.v1alpha.reflection_pb2_grpc")
        refl = refl_grpc.ServerReflectionStub(channel)
        asks = [refl_pb.ServerReflectionRequest(list_services=""),
                refl_pb.ServerReflectionRequest(file_containing_symbol="tpserve.v1.Inference"),
                refl_pb.ServerReflectionRequest(file_containing_symbol="tpserve.v1.NoSuchThing")]
        answers = list(refl.ServerReflectionInfo(iter(asks), timeout=10))
        assert len(answers) == 3, answers
        services = {s.name for s in answers[0].list_services_response.service}
        for want in ("tpserve.v1.Inference", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection"):
            assert want in services, (want, services)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in answers[1].file_descriptor_response.file_descriptor_proto]
        inference = [f for f in files if f.package == "tpserve.v1"]
        assert inference, [f.name for f in files]
        methods = {m.name for f in inference for s in f.service if s.name == "Inference"
                   for m in s.method}
        assert {"Generate", "GenerateStream", "Tokenize", "Detokenize",
                "GetModelInfo"} <= methods, methods
        assert answers[2].HasField("error_response"), answers[2]
        assert answers[2].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], \
            answers[2].error_response
        print("python client: OK (%d output tokens, %r; reflection lists %d services)"
              % (unary.output_tokens, unary.text[:40], len(services)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
