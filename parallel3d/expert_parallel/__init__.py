"""Expert parallelism: top-k router, all-to-all dispatch/combine over the EP group, grouped experts."""
from parallel3d.expert_parallel.dispatch import ExpertExchange, Permutation, permute, unpermute
from parallel3d.expert_parallel.experts import GroupedExperts, grouped_swiglu_loop, grouped_swiglu_padded
from parallel3d.expert_parallel.layer import MoELayer, SharedExperts
from parallel3d.expert_parallel.router import (Router, Routing, capacity_keep_mask, expert_capacity,
                                               switch_aux_loss, update_expert_bias)

__all__ = ["MoELayer", "SharedExperts", "Router", "Routing", "GroupedExperts", "ExpertExchange", "Permutation",
           "permute", "unpermute", "grouped_swiglu_loop", "grouped_swiglu_padded", "capacity_keep_mask",
           "expert_capacity", "switch_aux_loss", "update_expert_bias"]
