"""deepspeed.pipe: PipelineModule, LayerSpec and TiedLayerSpec import, so scripts with a pipeline path load.

LayerSpec builds its layer, as DeepSpeed's does. Building a PipelineModule
is refused: pipeline parallelism is not in infinity yet (it is the planned
"tensor and pipeline parallelism" feature, on torch.distributed.pipelining).
Scripts that take a data-parallel path (`-p 1`, no PipelineModule) run.
"""

from __future__ import annotations


class LayerSpec:
    """A layer's class and arguments, built later (`build()`)."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not isinstance(typename, type):
            raise TypeError(f"LayerSpec: the first argument is the layer's class (an nn.Module subclass), got "
                            f"{typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False):
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__}, {self.module_args}, {self.module_kwargs})"


class TiedLayerSpec(LayerSpec):
    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",),
                 **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr


class PipelineModule:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.pipe.PipelineModule: pipeline parallelism is not in infinity yet (the "
                                  "planned tensor and pipeline parallelism feature, on torch.distributed.pipelining)."
                                  " Run the script's data-parallel path (a plain nn.Module, e.g. -p 1 / "
                                  "--pipeline-parallel-size 1), which ZeRO partitions and offloads")


class ProcessTopology:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.pipe.ProcessTopology: pipeline and model parallelism are not in "
                                  "infinity yet; it is data parallel with ZeRO partitioning")


PipeDataParallelTopology = PipeModelDataParallelTopology = ProcessTopology
