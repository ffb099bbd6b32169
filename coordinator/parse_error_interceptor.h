// A server interceptor that answers a request whose bytes do not parse as the method's message
// INVALID_ARGUMENT with a message naming that message type, instead of gRPC's own answer
// (UNIMPLEMENTED with an empty message, which the callback API hard-codes when deserialization
// fails: grpcpp/impl/codegen/server_callback_handlers.h).
#pragma once

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace tpserve {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeParseErrorInterceptorFactory();

}  // namespace tpserve
