// How a MoE layer routes a token: the scoring rule and its parameters, as plain data. The backend
// op MoeRoute (backend.h) carries it, and RouteToken (moe_math.h) runs it on one token on the host
// or the device. No functions here, so that backend.h can name the types without the math.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_MOE_ROUTING_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_MOE_ROUTING_H_

#include <cstdint>

namespace shardserve::kernels {

// The routing rules of moe_math.h / row_math.h, one per scoring of the engine's MoeSpec.
enum class MoeRouteScoring : uint8_t {
  kSoftmaxTopK,          // RouteTopK: Mixtral, Qwen-MoE (renormalised when `renormalize`)
  kSigmoidTopK,          // RouteSigmoidTopK: Llama-4 (the weights scale the experts' inputs)
  kSigmoidGrouped,       // RouteSigmoidGrouped: DeepSeek-V3 (score bias, groups, renormalize, scaling)
  kSoftmaxGroupLimited,  // RouteSoftmaxGroupLimited: DeepSeek-V2 (groups, scaling)
};

// The parameters of one layer's routing. Valid when 1 <= top_k <= num_experts, n_group >= 1
// divides num_experts, 1 <= topk_group <= n_group, and: kSigmoidGrouped has at least 2 experts per
// group; kSoftmaxGroupLimited has top_k <= topk_group * num_experts / n_group. The other scorings
// ignore n_group and topk_group (MoeRouteParams::Validate checks all of this).
struct MoeRouting {
  MoeRouteScoring scoring = MoeRouteScoring::kSoftmaxTopK;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t n_group = 1;
  int32_t topk_group = 1;
  bool renormalize = true;  // kSoftmaxTopK, kSigmoidGrouped: the chosen weights sum to 1 (norm_topk_prob)
  float scaling = 1.0f;     // kSigmoidGrouped, kSoftmaxGroupLimited: routed_scaling_factor
};

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_MOE_ROUTING_H_
