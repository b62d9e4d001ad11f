"""deepspeed.accelerator: `get_accelerator()`, the device questions scripts ask, answered by torch.

A CUDA accelerator when torch sees a GPU, else a CPU one. Both are thin: each
method is the torch call DeepSpeed's own accelerator makes for that device.
Building DeepSpeed's ops (`create_op_builder`, `op_builder_dir`) is refused:
there are none to build here.
"""

from __future__ import annotations

import os

import torch


class _Accelerator:
    _name = ""
    _backend = ""

    def device_name(self, device_index=None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        return self._backend

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def random(self):
        return torch.random

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass

    def lazy_call(self, callback):
        return callback()

    def create_op_builder(self, class_name: str):
        raise RuntimeError(f"get_accelerator().create_op_builder({class_name!r}): infinity builds no DeepSpeed ops; "
                           "its native I/O and CPU Adam are part of the package (import infinity.deepspeed's "
                           "ops.adam.DeepSpeedCPUAdam instead of building one)")

    get_op_builder = create_op_builder


class CPU_Accelerator(_Accelerator):
    _name = "cpu"
    _backend = "gloo"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float, torch.bfloat16, torch.float16]

    def is_synchronized_device(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def memory_allocated(self, device_index=None) -> int:
        from infinity.memory_stats import rss_bytes

        return rss_bytes()

    def max_memory_allocated(self, device_index=None) -> int:
        from infinity.memory_stats import peak_rss_bytes

        return peak_rss_bytes()

    def reset_peak_memory_stats(self, device_index=None) -> None:
        from infinity.memory_stats import reset_peak

        reset_peak()

    def total_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CUDA_Accelerator(_Accelerator):
    _name = "cuda"
    _backend = "nccl"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    @property
    def Stream(self):
        return torch.cuda.Stream

    @property
    def Event(self):
        return torch.cuda.Event

    def stream(self, s):
        return torch.cuda.stream(s)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)


_current: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    """The accelerator of this process: CUDA when torch sees a GPU, else CPU (DS_ACCELERATOR=cpu|cuda picks)."""
    global _current
    if _current is None:
        want = os.environ.get("DS_ACCELERATOR")
        if want not in (None, "cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={want!r}: infinity has the cpu and cuda accelerators")
        if want == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda, but torch sees no CUDA device")
        _current = CUDA_Accelerator() if want == "cuda" or (want is None and torch.cuda.is_available()) \
            else CPU_Accelerator()
    return _current


def set_accelerator(accel: _Accelerator) -> None:
    global _current
    _current = accel


def is_current_accelerator_supported() -> bool:
    return True
