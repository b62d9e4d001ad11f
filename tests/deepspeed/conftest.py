import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """deepspeed.initialize leaves a one-rank process group, as DeepSpeed does; the next test starts without it."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
