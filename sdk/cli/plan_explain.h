// `shardserve plan --explain`: the planner's search (coordinator/planner/planner.h, ExplainPlan)
// in words and numbers, as a table or as JSON. Formatting only: every figure and verdict comes
// from the PlanExplanation, which the planner computes on the same code path as the plan.
#ifndef SHARDSERVE_SDK_CLI_PLAN_EXPLAIN_H_
#define SHARDSERVE_SDK_CLI_PLAN_EXPLAIN_H_

#include <string>

#include "coordinator/planner/planner.h"

namespace shardserve::cli {

// A layout as "tp=8 pp=2 replicas=3" ("tp=4..8" when its workers differ, "replicas=5..2" for a
// merged range, " (expert spill)" when it spills experts).
std::string LayoutName(const LayoutEvaluation& layout);

// Multi-line text: the resolved policy, the search order, every layout evaluated with its verdict,
// reason and per-rank figures (weights, minimum KV, KV capacity in tokens and bytes, free memory),
// and why the chosen layout wins. Stage rows of the chosen layout are listed for at most
// `max_replicas` replicas (the rest are counted). Pure.
std::string ExplanationToText(const PlanExplanation& ex, int max_replicas = 8);

// One JSON object: {"plan": {...} | null, "error": "..." | null, "explain": {...}}, every layout and
// stage included. Pure.
std::string ExplanationToJson(const PlanExplanation& ex);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_SDK_CLI_PLAN_EXPLAIN_H_
