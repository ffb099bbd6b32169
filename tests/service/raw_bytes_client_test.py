#!/usr/bin/python3
"""Request bytes that are not the method's protobuf message, sent by Python grpcio with identity
serializers (raw bytes on the wire): every tpserve.v1.Inference method answers INVALID_ARGUMENT
with a message naming the expected message type, and a well-formed request is served after.
Usage: raw_bytes_client_test.py --server HOST:PORT
"""

import argparse

GARBAGE = [
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint that never ends
    b"\x0a\x40abc",                                   # a field longer than the message
    b"\x07",                                          # wire type 7 does not exist
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    args = parser.parse_args()

    import grpc  # Debian's python3-grpcio

    channel = grpc.insecure_channel(args.server)
    grpc.channel_ready_future(channel).result(timeout=10)
    unary = {
        "Generate": "GenerateRequest",
        "Tokenize": "TokenizeRequest",
        "Detokenize": "DetokenizeRequest",
        "GetModelInfo": "GetModelInfoRequest",
        "DropPrefixCache": "DropPrefixCacheRequest",
    }
    for method, message in unary.items():
        call = channel.unary_unary("/tpserve.v1.Inference/" + method)  # bytes in, bytes out
        for garbage in GARBAGE:
            try:
                call(garbage, timeout=30)
                raise AssertionError("%s accepted %r" % (method, garbage))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.code(), e.details())
                assert "tpserve.v1." + message in e.details(), e.details()
                details = e.details()
        print("%s: INVALID_ARGUMENT: %s" % (method, details))

    stream = channel.unary_stream("/tpserve.v1.Inference/GenerateStream")
    for garbage in GARBAGE:
        try:
            for _ in stream(garbage, timeout=30):
                raise AssertionError("GenerateStream answered %r" % garbage)
            raise AssertionError("GenerateStream ended OK on %r" % garbage)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert "tpserve.v1.GenerateRequest" in e.details(), e.details()
            details = e.details()
    print("GenerateStream: INVALID_ARGUMENT: %s" % details)

    # A well-formed GenerateRequest written by hand: token_ids {ids: [5, 6, 7]} (field 3),
    # stopping {max_new_tokens: 2} (field 5, its field 1).
    good = b"\x1a\x05\x0a\x03\x05\x06\x07" + b"\x2a\x02\x08\x02"
    reply = channel.unary_unary("/tpserve.v1.Inference/Generate")(good, timeout=60)
    assert len(reply) > 0, reply
    print("a valid request after them: served (%d bytes)" % len(reply))


if __name__ == "__main__":
    main()
