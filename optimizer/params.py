"""How the search space maps onto Optuna distributions (shared by the study and the samplers)."""

from __future__ import annotations

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from optimizer.space import SearchSpace


def distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    """Fixed distributions for every parameter a trial of this space may suggest."""
    dists: dict[str, BaseDistribution] = {
        "num_steps": IntDistribution(space.num_steps.low, space.num_steps.high),
        "topk": CategoricalDistribution(sorted(space.topk)),
    }
    if any(t > 1 for t in space.topk):
        dists["num_draft_tokens"] = IntDistribution(space.num_draft_tokens.low, space.num_draft_tokens.high)
    if space.cuda_graph_max_bs is not None:
        dists["cuda_graph_max_bs"] = CategoricalDistribution(sorted(space.cuda_graph_max_bs))
    return dists
