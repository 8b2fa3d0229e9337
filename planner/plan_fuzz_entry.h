// The fuzzing entry point shared by the libFuzzer target (plan_fuzzer.cc)
// and the bounded gtest driver (plan_fuzz_test.cc).
#ifndef SHARDGEMM_PLANNER_PLAN_FUZZ_ENTRY_H_
#define SHARDGEMM_PLANNER_PLAN_FUZZ_ENTRY_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardgemm {
namespace planner {

// Decodes `data` as newline-separated fields:
//   mesh text | roles text | op (m/k/q) | compat (t = te) | attrs |
//   operand lines "name=SHAPE@SPEC" ... | optional "out=SPEC"
// (attrs: T transposed, B bias, S shared scales, C colwise, R no rowwise,
// F FP8 lhs/rhs (add lhs_scale_inv=/rhs_scale_inv= lines),
// c/d/x/b scaling mode, a digit or '-digit' flatten axis, f = f32 output)
// and plans it. Every outcome must be a plan that passes consistency
// checks or an INVALID_ARGUMENT with a message; anything else aborts.
// Returns 1 when a plan was made, 0 otherwise.
int FuzzPlanOnce(const uint8_t* data, size_t size);

// The same for one partition-spec string: parse, and when it parses,
// format/re-parse must round-trip.
void FuzzSpecOnce(const std::string& text);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_PLAN_FUZZ_ENTRY_H_
