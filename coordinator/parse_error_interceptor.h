// A server interceptor that answers a request whose bytes do not parse as the method's message
// INVALID_ARGUMENT with a message naming that message type, instead of gRPC's own answer
// (UNIMPLEMENTED with an empty message, which the callback API hard-codes when deserialization
// fails: grpcpp/impl/codegen/server_callback_handlers.h). Unary and server-streaming methods
// only: on a client or bidi stream (tpserve's API has none; server reflection is one) a message
// that fails to parse ends the reactor's reads like a half-close, which an interceptor cannot
// tell apart, so those keep gRPC's own answer.
#pragma once

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace tpserve {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeParseErrorInterceptorFactory();

}  // namespace tpserve
