"""Data utilities: load-balancing distributed samplers (guidelines §7)."""

from ortrain.utils.data.load_balancing_batch_sampler import LoadBalancingDistributedBatchSampler
from ortrain.utils.data.load_balancing_sampler import LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
