#include "client/response_phases.h"

namespace shardgemm {

using google::protobuf::FieldDescriptor;

ResponsePhases::ResponsePhases(const google::protobuf::Descriptor* response) {
  const FieldDescriptor* f = response->FindFieldByName("phases");
  if (f == nullptr || f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated()) return;
  phases_ = f;
  const google::protobuf::Descriptor* d = f->message_type();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* phase = d->field(i);
    if (phase->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE && !phase->is_repeated()) {
      fields_.push_back(phase);
      names_.push_back(phase->name());
    }
  }
}

std::vector<double> ResponsePhases::Read(const google::protobuf::Message& response) const {
  std::vector<double> seconds;
  if (phases_ == nullptr || response.GetDescriptor() != phases_->containing_type()) return seconds;
  const google::protobuf::Message& m = response.GetReflection()->GetMessage(response, phases_);
  for (const FieldDescriptor* f : fields_) seconds.push_back(m.GetReflection()->GetDouble(m, f));
  return seconds;
}

}  // namespace shardgemm
