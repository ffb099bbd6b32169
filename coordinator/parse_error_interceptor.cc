// The parse-error interceptor (see parse_error_interceptor.h). gRPC deserializes a request
// before any interceptor runs and hands interceptors a null message when that failed
// (POST_RECV_MESSAGE); the handler then fails the call, and the status passes PRE_SEND_STATUS,
// where it is replaced.
#include "coordinator/parse_error_interceptor.h"

#include <string>

#include <google/protobuf/descriptor.h>

#include "absl/strings/str_cat.h"

namespace tpserve {
namespace {

using grpc::experimental::InterceptionHookPoints;

// "/tpserve.v1.Inference/Generate" -> the full name of its input message, or "" when unknown.
std::string InputTypeOf(const char* method) {
  if (method == nullptr) return "";
  std::string name(method);
  if (!name.empty() && name[0] == '/') name.erase(0, 1);
  const size_t slash = name.rfind('/');
  if (slash == std::string::npos) return "";
  name[slash] = '.';
  const google::protobuf::MethodDescriptor* m =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(name);
  return m == nullptr ? "" : m->input_type()->full_name();
}

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(grpc::experimental::ServerRpcInfo* info) : info_(info) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // Only where the one request message arrives before the handler runs (unary and server
    // streaming: every tpserve.v1 method). On a client or bidi stream a null message is also
    // what the end of the stream looks like, so those (server reflection) keep gRPC's answer.
    const auto type = info_->type();
    const bool single_request = type == grpc::experimental::ServerRpcInfo::Type::UNARY ||
                                type == grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING;
    if (single_request &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        methods->GetSendStatus().error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      const std::string type = InputTypeOf(info_->method());
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("the request's bytes do not parse as a protobuf ",
                       type.empty() ? "message" : type,
                       " (see proto/tpserve/v1/inference.proto for the API's messages)")));
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  bool unparsed_ = false;
};

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info);
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeParseErrorInterceptorFactory() {
  return std::make_unique<ParseErrorInterceptorFactory>();
}

}  // namespace tpserve
