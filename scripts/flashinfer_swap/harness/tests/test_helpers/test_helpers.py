import torch


def clear_cuda_cache(device: torch.device) -> None:
    torch.cuda.empty_cache()
