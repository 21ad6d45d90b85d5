"""Collective names that moved between PyTorch releases: torch 2.13 renamed all_gather_into_tensor and
reduce_scatter_tensor to all_gather_single and reduce_scatter_single (same signatures, old names
deprecated); torch 2.11 has only the old ones."""
import torch.distributed as dist

all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
