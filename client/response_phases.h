// Per-phase timings of a response, read by name: a message field `phases`
// whose double fields are the phases, in seconds (GroupedGemmResponse.phases:
// plan, transfer in, queue, kernel, collectives, transfer out). Read through
// reflection so the benches build and run against responses with and
// without the field, and keep every phase it has, whatever its names.
#ifndef SHARDGEMM_CLIENT_RESPONSE_PHASES_H_
#define SHARDGEMM_CLIENT_RESPONSE_PHASES_H_

#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace shardgemm {

class ResponsePhases {
 public:
  // `response`: the response message's type (e.g. v1::GroupedGemmResponse::descriptor()).
  explicit ResponsePhases(const google::protobuf::Descriptor* response);

  // Whether the type has a `phases` message field.
  bool present() const { return phases_ != nullptr; }
  // The phases' field names (e.g. "plan_seconds"), in field order.
  const std::vector<std::string>& names() const { return names_; }
  // Each phase's seconds in `response` (of the type given), in names()' order;
  // zeros where the response leaves them unset.
  std::vector<double> Read(const google::protobuf::Message& response) const;

 private:
  const google::protobuf::FieldDescriptor* phases_ = nullptr;
  std::vector<const google::protobuf::FieldDescriptor*> fields_;
  std::vector<std::string> names_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_RESPONSE_PHASES_H_
